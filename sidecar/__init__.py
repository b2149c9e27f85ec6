"""The per-pod sidecar: JetStream pull consumer, lane batcher, IPC client of the worker, settlement."""
