"""HTTP-library-free pieces shared by both clients: request bodies, headers, result parsing,
error envelopes and the exception that each retry-matrix row ends in."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from protocol import SERVER_VERSION
from protocol.codec import CodecError, unpackb
from protocol.priority import PRIORITIES, PRIORITY_HEADER
from sdk import errors as E
from sdk._retry import (
    Answer,
    Decision,
    RetryState,
    Rule,
    Transport,
    classify,
    decide,
    retry_note,
)
from sdk.media import convert_item

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


def merge_options(default: Mapping[str, Any] | None, call: Mapping[str, Any] | None) -> dict[str, Any]:
    merged: dict[str, Any] = dict(default or {})
    merged.update(call or {})
    return merged


def _as_list(items: Any) -> tuple[list[Any], bool]:
    if isinstance(items, Mapping):
        return [convert_item(dict(items))], True
    if isinstance(items, (list, tuple)):
        return [convert_item(dict(i)) if isinstance(i, Mapping) else i for i in items], False
    raise TypeError("items must be an item (a dict) or a list of items")


def encode_body(
    items: Any,
    *,
    output_types: Sequence[str] | None,
    instruction: str | None,
    output_dtype: str | None,
    is_query: bool | None,
    options: dict[str, Any],
) -> tuple[dict[str, Any], list[Any], bool]:
    item_list, single = _as_list(items)
    params: dict[str, Any] = {}
    if output_types is not None:
        params["output_types"] = list(output_types)
    if instruction is not None:
        params["instruction"] = instruction
    if output_dtype is not None:
        params["output_dtype"] = output_dtype
    opts = dict(options)
    if is_query is not None:
        opts["is_query"] = bool(is_query)
    if opts:
        params["options"] = opts
    body: dict[str, Any] = {"items": item_list}
    if params:
        body["params"] = params
    return body, item_list, single


def score_body(query: Any, items: Any, *, instruction: str | None, options: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(query, Mapping):
        raise TypeError("query must be an item (a dict)")
    item_list, _ = _as_list(items)
    body: dict[str, Any] = {"query": convert_item(dict(query)), "items": item_list}
    if instruction is not None:
        body["instruction"] = instruction
    if options:
        body["options"] = options
    return body


def extract_body(
    items: Any,
    *,
    labels: Sequence[str] | None,
    output_schema: Mapping[str, Any] | None,
    instruction: str | None,
    options: dict[str, Any],
) -> tuple[dict[str, Any], list[Any], bool]:
    item_list, single = _as_list(items)
    params: dict[str, Any] = {}
    if labels is not None:
        params["labels"] = list(labels)
    if output_schema is not None:
        params["output_schema"] = dict(output_schema)
    if instruction is not None:
        params["instruction"] = instruction
    if options:
        params["options"] = options
    body: dict[str, Any] = {"items": item_list}
    if params:
        body["params"] = params
    return body, item_list, single


def tokenize_body(items: Any, *, options: dict[str, Any]) -> tuple[dict[str, Any], list[Any], bool]:
    item_list, single = _as_list(items)
    body: dict[str, Any] = {"items": item_list}
    if options:
        body["params"] = {"options": options}
    return body, item_list, single


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


def request_metadata(headers: Mapping[str, str]) -> dict[str, Any] | None:
    meta: dict[str, Any] = {}
    rid = headers.get("X-SIE-Request-ID")
    if rid and len(rid) <= 256 and rid == rid.strip() and rid.isascii() and rid.isprintable():
        meta["id"] = rid
    usage: dict[str, int] = {}
    for header, key in _USAGE_HEADERS.items():
        raw = headers.get(header)
        if raw and raw.isdigit() and (raw == "0" or not raw.startswith("0")):
            usage[key] = int(raw)
    if usage:
        meta["usage"] = usage
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


# ---------------------------------------------------------------- error envelopes


class ErrorInfo:
    """The readable parts of an error answer."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self.body_code: str | None = None
        self.message = f"HTTP {status}"
        self.param: str | None = None
        self.extra: dict[str, Any] = {}
        content_type = (headers.get("Content-Type") or "").lower()
        parsed: Any = None
        if body:
            try:
                parsed = unpackb(body) if MSGPACK in content_type else json.loads(body)
            except (CodecError, ValueError):
                parsed = None
        envelope = None
        if isinstance(parsed, dict):
            envelope = parsed.get("detail") if "detail" in parsed else parsed.get("error")
        if isinstance(envelope, dict):
            code = envelope.get("code")
            self.body_code = str(code) if code not in (None, "") else None
            if isinstance(envelope.get("message"), str) and envelope["message"]:
                self.message = envelope["message"]
            if isinstance(envelope.get("param"), str):
                self.param = envelope["param"]
            self.extra = {k: v for k, v in envelope.items() if k not in ("code", "message", "param")}
        elif isinstance(envelope, str) and envelope:
            self.message = envelope
        elif isinstance(parsed, dict) and isinstance(parsed.get("message"), str) and parsed["message"]:
            self.message = parsed["message"]  # e.g. the 202 provisioning body
        if self.body_code == "provisioning":
            self.body_code = "PROVISIONING"
        header_code = (headers.get("X-SIE-Error-Code") or "").strip()
        if header_code == "provisioning":
            header_code = "PROVISIONING"
        self.code: str | None = header_code or self.body_code
        self.retry_after = parse_retry_after(headers.get("Retry-After"))
        self.request = request_metadata(headers)

    def answer(self) -> Answer:
        return Answer(
            status=self.status, code=self.code, body_code=self.body_code, retry_after=self.retry_after
        )


