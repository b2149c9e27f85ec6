"""Tests write items and params as the maps a client sends; the runtime and the adapters take them
typed (:mod:`protocol.api`). These turn the one into the other, as a front door's parse does."""

from __future__ import annotations

from typing import Any

from protocol.api import EncodeParams, ExtractParams, Item, ScoreParams, TokenizeParams


def item(value: Any) -> Item:
    return value if isinstance(value, Item) else Item.model_validate(value)


def items(values: Any) -> list[Item]:
    return [item(v) for v in values]


def inputs(values: Any) -> list[Any]:
    """An adapter's ``prepare`` inputs: items, or (query, item) pairs."""
    return [(item(v[0]), item(v[1])) if isinstance(v, tuple) else item(v) for v in values]


def encode_params(params: dict[str, Any] | None) -> EncodeParams | None:
    return None if params is None else EncodeParams.model_validate(params)


def extract_params(params: dict[str, Any] | None) -> ExtractParams | None:
    return None if params is None else ExtractParams.model_validate(params)


def score_params(instruction: Any = None, options: dict[str, Any] | None = None) -> ScoreParams:
    return ScoreParams(instruction=instruction, options=options)


def runtime_args(method: str, *args: Any, **score: Any) -> tuple[Any, ...]:
    """A runtime call written the way a request reads: ``("encode", spec, [maps], {params})``,
    ``("score", spec, query map, [maps], instruction, options)`` (or ``instruction=``,
    ``options=``), ``("extract", spec, [maps], {params})``, ``("tokenize", spec, [maps], options)``;
    the arguments the runtime takes."""
    if method == "encode":
        spec, values, *rest = args
        return (spec, items(values), encode_params(rest[0] if rest else None))
    if method == "score":
        spec, query, values, *rest = args
        return (spec, item(query), items(values), score_params(*rest, **score))
    if method == "extract":
        spec, values, *rest = args
        return (spec, items(values), extract_params(rest[0] if rest else None))
    if method == "tokenize":
        spec, values, *rest = args
        return (spec, items(values), TokenizeParams(options=rest[0] if rest else None))
    raise ValueError(method)
