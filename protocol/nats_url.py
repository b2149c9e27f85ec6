"""``SIE_NATS_URL`` as a comma-separated list of servers: one URL for a single nats-server, all of a
cluster's members for a JetStream cluster (``sie up --nats-replicas 3``, the chart's
``nats.replicas: 3``). A client given every member connects to whichever answers and, when that one
goes, reconnects to another without waiting for it to come back."""

from __future__ import annotations

SCHEMES = ("nats://", "tls://", "ws://", "wss://")


def nats_servers(url: str) -> list[str]:
    """The servers of ``url`` (``nats://h1:4222,nats://h2:4222``), in order, without blanks.

    Raises ValueError for an empty list or a member with an unknown scheme, naming it."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError("SIE_NATS_URL names no server")
    for server in servers:
        if not server.startswith(SCHEMES):
            raise ValueError(
                f"SIE_NATS_URL member {server!r} is not a NATS URL (it must start with one of {', '.join(SCHEMES)})"
            )
    return servers


# A member that stops answering (SIGSTOP, a hung VM, a partition) keeps its TCP connections open, so
# a client learns it is gone only when its pings go unanswered: every client pings every
# PING_INTERVAL_S and reconnects to another member after MAX_OUTSTANDING_PINGS unanswered ones
# (nats-py's defaults, 120 s and 2, left a gateway on a stopped member for minutes).
PING_INTERVAL_S = 2
MAX_OUTSTANDING_PINGS = 2
