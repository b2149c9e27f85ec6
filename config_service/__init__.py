"""The config service: single-writer store of model configs, config API, epoch, NATS deltas."""
