"""What an answer means: the error an error answer ends in, the results a success body holds, and
the judgement of each attempt of an inference call against the retry matrix (:mod:`sdk._retry`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from protocol.codec import CodecError, unpackb
from sdk import errors as E
from sdk._retry import Answer, Decision, RetryState, Rule, Transport, classify, decide, retry_note
from sdk._wire import MSGPACK, parse_retry_after, request_metadata
from sdk.types import (
    Capacity,
    EncodeResult,
    ExtractResult,
    ModelInfo,
    RequestMeta,
    ScoreEntry,
    ScoreResult,
    TokenizeResult,
    Truncation,
    Usage,
    WorkerInfo,
)

if TYPE_CHECKING:
    from sdk._core import Response

log = logging.getLogger("sdk")

# ---------------------------------------------------------------- error envelopes


class ErrorInfo:
    """The readable parts of an error answer."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self.body_code: str | None = None
        self.message = f"HTTP {status}"
        self.param: str | None = None
        self.extra: dict[str, object] = {}
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


def _check_count(
    what: str, model: str, sent: list[Any], results: Sequence[Mapping[str, Any]], meta: RequestMeta | None
) -> None:
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


R = TypeVar("R", EncodeResult, ExtractResult, TokenizeResult)


def _per_item(
    what: str,
    model: str,
    data: Mapping[str, Any],
    sent: list[Any],
    meta: RequestMeta | None,
    read: Callable[[dict[str, Any], str], R],
) -> list[R]:
    """One result per item of the answer, each read by ``read(item, model)``, with the request's
    metadata; ``IncompleteBatchError`` unless there is one per item sent."""
    items = data.get("items")
    if not isinstance(items, list):
        raise _malformed(what, "'items' is missing")
    answered = data.get("model") or model
    results = []
    for raw in items:
        if not isinstance(raw, dict):
            raise _malformed(what, "an item is not a map")
        out = read(raw, answered)
        if raw.get("id") is not None:
            out["id"] = raw["id"]
        if meta:
            out["request"] = meta.copy()
        results.append(out)
    _check_count(what, model, sent, results, meta)
    return results


def parse_encode(
    data: dict[str, Any], model: str, sent: list[Any], headers: Mapping[str, str]
) -> list[EncodeResult]:
    timing = data.get("timing")
    meta = _with_truncation_totals(request_metadata(headers), data)

    def read(raw: dict[str, Any], answered: str) -> EncodeResult:
        out: EncodeResult = {"model": answered}
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
        _add_truncation(out, raw)
        if isinstance(raw.get("chunks"), list):  # overflow_policy chunk: spans and a vector per chunk
            out["chunks"] = [
                {
                    "start": int(c["start"]),
                    "end": int(c["end"]),
                    "dense": _array((c.get("dense") or {}).get("values"), "encode", "chunks.dense.values"),
                }
                for c in raw["chunks"]
            ]
        if isinstance(timing, dict) and timing:
            out["timing"] = dict(timing)
        return out

    return _per_item("encode", model, data, sent, meta, read)


def _with_truncation_totals(meta: RequestMeta | None, data: Mapping[str, Any]) -> RequestMeta | None:
    """The answer's truncation totals (``usage.truncated_items``, ``dropped_tokens``) into the request
    metadata every result carries, when the server reported any truncation."""
    body_usage = data.get("usage")
    if not isinstance(body_usage, dict) or not body_usage.get("truncated_items"):
        return meta
    meta = meta.copy() if meta else RequestMeta()
    usage: Usage = {**meta.get("usage", {})}
    usage["truncated_items"] = int(body_usage["truncated_items"])
    usage["dropped_tokens"] = int(body_usage.get("dropped_tokens") or 0)
    meta["usage"] = usage
    return meta


def _add_truncation(out: Truncation, raw: Mapping[str, Any]) -> None:
    """Truncation reported per item (encode/extract items, score entries): tokens before and after."""
    if raw.get("truncated"):
        out["truncated"] = True
        out["input_tokens"] = raw.get("input_tokens")
        out["used_tokens"] = raw.get("used_tokens")


