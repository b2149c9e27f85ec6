"""What each NATS user of the cluster may publish and subscribe to: one allow-list per role.

Three roles connect to NATS: the gateway, the sidecar and the config service. Each gets a user whose
permissions name exactly the subjects its process uses (protocol/subjects.py) and the JetStream API
calls it makes; everything else is refused by the server. What follows from the lists:

- only the config service publishes config deltas (``sie.config.models.>``): a delta is trusted
  because NATS let it through, not because of a field its sender wrote;
- a sidecar cannot publish work, pins or deltas, read a gateway's inbox (``_INBOX.>``: it answers
  into one, it never subscribes to one; its own inbox is ``_INBOX_WORKER``), write the key-value
  buckets (pools, batches, the result cache) or delete a stream;
- the config service touches nothing but its delta subjects.

The same lists are used by ``sie up`` (deploy/launcher.py writes them into its nats-server's
config) and by the Helm chart (``helm/sie-cluster/files/nats-permissions.json``, written by
``python -m protocol.nats_permissions`` and checked against this module by the tests), so what runs
locally is what the chart deploys. NATS wildcards: ``*`` is one whole token, ``>`` the rest.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from protocol.streams import PAYLOADS_BUCKET
from protocol.subjects import (
    CONFIG_PREFIX,
    DIRECT_PREFIX,
    DLQ_PREFIX,
    DLQ_STREAM,
    HEALTH_PREFIX,
    HEALTH_SOLICIT,
    INBOX_PREFIX,
    MAX_DELIVERIES_ADVISORY,
    PIN_PREFIX,
    WORK_CANCEL_PREFIX,
    WORK_PREFIX,
    WORKER_INBOX_PREFIX,
)

ROLES = ("gateway", "sidecar", "config")

# Buckets and streams of fixed names that only gateways write (the defaults of the gateway's
# settings: pools, result cache, Batch API files and records). A sidecar may create and update
# the work streams, whose names follow the pools and so cannot be listed; these it may not touch.
GATEWAY_OWNED_STREAMS = (
    "KV_SIE_POOLS",
    "KV_SIE_RESULTS",
    "KV_SIE_BATCHES",
    "KV_SIE_BATCH_LEASES",
    "OBJ_SIE_FILES",
    DLQ_STREAM,
)

_OBJ_PAYLOADS = f"OBJ_{PAYLOADS_BUCKET}"

# JetStream calls every JetStream client makes (account info, stream and consumer info).
_JS_READ = [
    "$JS.API.INFO",
    "$JS.API.STREAM.NAMES",  # a stream looked up by subject (the payload store's reads)
    "$JS.API.STREAM.INFO.*",
    "$JS.API.CONSUMER.INFO.*.*",
]

# Reading and writing the payload object store (large items and results): its chunks and
# metadata, the reads behind a get (last message, an ordered consumer and its flow control), and
# the purge of an object's old chunks on a replace.
_PAYLOADS = [
    f"$O.{PAYLOADS_BUCKET}.>",
    f"$JS.API.STREAM.CREATE.{_OBJ_PAYLOADS}",
    f"$JS.API.STREAM.MSG.GET.{_OBJ_PAYLOADS}",
    f"$JS.API.STREAM.PURGE.{_OBJ_PAYLOADS}",
    f"$JS.API.DIRECT.GET.{_OBJ_PAYLOADS}",
    f"$JS.API.DIRECT.GET.{_OBJ_PAYLOADS}.>",
    f"$JS.API.CONSUMER.CREATE.{_OBJ_PAYLOADS}",
    f"$JS.API.CONSUMER.CREATE.{_OBJ_PAYLOADS}.>",
    f"$JS.API.CONSUMER.DELETE.{_OBJ_PAYLOADS}.*",
    "$JS.FC.>",
]


def permissions() -> dict[str, dict[str, Any]]:
    """Each role's ``{"publish": {"allow": [...], "deny": [...]}, "subscribe": {...}}``, as
    nats-server's ``authorization.users[].permissions`` takes it."""
    gateway = {
        "publish": {
            "allow": [
                f"{WORK_PREFIX}.>",  # work, both priority classes
                f"{DIRECT_PREFIX}.>",  # work on the direct path while a lane has no stream leader
                f"{WORK_CANCEL_PREFIX}.>",
                HEALTH_SOLICIT,
                f"{PIN_PREFIX}.>",
                f"{DLQ_PREFIX}.>",  # dead letters forwarded from max-delivery advisories
                f"{INBOX_PREFIX}.>",  # replies to its own requests' inboxes (publish acks)
                "$JS.API.>",  # streams, consumers and buckets it owns: work, pools, batches, cache
                "$KV.>",
                "$O.>",
                "$JS.FC.>",
            ],
        },
        "subscribe": {
            "allow": [
                f"{INBOX_PREFIX}.>",  # results, taken notices, JetStream answers, watchers
                f"{HEALTH_PREFIX}.>",
                f"{CONFIG_PREFIX}.>",
                MAX_DELIVERIES_ADVISORY,
            ],
        },
    }
    sidecar = {
        "publish": {
            "allow": [
                f"{INBOX_PREFIX}.>",  # results into the gateways' inboxes, "taken" notices
                f"{HEALTH_PREFIX}.>",  # heartbeats
                f"{DLQ_PREFIX}.>",  # a work message it cannot decode, terminated
                *_JS_READ,
                "$JS.API.STREAM.CREATE.*",  # the pool's work stream, if no gateway made it yet
                "$JS.API.STREAM.UPDATE.*",  # reconciled to the shared settings
                "$JS.API.CONSUMER.CREATE.*",
                "$JS.API.CONSUMER.CREATE.*.>",
                "$JS.API.CONSUMER.DURABLE.CREATE.*.*",
                "$JS.API.CONSUMER.DELETE.*.*",  # a lane's durable recreated with new settings
                "$JS.API.CONSUMER.MSG.NEXT.*.*",  # pulls
                "$JS.ACK.>",  # ack, nak, progress, term
                *_PAYLOADS,
            ],
            "deny": [
                *(
                    f"$JS.API.STREAM.{op}.{name}"
                    for op in ("CREATE", "UPDATE")
                    for name in GATEWAY_OWNED_STREAMS
                ),
                *(f"$JS.API.CONSUMER.CREATE.{name}" for name in GATEWAY_OWNED_STREAMS),
                *(
                    f"$JS.API.CONSUMER.{op}.{name}.>"
                    for op in ("CREATE", "DELETE")
                    for name in GATEWAY_OWNED_STREAMS
                ),
                *(f"$JS.API.CONSUMER.DURABLE.CREATE.{name}.*" for name in GATEWAY_OWNED_STREAMS),
            ],
        },
        "subscribe": {
            "allow": [
                f"{WORKER_INBOX_PREFIX}.>",  # its own inbox: pulls, JetStream answers
                f"{DIRECT_PREFIX}.>",  # the direct path's queue groups
                f"{WORK_CANCEL_PREFIX}.>",
                HEALTH_SOLICIT,
                f"{PIN_PREFIX}.>",
                f"{CONFIG_PREFIX}.>",
            ],
        },
    }
    config = {
        "publish": {"allow": [f"{CONFIG_PREFIX}.>"]},
        "subscribe": {"deny": [">"]},  # it only publishes
    }
    return {"gateway": gateway, "sidecar": sidecar, "config": config}


def to_json() -> str:
    """The chart's copy (helm/sie-cluster/files/nats-permissions.json): sorted, indented, one
    trailing newline, so that a change shows as a readable diff."""
    return json.dumps(permissions(), indent=2, sort_keys=True) + "\n"


def auth_block(passwords: dict[str, str]) -> str:
    """nats-server's ``authorization { users: [...] }`` for ``passwords`` (role → password), every
    user with its allow-lists (JSON is valid NATS configuration)."""
    perms = permissions()
    users = [{"user": role, "password": passwords[role], "permissions": perms[role]} for role in ROLES]
    return "authorization {\n  users: " + json.dumps(users, indent=2) + "\n}\n"


if __name__ == "__main__":
    sys.stdout.write(to_json())
