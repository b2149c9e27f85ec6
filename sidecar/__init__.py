"""The per-pod sidecar: the lane consumer (JetStream pulls, batches per model, operation and group
key, RunBatch over IPC, settlement), heartbeats and config deltas."""
