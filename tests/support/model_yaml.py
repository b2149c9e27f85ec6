"""Model config documents (YAML text) for the tests that add models to a catalog or a running
cluster: one builder, so each test names only what its model has of its own."""

from __future__ import annotations

from typing import Any

import yaml

FAKE_ADAPTER = "worker.adapters.fake:FakeAdapter"
TEXT = {"text": True}  # inputs: text only


def model_yaml(
    sie_id: str,
    adapter: str,
    tasks: dict[str, Any],
    *,
    max_batch_tokens: int = 16384,
    options: dict[str, Any] | None = None,
    profiles: dict[str, Any] | None = None,
    **fields: Any,
) -> str:
    """``sie_id`` with ``fields`` (weights_path, inputs, max_sequence_length…) and ``tasks``, served
    by a ``default`` profile of ``adapter`` (``options``: more of that profile's keys) and then by
    ``profiles``."""
    default = {"adapter_path": adapter, "max_batch_tokens": max_batch_tokens, **(options or {})}
    doc = {"sie_id": sie_id, **fields, "tasks": tasks, "profiles": {"default": default, **(profiles or {})}}
    return yaml.safe_dump(doc, sort_keys=False)


def extends_default(**adapter_options: Any) -> dict[str, Any]:
    """A profile that is ``default`` with these adapter options (``runtime=…``, ``loadtime=…``)."""
    return {"extends": "default", "adapter_options": adapter_options}


def fake_model(sie_id: str, dim: int = 8, max_batch_tokens: int = 4096, **more: Any) -> str:
    """A package-backed model of the fake adapter: dense vectors of ``dim`` (``more``: as model_yaml's)."""
    tasks = {"encode": {"dense": {"dim": dim}}}
    return model_yaml(
        sie_id, FAKE_ADAPTER, tasks, max_batch_tokens=max_batch_tokens, package_backed=True, **more
    )


def minilm_copy(sie_id: str, **source: str) -> str:
    """all-MiniLM-L6-v2 under another id, its weights from ``source`` (``weights_path=…`` or
    ``weights_fallback=…``): mean-pooled, normalized, in float32."""
    options = {
        "compute_precision": "float32",
        "adapter_options": {"runtime": {"pooling": "mean", "normalize": True}},
    }
    tasks = {"encode": {"dense": {"dim": 384}}}
    return model_yaml(
        sie_id,
        "worker.adapters.dense:DenseAdapter",
        tasks,
        options=options,
        **source,
        inputs=TEXT,
        max_sequence_length=256,
    )