def build_error(
    rule: Rule,
    info: ErrorInfo,
    *,
    model: str | None = None,
    gpu: str | None = None,
    state: RetryState | None = None,
    lora: str | None = None,
) -> E.SIEError:
    """The exception a call raises when ``rule`` ends it."""
    msg, req, ra = info.message, info.request, info.retry_after
    if rule is Rule.MODEL_LOAD_FAILED:
        permanent = info.extra.get("permanent", True)
        attempts = info.extra.get("attempts", 1)
        error_class = info.extra.get("error_class")
        return E.ModelLoadFailedError(
            msg,
            model=model,
            error_class=error_class if isinstance(error_class, str) else None,
            permanent=permanent if isinstance(permanent, bool) else True,
            attempts=attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else 1,
            param=info.param,
            request=req,
        )
    if rule is Rule.INPUT_TOO_LONG:
        return E.InputTooLongError(msg, model=model, param=info.param, request=req)
    if rule is Rule.PROVISIONING:
        return E.ProvisioningError(
            msg, gpu=gpu, retry_after=ra, param=info.param, request=req, status_code=info.status
        )
    if rule is Rule.LORA_LOADING:
        return E.LoraLoadingError(msg, lora=lora, model=model, request=req)
    if rule is Rule.MODEL_LOADING:
        return E.ModelLoadingError(msg, model=model, request=req)
    if rule is Rule.RESOURCE_EXHAUSTED:
        retries = state.oom_retries if state else 0
        return E.ResourceExhaustedError(
            msg, model=model, retries=retries, param=info.param, request=req, retry_after=ra
        )
    if rule is Rule.RATE_LIMITED:
        return E.RateLimitError(
            msg, code=info.code or "RATE_LIMIT", retry_after=ra, param=info.param, request=req
        )
    if rule in (Rule.QUEUE, Rule.GATEWAY_TIMEOUT, Rule.SERVER_ERROR) or info.status >= 500:
        return E.ServerError(msg, info.code, info.status, param=info.param, request=req, retry_after=ra)
    return E.RequestError(msg, info.code, info.status, param=info.param, request=req)


def terminal_error(info: ErrorInfo, *, model: str | None = None) -> E.SIEError:
    """The exception for an error answer on a route that is not retried (models, health)."""
    return build_error(classify(info.answer()), info, model=model)


# ---------------------------------------------------------------- success bodies


def decode_msgpack_map(body: bytes, *, what: str, status: int, headers: Mapping[str, str]) -> dict[str, Any]:
    try:
        data = unpackb(body)
    except CodecError as exc:
        raise E.RequestError(
            f"Malformed {what} MessagePack response: {exc}",
            status_code=status,
            request=request_metadata(headers),
        ) from exc
    if not isinstance(data, dict):
        raise E.RequestError(
            f"Malformed {what} MessagePack response: expected a map, got {type(data).__name__}",
            status_code=status,
            request=request_metadata(headers),
        )
    return data


def decode_json_object(body: bytes, *, what: str, status: int) -> dict[str, Any]:
    try:
        data = json.loads(body) if body else None
    except ValueError as exc:
        raise E.RequestError(f"Malformed {what} JSON response: {exc}", status_code=status) from exc
    if not isinstance(data, dict):
        raise E.RequestError(f"Malformed {what} JSON response: expected an object", status_code=status)
    return data


