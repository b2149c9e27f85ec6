"""NATS subject names and the id normalisation every producer and consumer shares."""

from __future__ import annotations

import functools
import re

WORK_PREFIX = "sie.work"
# gateway → a lane's sidecars on core NATS (a queue group per durable), while the lane's stream or
# durable has no leader: the work subject behind this prefix (docs/ha.md, "The direct path")
DIRECT_PREFIX = "sie.direct"
HEALTH_PREFIX = "sie.health"
# gateway → every sidecar: "publish your heartbeat now" (a gateway that starts or reconnects learns
# the live workers at once instead of within a heartbeat interval); outside ``sie.health.>``
HEALTH_SOLICIT = "sie.health_solicit"
PIN_PREFIX = "sie.pin"  # gateway → sidecar: the pinned models of the pools a worker serves
CONFIG_PREFIX = "sie.config.models"
CONFIG_ALL = "sie.config.models._all"
INBOX_PREFIX = "_INBOX"
WORKER_INBOX_PREFIX = "_INBOX_WORKER"
WORK_CANCEL_PREFIX = "work_cancel"
DLQ_PREFIX = "sie.dlq"
DLQ_STREAM = "DEAD_LETTERS"
MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>"
# Headers of a dead letter the sidecar writes itself (a work message terminated as undecodable):
# the body is the original message, these say why and where it came from.
DLQ_REASON_HEADER = "SIE-DLQ-Reason"
DLQ_SUBJECT_HEADER = "SIE-DLQ-Subject"
DLQ_STREAM_SEQ_HEADER = "SIE-DLQ-Stream-Seq"

# Priority classes. Interactive work travels on the lane's subjects, bulk work on the same subjects
# with a trailing ``.bulk`` token, consumed by a second durable of the lane (the sidecar pulls
# interactive first and fills the rest of its capacity with bulk).
INTERACTIVE = "interactive"
BULK = "bulk"
PRIORITIES = (INTERACTIVE, BULK)

_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


def normalize_id(value: str) -> str:
    """Map an id to one subject token: ``/``→``__``, ``.``→``_dot_``, ``*``/``>``/whitespace→``_``."""
    out = value.replace("/", "__").replace(".", "_dot_")
    return re.sub(r"[*>\s]", "_", out)


def lane_token(value: str) -> str:
    """A pool, machine profile or bundle as a subject token (lower-cased, normalised, non-empty)."""
    token = normalize_id(value.strip().lower())
    if not token or not _TOKEN_RE.match(token):
        raise ValueError(f"{value!r} is not usable as a subject token")
    return token


def lane_prefix(pool: str, machine_profile: str, bundle: str) -> str:
    """``sie.work.{pool}.{profile}.{bundle}.``: every work subject of one lane starts with it."""
    return f"{WORK_PREFIX}.{lane_token(pool)}.{lane_token(machine_profile)}.{lane_token(bundle)}."


def _check_priority(priority: str) -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    return priority


@functools.lru_cache(maxsize=4096)  # a pure function of a few strings; the gateway asks on every request
def work_subject(
    pool: str, machine_profile: str, bundle: str, model_id: str, priority: str = INTERACTIVE
) -> str:
    subject = lane_prefix(pool, machine_profile, bundle) + normalize_id(model_id)
    return subject + ".bulk" if _check_priority(priority) == BULK else subject


def lane_filter(pool: str, machine_profile: str, bundle: str, priority: str = INTERACTIVE) -> str:
    prefix = lane_prefix(pool, machine_profile, bundle)
    return prefix + "*.bulk" if _check_priority(priority) == BULK else prefix + "*"


def direct_subject(work: str) -> str:
    """The direct-path subject of work subject ``work``: ``sie.direct.`` and the work subject."""
    return f"{DIRECT_PREFIX}.{work}"


def work_subject_of_direct(subject: str) -> str | None:
    """The work subject a direct-path subject carries, or None when it is not one."""
    prefix = DIRECT_PREFIX + "."
    return subject[len(prefix) :] if subject.startswith(prefix) else None


