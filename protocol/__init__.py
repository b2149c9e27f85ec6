"""The wire contract shared by every sie-cluster process (pure: no I/O, no process state)."""

SERVER_VERSION = "0.10.1"
