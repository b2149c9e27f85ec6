"""``SIE_NATS_URL`` as a comma-separated list of servers: one URL for a single nats-server, all of a
cluster's members for a JetStream cluster (``sie up --nats-replicas 3``, the chart's
``nats.replicas: 3``). A client given every member connects to whichever answers and, when that one
goes, reconnects to another without waiting for it to come back."""

from __future__ import annotations

import random
import re
from typing import Any

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


def redacted(url: str) -> str:
    """``url`` fit for a log line: each member's password replaced by ``***`` (a NATS URL carries
    its user's password: ``nats://gateway:PASSWORD@host:4222``)."""
    return re.sub(r"(://[^:/@,\s]+):[^@/,\s]*@", r"\1:***@", url)


# A member that stops answering (SIGSTOP, a hung VM, a partition) keeps its TCP connections open, so
# a client learns it is gone only when its pings go unanswered: every client pings every
# PING_INTERVAL_S and reconnects to another member when a ping finds MAX_OUTSTANDING_PINGS still
# unanswered, 2-3 s after the member stopped (nats-py's defaults, 120 s and 2, left a gateway on a
# stopped member for minutes; 2 s and 2 took 4-6 s).
PING_INTERVAL_S = 1
MAX_OUTSTANDING_PINGS = 2


def failover_options(url: str) -> dict[str, Any]:
    """The nats-py connect options of every client of ``url``'s members: the members in an order of
    this process's own (clients spread over them), kept through reconnects, in which nats-py moves
    the member it connected to last, so that a reconnect tries the member just lost after the others
    (nats-py reshuffles them on every reconnect by default, and one time in three tried a stopped
    member first and waited out its connect timeout, 2 s); and the pings that notice a stopped one."""
    servers = nats_servers(url)
    random.shuffle(servers)
    return {
        "servers": servers,
        "dont_randomize": True,
        "ping_interval": PING_INTERVAL_S,
        "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
    }
