"""Framework adapters over the SDK; each needs its optional extra (``langchain``, ``llamaindex``,
``haystack``)."""
