"""HTTP-library-free pieces of a request: the client's settings, its headers, the request bodies,
and what an answer's headers say about the request."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, NotRequired, TypedDict, cast
from urllib.parse import urlsplit

from protocol import SERVER_VERSION
from protocol.priority import PRIORITIES, PRIORITY_HEADER
from sdk.media import convert_item
from sdk.types import Options, RequestMeta, Usage

log = logging.getLogger("sdk")

SDK_VERSION = SERVER_VERSION
MSGPACK = "application/msgpack"
JSON = "application/json"
DEFAULT_BASE_URL = "http://localhost:8080"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 150.0
DEFAULT_LEASE_RENEWAL_INTERVAL_S = 60.0
BASE_URL_ENV = "SIE_BASE_URL"
API_KEY_ENV = "SIE_API_KEY"

_USAGE_HEADERS = {
    "X-SIE-Units-Input-Tokens": "input_tokens",
    "X-SIE-Units-Pairs": "pairs",
    "X-SIE-Units-Content-Input-Tokens": "content_input_tokens",
    "X-SIE-Units-Images": "images",
    "X-SIE-Units-Pages": "pages",
    "X-SIE-Units-Output-Tokens": "output_tokens",
    "X-SIE-Units-Audio-Ms": "audio_ms",
}


# ---------------------------------------------------------------- construction


def _origin(url: str) -> tuple[str, str, int] | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port or (443 if scheme == "https" else 80)


def resolve_base_url(base_url: str | None) -> str:
    url = base_url if base_url is not None else (os.environ.get(BASE_URL_ENV, "").strip() or DEFAULT_BASE_URL)
    if _origin(url) is None:
        raise ValueError(f"base_url must be an absolute http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/")


def resolve_api_key(api_key: str | None, base_url: str) -> str | None:
    """An explicit key (even ``""``) wins; ``SIE_API_KEY`` is only sent to the ``SIE_BASE_URL`` origin
    (or to any URL when ``SIE_BASE_URL`` is unset), so a key is never leaked to another host."""
    if api_key is not None:
        return api_key or None
    env_key = os.environ.get(API_KEY_ENV, "").strip()
    if not env_key:
        return None
    env_base = os.environ.get(BASE_URL_ENV, "").strip()
    if env_base and _origin(env_base) != _origin(base_url):
        return None
    return env_key


def resolve_timeouts(
    timeout_s: float | None, connect_timeout_s: float | None, read_timeout_s: float | None
) -> tuple[float, float]:
    """``timeout_s`` sets both phases of an attempt; the specific ones override it."""
    connect = connect_timeout_s if connect_timeout_s is not None else (timeout_s or DEFAULT_CONNECT_TIMEOUT_S)
    read = read_timeout_s if read_timeout_s is not None else (timeout_s or DEFAULT_READ_TIMEOUT_S)
    return float(connect), float(read)


def default_headers(api_key: str | None, remote: str | None = None) -> dict[str, str]:
    headers = {"Content-Type": MSGPACK, "Accept": MSGPACK, "X-SIE-SDK-Version": SDK_VERSION}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if remote is not None:
        if remote != "forbid":
            raise ValueError("remote must be None or 'forbid'")
        headers["X-SIE-Remote"] = "forbid"
    return headers


def admin_headers(admin_key: str | None) -> dict[str, str]:
    """What pool writes (create, renew, delete) send on top of the defaults: the gateway's admin token
    as their bearer token when one is given (a gateway needs it for them in every auth mode); else
    nothing, and they go with the API key, as the public SDK sends them."""
    return {"Authorization": f"Bearer {admin_key}"} if admin_key else {}


JSON_HEADERS = {"Accept": JSON}
JSON_BODY_HEADERS = {"Accept": JSON, "Content-Type": JSON}


def parse_gpu(gpu: str) -> tuple[str | None, str]:
    """``"pool/profile"`` → ``("pool", "profile")``; ``"profile"`` → ``(None, "profile")``."""
    if "/" in gpu:
        pool, profile = gpu.split("/", 1)
        return pool, profile
    return None, gpu


def check_priority(priority: str | None) -> str | None:
    """A priority class the servers know (``interactive`` or ``bulk``), or None for their default."""
    if priority is not None and priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {list(PRIORITIES)} or None, got {priority!r}")
    return priority


def priority_headers(priority: str | None) -> dict[str, str]:
    """``X-SIE-Priority`` for a request of that class (none: the server's default applies)."""
    if not priority:
        return {}
    check_priority(priority)
    return {PRIORITY_HEADER: priority}


def routing_headers(gpu: str | None) -> dict[str, str]:
    if not gpu:
        return {}
    pool, profile = parse_gpu(gpu)
    headers: dict[str, str] = {}
    if pool:
        headers["X-SIE-Pool"] = pool
    if profile:
        headers["X-SIE-MACHINE-PROFILE"] = profile
    return headers


# ---------------------------------------------------------------- request bodies


class ItemsBody(TypedDict):
    """``POST /v1/encode|extract|tokenize/{model}`` (``protocol.api.EncodeRequest`` and its kin)."""

    items: list[Any]
    params: NotRequired[dict[str, object]]


class ScoreBody(TypedDict):
    """``POST /v1/score/{model}`` (``protocol.api.ScoreRequest``): its parameters at the top level."""

    query: Any
    items: list[Any]
    instruction: NotRequired[str]
    options: NotRequired[dict[str, object]]


Body = ItemsBody | ScoreBody


def merge_options(default: Options | None, call: Options | None) -> dict[str, object]:
    return {**(default or {}), **(call or {})}


def _as_list(items: Any) -> tuple[list[Any], bool]:
    if isinstance(items, Mapping):
        return [convert_item(dict(items))], True
    if isinstance(items, (list, tuple)):
        return [convert_item(dict(i)) if isinstance(i, Mapping) else i for i in items], False
    raise TypeError("items must be an item (a dict) or a list of items")


def items_body(items: Any, **params: object) -> tuple[ItemsBody, list[Any], bool]:
    """The body of an encode, extract or tokenize call, the items it sends, and whether the caller
    gave one item (not a list). It carries the ``params`` that are set (neither None nor empty
    options), sequences and mappings among them copied as lists and dicts."""
    item_list, single = _as_list(items)
    body: ItemsBody = {"items": item_list}
    given = {k: _copied(v) for k, v in params.items() if v is not None and not (k == "options" and not v)}
    if given:
        body["params"] = given
    return body, item_list, single


def _copied(value: object) -> object:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    return value


def score_body(query: Any, items: Any, *, instruction: str | None, options: dict[str, object]) -> ScoreBody:
    if not isinstance(query, Mapping):
        raise TypeError("query must be an item (a dict)")
    body: ScoreBody = {"query": convert_item(dict(query)), "items": _as_list(items)[0]}
    if instruction is not None:
        body["instruction"] = instruction
    if options:
        body["options"] = options
    return body


def json_bytes(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# ---------------------------------------------------------------- response headers


def parse_retry_after(value: str | None) -> float | None:
    """Delta-seconds (int or float) or an HTTP-date; unusable values give ``None``."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        now = datetime.now(when.tzinfo) if when.tzinfo else datetime.now(UTC).replace(tzinfo=None)
        return max((when - now).total_seconds(), 0.0)
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return seconds


def request_metadata(headers: Mapping[str, str]) -> RequestMeta | None:
    meta: RequestMeta = {}
    rid = headers.get("X-SIE-Request-ID")
    if rid and len(rid) <= 256 and rid == rid.strip() and rid.isascii() and rid.isprintable():
        meta["id"] = rid
    usage = {
        key: int(raw)
        for header, key in _USAGE_HEADERS.items()
        if (raw := headers.get(header)) and raw.isdigit() and (raw == "0" or not raw.startswith("0"))
    }
    if usage:
        meta["usage"] = cast(Usage, usage)
    served_by = headers.get("X-SIE-Served-By")
    if served_by in ("local", "remote"):
        meta["served_by"] = served_by
    instance = headers.get("X-SIE-Runtime-Instance")
    if instance and len(instance) == 64 and all(c in "0123456789abcdef" for c in instance):
        meta["runtime_instance_id"] = instance
    upstream = headers.get("X-SIE-Upstream")
    if upstream:
        meta["upstream"] = upstream
    reason = headers.get("X-SIE-Fallback-Reason")
    if reason in ("provisioning", "model_loading", "saturated", "unhealthy"):
        meta["fallback_reason"] = reason
    return meta or None


def version_skew(server_version: str | None) -> str | None:
    """A warning when the server's major differs or its minor is more than one apart."""
    if not server_version:
        return None
    try:
        s_major, s_minor = (int(p) for p in server_version.split(".")[:2])
        c_major, c_minor = (int(p) for p in SDK_VERSION.split(".")[:2])
    except ValueError:
        return None
    if s_major != c_major or abs(s_minor - c_minor) > 1:
        return f"SDK version {SDK_VERSION} and server version {server_version} are more than one minor version apart"
    return None