def _malformed(what: str, why: str) -> E.RequestError:
    return E.RequestError(f"Malformed {what} MessagePack response: {why}")


def _array(value: Any, what: str, field: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise _malformed(what, f"'{field}' is not an array")
    return value


def _check_count(what: str, model: str, sent: list[Any], results: list[dict[str, Any]], meta: Any) -> None:
    if len(results) == len(sent):
        return
    sent_ids = [i.get("id") if isinstance(i, Mapping) else None for i in sent]
    got_ids = [r.get("id") for r in results]
    missing: list[str] | None = None
    if all(isinstance(i, str) for i in sent_ids) and all(isinstance(i, str) for i in got_ids):
        missing = [str(i) for i in sent_ids if i not in set(got_ids)]
    raise E.IncompleteBatchError(
        f"{what} response carried {len(results)} results for {len(sent)} items",
        code=f"{what.upper()}_RESULT_COUNT_MISMATCH",
        expected=len(sent),
        received=len(results),
        model=model,
        missing_ids=missing,
        request=meta,
        results=results,
    )


def parse_encode(
    data: dict[str, Any], model: str, sent: list[Any], headers: Mapping[str, str]
) -> list[dict[str, Any]]:
    items = data.get("items")
    if not isinstance(items, list):
        raise _malformed("encode", "'items' is missing")
    timing = data.get("timing") if isinstance(data.get("timing"), dict) else None
    meta = _with_truncation_totals(request_metadata(headers), data)
    results: list[dict[str, Any]] = []
    for raw in items:
        if not isinstance(raw, dict):
            raise _malformed("encode", "an item is not a map")
        out: dict[str, Any] = {"model": data.get("model") or model}
        if raw.get("id") is not None:
            out["id"] = raw["id"]
        dense = raw.get("dense")
        if dense is not None:
            out["dense"] = _array(
                dense.get("values") if isinstance(dense, dict) else None, "encode", "dense.values"
            )
        sparse = raw.get("sparse")
        if sparse is not None:
            if not isinstance(sparse, dict):
                raise _malformed("encode", "'sparse' is not a map")
            out["sparse"] = {
                "indices": _array(sparse.get("indices"), "encode", "sparse.indices"),
                "values": _array(sparse.get("values"), "encode", "sparse.values"),
            }
        multi = raw.get("multivector")
        if multi is not None:
            out["multivector"] = _array(
                multi.get("values") if isinstance(multi, dict) else None, "encode", "multivector.values"
            )
        out.update(_truncation(raw))
        if isinstance(raw.get("chunks"), list):  # overflow_policy chunk: spans and a vector per chunk
            out["chunks"] = [
                {
                    "start": int(c["start"]),
                    "end": int(c["end"]),
                    "dense": _array((c.get("dense") or {}).get("values"), "encode", "chunks.dense.values"),
                }
                for c in raw["chunks"]
            ]
        if timing:
            out["timing"] = dict(timing)
        if meta:
            out["request"] = dict(meta)
        results.append(out)
    _check_count("encode", model, sent, results, meta)
    return results


def _with_truncation_totals(meta: dict[str, Any] | None, data: dict[str, Any]) -> dict[str, Any] | None:
    """The answer's truncation totals (``usage.truncated_items``, ``dropped_tokens``) into the request
    metadata every result carries, when the server reported any truncation."""
    body_usage = data.get("usage")
    if not isinstance(body_usage, dict) or not body_usage.get("truncated_items"):
        return meta
    meta = dict(meta or {})
    meta["usage"] = {
        **meta.get("usage", {}),
        "truncated_items": int(body_usage["truncated_items"]),
        "dropped_tokens": int(body_usage.get("dropped_tokens") or 0),
    }
    return meta


def _truncation(raw: dict[str, Any]) -> dict[str, Any]:
    """Truncation reported per item (encode/extract items, score entries): tokens before and after."""
    if not raw.get("truncated"):
        return {}
    return {"truncated": True, "input_tokens": raw.get("input_tokens"), "used_tokens": raw.get("used_tokens")}


def parse_score(data: dict[str, Any], model: str, headers: Mapping[str, str]) -> dict[str, Any]:
    scores = data.get("scores")
    if not isinstance(scores, list):
        raise _malformed("score", "'scores' is missing")
    entries: list[dict[str, Any]] = []
    for s in scores:
        if not isinstance(s, dict) or "item_id" not in s or "score" not in s:
            raise _malformed("score", "a score entry lacks item_id or score")
        entries.append(
            {
                "item_id": s["item_id"],
                "score": float(s["score"]),
                "rank": int(s.get("rank", len(entries))),
                **_truncation(s),
                **{k: s[k] for k in ("span", "chunks") if k in s},
            }
        )
    result: dict[str, Any] = {"model": data.get("model") or model, "scores": entries}
    if data.get("query_id") is not None:
        result["query_id"] = data["query_id"]
    if isinstance(data.get("usage"), dict):
        result["usage"] = data["usage"]
    meta = request_metadata(headers)
    if meta:
        result["request"] = meta
    return result


def _list_of_maps(raw: dict[str, Any], key: str, required: tuple[str, ...]) -> list[dict[str, Any]]:
    value = raw.get(key) or []
    if not isinstance(value, list):
        raise _malformed("extract", f"'{key}' is not a list")
    for entry in value:
        if not isinstance(entry, dict) or any(k not in entry for k in required):
            raise _malformed("extract", f"an entry of '{key}' lacks one of {required}")
    return [dict(e) for e in value]


def parse_extract(
    data: dict[str, Any], model: str, sent: list[Any], headers: Mapping[str, str]
) -> list[dict[str, Any]]:
    items = data.get("items")
    if not isinstance(items, list):
        raise _malformed("extract", "'items' is missing")
    meta = _with_truncation_totals(request_metadata(headers), data)
    results: list[dict[str, Any]] = []
    for raw in items:
        if not isinstance(raw, dict):
            raise _malformed("extract", "an item is not a map")
        out: dict[str, Any] = {"model": data.get("model") or model}
        if raw.get("id") is not None:
            out["id"] = raw["id"]
        out["entities"] = _list_of_maps(raw, "entities", ("text", "label", "score"))
        out["relations"] = _list_of_maps(raw, "relations", ("head", "tail", "relation", "score"))
        out["classifications"] = _list_of_maps(raw, "classifications", ("label", "score"))
        out["objects"] = _list_of_maps(raw, "objects", ("label", "score", "bbox"))
        if raw.get("data"):
            out["data"] = raw["data"]
        out.update(_truncation(raw))
        err = raw.get("error")
        if err is not None:
            err = err if isinstance(err, dict) else {}
            code, message = err.get("code"), err.get("message")
            out["error"] = {
                "code": code if isinstance(code, str) and code.strip() else "INTERNAL_ERROR",
                "message": message
                if isinstance(message, str) and message.strip()
                else "Malformed extraction item error",
            }
        if meta:
            out["request"] = dict(meta)
        results.append(out)
    _check_count("extract", model, sent, results, meta)
    return results


def parse_tokenize(
    data: dict[str, Any], model: str, sent: list[Any], headers: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Per item: ``tokens`` (str), ``ids`` (int), ``offsets`` ([start, end] characters), ``count``."""
    items = data.get("items")
    if not isinstance(items, list):
        raise _malformed("tokenize", "'items' is missing")
    meta = request_metadata(headers)
    results: list[dict[str, Any]] = []
    for raw in items:
        if not isinstance(raw, dict) or not isinstance(raw.get("ids"), list):
            raise _malformed("tokenize", "an item lacks 'ids'")
        out: dict[str, Any] = {"model": data.get("model") or model}
        if raw.get("id") is not None:
            out["id"] = raw["id"]
        out["tokens"] = list(raw.get("tokens") or [])
        out["ids"] = [int(i) for i in raw["ids"]]
        out["offsets"] = [(int(a), int(b)) for a, b in raw.get("offsets") or []]
        out["count"] = int(raw.get("count", len(out["ids"])))
        if meta:
            out["request"] = dict(meta)
        results.append(out)
    _check_count("tokenize", model, sent, results, meta)
    return results


def parse_capacity(data: dict[str, Any], gpu: str | None) -> dict[str, Any]:
    if data.get("type") != "gateway":
        raise E.RequestError(
            "get_capacity() needs a gateway; this endpoint looks like a worker",
            code="not_gateway",
            status_code=400,
        )
    cluster_value = data.get("cluster")
    cluster: dict[str, Any] = cluster_value if isinstance(cluster_value, dict) else {}
    workers_raw = [w for w in data.get("workers") or [] if isinstance(w, dict)]
    if gpu:
        workers_raw = [w for w in workers_raw if str(w.get("gpu", "")).lower() == gpu.lower()]
    workers = []
    for w in workers_raw:
        healthy = bool(w.get("healthy", False))
        workers.append(
            {
                "name": w.get("name", ""),
                "url": w.get("url", ""),
                "gpu": w.get("gpu", ""),
                "gpu_count": w.get("gpu_count", 0),
                "ready_gpu_slots": w.get("ready_gpu_slots", w.get("gpu_count", 1 if healthy else 0)),
                "healthy": healthy,
                "queue_depth": w.get("queue_depth", 0),
                "pending_cost": w.get("pending_cost", 0),
                "inflight_batches": w.get("inflight_batches", 0),
                "loaded_models": w.get("loaded_models", []),
                "memory_used_bytes": w.get("memory_used_bytes", 0),
                "memory_total_bytes": w.get("memory_total_bytes", 0),
                "bundle": w.get("bundle", ""),
                "bundle_config_hash": w.get("bundle_config_hash", ""),
            }
        )
    return {
        "status": data.get("status", "unknown"),
        "worker_count": len(workers) if gpu else cluster.get("worker_count", 0),
        "gpu_count": cluster.get("gpu_count", 0),
        "models_loaded": cluster.get("models_loaded", 0),
        "configured_gpu_types": data.get("configured_gpu_types", []),
        "live_gpu_types": data.get("live_gpu_types", []),
        "workers": workers,
    }


def models_list(data: dict[str, Any]) -> list[dict[str, Any]]:
    models = data.get("models")
    if not isinstance(models, list):
        raise E.RequestError("Malformed models JSON response: 'models' is missing")
    return models


# ---------------------------------------------------------------- one attempt, judged


def judge(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    state: RetryState,
    now: float,
    *,
    operation: str,
    model: str,
    gpu: str | None,
    lora: str | None = None,
) -> dict[str, Any] | Decision:
    """Judge one HTTP answer to an inference call.

    Returns the decoded body on success, a retrying ``Decision`` otherwise, and raises the
    typed exception when the retry matrix ends the call.
    """
    if 200 <= status < 300 and status != 202:
        return decode_msgpack_map(body, what=operation, status=status, headers=headers)
    info = ErrorInfo(status, headers, body)
    decision = decide(info.answer(), state, now, operation=operation)
    if decision.retry:
        code = f" {info.code}" if info.code else ""
        announce(decision, state, now, what=f"{operation} {model} (HTTP {status}{code})")
        return decision
    raise build_error(decision.rule, info, model=model, gpu=gpu, state=state, lora=lora)


def announce(decision: Decision, state: RetryState, now: float, *, what: str) -> None:
    """Log one retry: at WARNING once the call has waited a few seconds (sdk._retry.retry_note)."""
    loud, line = retry_note(decision, state, now, what=what)
    log.log(logging.WARNING if loud else logging.DEBUG, line)


def judge_transport(
    kind: Transport, exc: BaseException, state: RetryState, now: float, *, operation: str, base_url: str
) -> Decision:
    """Judge a transport failure: a retrying ``Decision``, or ``SIEConnectionError`` raised."""
    decision = decide(Answer(transport=kind), state, now, operation=operation)
    reason = describe(exc)
    if decision.retry:
        announce(decision, state, now, what=f"{operation} at {base_url} ({reason})")
        return decision
    if decision.rule is Rule.UNREACHABLE:
        raise unreachable(operation, base_url, reason, state) from exc
    what = (
        "no answer (read timeout or TLS failure) from"
        if kind is Transport.FATAL
        else "lost the connection to"
    )
    raise E.SIEConnectionError(f"{operation}: {what} {base_url}: {reason}") from exc


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def unreachable(operation: str, base_url: str, reason: str, state: RetryState) -> E.SIEConnectionError:
    return E.SIEConnectionError(
        f"{operation}: cannot connect to {base_url} ({reason}); {state.unreached_retries + 1} "
        f"attempt(s) over {state.waited_s:.1f} s. Nothing answers at that URL: is the server (the "
        "gateway of `sie up`, or `sie serve`) running there, and is the URL right?"
    )


def json_bytes(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