def parse_score(data: dict[str, Any], model: str, headers: Mapping[str, str]) -> ScoreResult:
    scores = data.get("scores")
    if not isinstance(scores, list):
        raise _malformed("score", "'scores' is missing")
    entries: list[ScoreEntry] = []
    for s in scores:
        if not isinstance(s, dict) or "item_id" not in s or "score" not in s:
            raise _malformed("score", "a score entry lacks item_id or score")
        entry: ScoreEntry = {
            "item_id": s["item_id"],
            "score": float(s["score"]),
            "rank": int(s.get("rank", len(entries))),
        }
        _add_truncation(entry, s)
        if "span" in s:
            entry["span"] = s["span"]
        if "chunks" in s:
            entry["chunks"] = s["chunks"]
        entries.append(entry)
    result: ScoreResult = {"model": data.get("model") or model, "scores": entries}
    if data.get("query_id") is not None:
        result["query_id"] = data["query_id"]
    if isinstance(data.get("usage"), dict):
        result["usage"] = data["usage"]
    meta = request_metadata(headers)
    if meta:
        result["request"] = meta
    return result


def _entries(raw: Mapping[str, Any], key: str, required: tuple[str, ...]) -> list[Any]:
    value = raw.get(key) or []
    if not isinstance(value, list):
        raise _malformed("extract", f"'{key}' is not a list")
    for entry in value:
        if not isinstance(entry, dict) or any(k not in entry for k in required):
            raise _malformed("extract", f"an entry of '{key}' lacks one of {required}")
    return [dict(e) for e in value]


def _extracted(raw: dict[str, Any], answered: str) -> ExtractResult:
    out: ExtractResult = {
        "model": answered,
        "entities": _entries(raw, "entities", ("text", "label", "score")),
        "relations": _entries(raw, "relations", ("head", "tail", "relation", "score")),
        "classifications": _entries(raw, "classifications", ("label", "score")),
        "objects": _entries(raw, "objects", ("label", "score", "bbox")),
    }
    if raw.get("data"):
        out["data"] = raw["data"]
    _add_truncation(out, raw)
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
    return out


def parse_extract(
    data: dict[str, Any], model: str, sent: list[Any], headers: Mapping[str, str]
) -> list[ExtractResult]:
    meta = _with_truncation_totals(request_metadata(headers), data)
    return _per_item("extract", model, data, sent, meta, _extracted)


def _tokenized(raw: dict[str, Any], answered: str) -> TokenizeResult:
    if not isinstance(raw.get("ids"), list):
        raise _malformed("tokenize", "an item lacks 'ids'")
    ids = [int(i) for i in raw["ids"]]
    return {
        "model": answered,
        "tokens": list(raw.get("tokens") or []),
        "ids": ids,
        "offsets": [(int(a), int(b)) for a, b in raw.get("offsets") or []],
        "count": int(raw.get("count", len(ids))),
    }


def parse_tokenize(
    data: dict[str, Any], model: str, sent: list[Any], headers: Mapping[str, str]
) -> list[TokenizeResult]:
    """Per item: ``tokens`` (str), ``ids`` (int), ``offsets`` ([start, end] characters), ``count``."""
    return _per_item("tokenize", model, data, sent, request_metadata(headers), _tokenized)


def parse_capacity(data: Mapping[str, Any], gpu: str | None) -> Capacity:
    if data.get("type") != "gateway":
        raise E.RequestError(
            "get_capacity() needs a gateway; this endpoint looks like a worker",
            code="not_gateway",
            status_code=400,
        )
    cluster_value = data.get("cluster")
    cluster: Mapping[str, Any] = cluster_value if isinstance(cluster_value, dict) else {}
    workers_raw: list[Mapping[str, Any]] = [w for w in data.get("workers") or [] if isinstance(w, dict)]
    if gpu:
        workers_raw = [w for w in workers_raw if str(w.get("gpu", "")).lower() == gpu.lower()]
    workers: list[WorkerInfo] = []
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


def models_list(data: Mapping[str, Any]) -> list[ModelInfo]:
    models = data.get("models")
    if not isinstance(models, list):
        raise E.RequestError("Malformed models JSON response: 'models' is missing")
    return models


# ---------------------------------------------------------------- one attempt, judged


def judge(
    response: Response,
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
    status = response.status
    if 200 <= status < 300 and status != 202:
        return decode_msgpack_map(response.body, what=operation, status=status, headers=response.headers)
    info = ErrorInfo(status, response.headers, response.body)
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
