"""sie-cluster gateway: the stateless HTTP edge in front of the NATS JetStream work queues."""
