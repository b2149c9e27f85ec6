"""Forming batches of tokenised units by cost (``sie serve``'s BatchFormer) and the threads they run on."""
