"""Network code under the adapters: checkpoint files, packed (padding-free) forwards, the GTE "new" encoder."""
