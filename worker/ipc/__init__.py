"""The queue-mode front door: an IPC server on a Unix socket for the sidecar (``python -m worker.ipc``)."""
