"""The I/O every sie-cluster process shares, over the pure wire contract in ``protocol``: HTTP
bodies, answers and error envelopes (aiohttp), the OpenAPI pages, the event loop, the payload
object store (NATS) and the replica list of a service."""
