"""The load-time options each of our adapters reads, declared once.

The config service checks a written profile against this table (422 ``validation_error`` naming
the option), the worker checks it again before loading (so ``sie serve``'s YAML files get the same
answer), and a test checks every catalog file. It lives in ``protocol`` because the config service
must not import the adapters (they import torch).

Only adapters under ``worker.adapters.`` are known here: a bundle may ship its own adapter module,
whose options nobody but that adapter can judge, so those are passed through unchecked.
"""

from __future__ import annotations

from typing import Any

OURS = "worker.adapters."

# What an option's value must be: a JSON type name.
_Kind = str  # "bool" | "int" | "number" | "string" | "map" | "any"

_PACKED: dict[str, _Kind] = {"packed": "bool"}  # every transformers-body adapter (worker.modeling.packed)
_MULTIVECTOR: dict[str, _Kind] = {"muvera_config": "map"}  # adapters with multivector output

LOADTIME: dict[str, dict[str, _Kind]] = {
    "worker.adapters.dense:DenseAdapter": {**_PACKED, "projection": "string"},
    "worker.adapters.sparse:SpladeAdapter": _PACKED,
    "worker.adapters.cross_encoder:CrossEncoderAdapter": {**_PACKED, "activation": "string"},
    "worker.adapters.colbert:ColBERTAdapter": {
        **_PACKED,
        **_MULTIVECTOR,
        "query_token_id": "string",
        "doc_token_id": "string",
        "query_maxlen": "int",
        "doc_maxlen": "int",
        "attend_to_mask_tokens": "bool",
        "query_expansion": "bool",
        "mask_punctuation": "bool",
    },
    "worker.adapters.bge_m3:BGEM3Adapter": {**_PACKED, **_MULTIVECTOR},
    "worker.adapters.classifier:SequenceClassifierAdapter": _PACKED,
    "worker.adapters.zero_shot:ZeroShotAdapter": _PACKED,
    "worker.adapters.llm_reranker:LLMRerankerAdapter": {
        **_PACKED,
        "prefix": "string",
        "suffix": "string",
        "body_template": "string",
        "default_instruction": "string",
        "yes_token": "string",
        "no_token": "string",
    },
    "worker.adapters.clip:CLIPAdapter": {
        **_PACKED,
        "max_image_bytes": "int",
        "max_image_pixels": "int",
        "text_padding": "string",
        "text_attention_mask": "bool",
    },
    "worker.adapters.colpali:ColPaliAdapter": {
        **_MULTIVECTOR,
        "max_image_bytes": "int",
        "max_image_pixels": "int",
    },
    "worker.adapters.gliner_ner:GLiNERAdapter": {},
    "worker.adapters.fake:FakeAdapter": {
        **_MULTIVECTOR,
        "load_delay_s": "number",
        "fail_load": "string",
        "oom_on_batch": "int",
        "oom_repeat": "int",
        "batch_delay_ms": "number",
        "memory_bytes": "int",
    },
}


def _fits(kind: _Kind, value: Any) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "map":
        return isinstance(value, dict)
    return True


def loadtime_problems(adapter_path: str | None, options: dict[str, Any]) -> list[tuple[str | None, str]]:
    """What is wrong with ``options`` for ``adapter_path``: (option or None, message) pairs, empty
    when it is fine or the adapter is not one of ours."""
    if not adapter_path or not adapter_path.startswith(OURS):
        return []
    known = LOADTIME.get(adapter_path)
    if known is None:
        names = ", ".join(sorted(LOADTIME))
        return [(None, f"unknown adapter {adapter_path!r}; the adapters shipped here are: {names}")]
    problems: list[tuple[str | None, str]] = []
    for key in sorted(options):
        kind = known.get(key)
        if kind is None:
            allowed = ", ".join(sorted(known)) or "none"
            problems.append((key, f"{adapter_path} has no load-time option {key!r} (it reads: {allowed})"))
        elif not _fits(kind, options[key]):
            problems.append((key, f"load-time option {key!r} of {adapter_path} must be a {kind}"))
    return problems