def in_lane(subject: str, prefix: str) -> bool:
    """True when ``subject`` is a work subject (either class) of the lane ``prefix`` (see :func:`lane_prefix`)."""
    tokens = (subject[len(prefix) :] if subject.startswith(prefix) else "").split(".")
    return bool(tokens[0]) and (len(tokens) == 1 or (len(tokens) == 2 and tokens[1] == BULK))


def subject_priority(subject: str) -> str:
    """The priority class of a work subject: bulk when it ends in ``.bulk``, interactive otherwise."""
    parts = (subject or "").split(".")
    return BULK if len(parts) == 7 and parts[6] == BULK else INTERACTIVE


def pool_stream_name(pool: str) -> str:
    return f"WORK_POOL_{lane_token(pool)}"


def pool_stream_subjects(pool: str) -> list[str]:
    return [f"{WORK_PREFIX}.{lane_token(pool)}.*.*.*", f"{WORK_PREFIX}.{lane_token(pool)}.*.*.*.{BULK}"]


# pure; the gateway asks for each request in flight while it looks for stalled lanes
@functools.lru_cache(maxsize=1024)
def lane_durable(pool: str, machine_profile: str, bundle: str, priority: str = INTERACTIVE) -> str:
    name = f"{lane_token(pool)}_{lane_token(machine_profile)}_{lane_token(bundle)}"
    return name + "_bulk" if _check_priority(priority) == BULK else name


RESULTS_TOKEN = "results"


def inbox_prefix(router_id: str) -> str:
    return f"{INBOX_PREFIX}.{router_id}"


def reply_subject(router_id: str, request_id: str) -> str:
    return f"{INBOX_PREFIX}.{router_id}.{request_id}"


def results_subject(router_id: str) -> str:
    """Where a sidecar may send the results of several of this gateway's items in one message (a
    msgpack array of encoded WorkResults): under the gateway's inbox, on a token no request id takes
    (request ids are UUIDs)."""
    return f"{INBOX_PREFIX}.{router_id}.{RESULTS_TOKEN}"


TAKEN_TOKEN = "taken"


def taken_subject(router_id: str, request_id: str, first_slot: int) -> str:
    """Where a sidecar says it took a work message the gateway sent on the direct path (an empty
    message; core NATS keeps nothing, so the gateway sends again what no sidecar took): under the
    gateway's inbox, on a token no request id takes, then the request and the message's first slot."""
    return f"{INBOX_PREFIX}.{router_id}.{TAKEN_TOKEN}.{request_id}.{first_slot}"


def is_valid_reply_subject(subject: str) -> bool:
    return subject.startswith(INBOX_PREFIX + ".") and not subject.startswith(WORKER_INBOX_PREFIX)


def health_subject(worker_id: str) -> str:
    token = normalize_id(worker_id)
    if not token:
        raise ValueError("worker id must not be empty")
    return f"{HEALTH_PREFIX}.{token}"


def pin_subject(worker_id: str) -> str:
    """Where a worker's sidecar hears its pinned models (``{"models": [...]}``, JSON), keyed like
    its heartbeats."""
    return PIN_PREFIX + health_subject(worker_id)[len(HEALTH_PREFIX) :]


def config_subject(bundle: str) -> str:
    return f"{CONFIG_PREFIX}.{lane_token(bundle)}"


def work_cancel_subject(router_id: str, request_id: str) -> str:
    return f"{WORK_CANCEL_PREFIX}.{router_id}.{request_id}"


def dlq_subject(model_token: str) -> str:
    return f"{DLQ_PREFIX}.{model_token}"


def work_model_token(subject: str) -> str:
    """The model token of a work subject ``sie.work.{pool}.{profile}.{bundle}.{model}[.bulk]`` ("unknown" else)."""
    parts = (subject or "").split(".")
    shaped = len(parts) == 6 or (len(parts) == 7 and parts[6] == BULK)
    return parts[5] if shaped and subject.startswith(WORK_PREFIX + ".") and parts[5] else "unknown"
