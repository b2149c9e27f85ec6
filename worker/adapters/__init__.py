"""Model adapters, one module per model family. Each exposes one Adapter subclass."""
