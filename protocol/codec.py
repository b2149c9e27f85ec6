"""msgpack codec with numpy arrays encoded as in the contract (section 4), plus the JSON fallback.

An array travels as a plain msgpack map whose keys are msgpack *bin* values:
``{b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [..], b"data": <bytes>}``.
The envelope around it uses ordinary str keys.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import msgpack
import numpy as np
import orjson

ALLOWED_DTYPES = frozenset(
    [f"{order}{kind}" for order in "<>" for kind in ("f2", "f4", "f8", "i2", "i4", "i8", "u2", "u4", "u8")]
    + ["|b1", "|i1", "|u1"]
)
MAX_NDIM = 8

_K_ND = b"nd"
_K_TYPE = b"type"
_K_KIND = b"kind"
_K_SHAPE = b"shape"
_K_DATA = b"data"


class CodecError(ValueError):
    """A body or array that does not follow the wire format."""


def _encode_numpy(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.str not in ALLOWED_DTYPES:
            if obj.dtype == np.float64 or obj.dtype.kind == "f":
                obj = obj.astype(np.float32)
            else:
                raise TypeError(f"dtype {obj.dtype} cannot be sent on the wire")
        if obj.ndim > MAX_NDIM:
            raise TypeError(f"array with {obj.ndim} dimensions cannot be sent on the wire")
        arr = np.ascontiguousarray(obj)
        return {
            _K_ND: True,
            _K_TYPE: arr.dtype.str,
            _K_KIND: b"",
            _K_SHAPE: list(arr.shape),
            _K_DATA: arr.tobytes(),
        }
    if isinstance(obj, np.generic):
        if isinstance(obj, np.bool_):
            return bool(obj)
        if obj.dtype.str not in ALLOWED_DTYPES:
            raise TypeError(f"dtype {obj.dtype} cannot be sent on the wire")
        return {_K_ND: False, _K_TYPE: obj.dtype.str, _K_KIND: b"", _K_DATA: obj.tobytes()}
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def _decode_numpy(obj: dict[Any, Any]) -> Any:
    if _K_ND not in obj:
        if b"complex" in obj:
            raise CodecError("complex values are not supported")
        return obj
    nd = obj[_K_ND]
    if not isinstance(nd, bool):
        raise CodecError("array marker 'nd' must be a boolean")
    dtype = obj.get(_K_TYPE)
    if not isinstance(dtype, str) or dtype not in ALLOWED_DTYPES:
        raise CodecError(f"unsupported array dtype {dtype!r}")
    kind = obj.get(_K_KIND, b"")
    if kind not in (b"", ""):
        raise CodecError("array 'kind' must be empty")
    data = obj.get(_K_DATA)
    if not isinstance(data, (bytes, bytearray)):
        raise CodecError("array 'data' must be binary")
    dt = np.dtype(dtype)
    if not nd:
        if len(data) != dt.itemsize:
            raise CodecError("scalar data has the wrong length")
        return np.frombuffer(data, dtype=dt)[0]
    shape = obj.get(_K_SHAPE)
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
    ):
        raise CodecError("array 'shape' must be a list of at most 8 non-negative ints")
    count = math.prod(shape)
    if len(data) != count * dt.itemsize:
        raise CodecError("array data length does not match its shape")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def packb(obj: Any) -> bytes:
    """Serialise ``obj`` (dicts, lists, scalars, bytes, numpy arrays) to msgpack."""
    data: bytes = msgpack.packb(obj, use_bin_type=True, default=_encode_numpy)
    return data


def unpackb(data: bytes, *, max_bin_len: int = -1) -> Any:
    """Decode msgpack, turning bin-keyed ``nd`` maps back into numpy arrays.

    Raises CodecError for anything that is not well-formed msgpack of the contract's shape.
    """
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            object_hook=_decode_numpy,
            strict_map_key=False,
            max_bin_len=max_bin_len,
        )
    except CodecError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CodecError(f"invalid MessagePack body: {exc}") from exc


def unpackb_plain(data: bytes) -> Any:
    """Decode msgpack that holds no numpy maps (the cluster's own envelopes: jobs, results, bodies
    of encoded parts), without :func:`unpackb`'s call per map; CodecError as :func:`unpackb`."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CodecError(f"invalid MessagePack body: {exc}") from exc


MAX_DEPTH = 64  # deepest nesting of lists and maps a request body may have
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack can carry


def check_plain(value: Any, max_depth: int = MAX_DEPTH, *, check_text: bool = True) -> None:
    """Refuse decoded data that no later step could carry: nesting deeper than ``max_depth``,
    integers beyond 64 bits and, with ``check_text``, text that is not valid Unicode (a lone UTF-16
    surrogate from a JSON or YAML escape). Raises CodecError; iterative, so any depth is safe."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if type(node) is dict:
            children: Any = (*node.keys(), *node.values())
        elif type(node) is list:
            children = node
        else:
            children = (node,)
            depth -= 1
        if depth >= max_depth:
            raise CodecError(f"nested deeper than {max_depth} levels")
        for child in children:
            kind = type(child)
            if kind is str:
                if check_text and not child.isascii():
                    try:
                        child.encode("utf-8")
                    except UnicodeEncodeError:
                        raise CodecError("text is not valid Unicode (a lone UTF-16 surrogate)") from None
            elif kind is int:
                if not _INT_MIN <= child <= _INT_MAX:
                    raise CodecError("integer out of the 64-bit range")
            elif kind is dict or kind is list:
                stack.append((child, depth + 1))


def to_jsonable(obj: Any) -> Any:
    """Turn a response structure into JSON-encodable values (arrays become nested lists)."""
    if isinstance(obj, dict):
        return {(k.decode() if isinstance(k, bytes) else k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (bytes, bytearray)):
        return base64.b64encode(obj).decode("ascii")
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _json_default(obj: Any) -> Any:
    """What orjson does not serialise natively (bytes; arrays it falls through on: strided, object)."""
    if isinstance(obj, (np.ndarray, np.generic, bytes, bytearray)):
        return to_jsonable(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def dumps_json(obj: Any) -> bytes:
    """A response structure as compact JSON: numpy arrays serialised natively (orjson, no per-float
    Python objects, the GIL released for none of it but held far shorter); non-finite floats → null."""
    try:
        return orjson.dumps(obj, default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # keys orjson refuses (bytes): the general conversion
        return orjson.dumps(to_jsonable(obj), default=_json_default, option=orjson.OPT_SERIALIZE_NUMPY)


MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")


def wants_msgpack_body(content_type: str | None) -> bool:
    """Request bodies are msgpack when Content-Type names msgpack, else JSON."""
    ct = (content_type or "").lower()
    return any(t in ct for t in MSGPACK_TYPES)


def wants_msgpack_response(accept: str | None) -> bool:
    """Responses are msgpack unless Accept asks for JSON without mentioning msgpack."""
    if not accept:
        return True
    acc = accept.lower()
    if any(t in acc for t in MSGPACK_TYPES):
        return True
    return "application/json" not in acc
