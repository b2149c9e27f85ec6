"""The adapter interface: how the runtime talks to one model family.

An adapter turns inputs into ``Prepared`` units (tokenisation; CPU pool, many threads), runs a
batch of them (on one of the model's forward threads) and returns raw float32 outputs per unit. The
runtime owns batching, quantisation and the wire format, so an adapter never sees HTTP or NATS.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.errors import ErrorCode, SIEError
from protocol.model_config import ModelConfig

# per-request option keys that change only postprocessing or routing, never the forward pass
POSTPROCESS_OPTION_KEYS = frozenset(
    {
        "profile",
        "output_dtype",
        "overflow_policy",
        "is_query",
        "instruction",
        "output_types",
        "lora",
        "lora_id",
        "output_dim",
        "chunk_size",
        "chunk_overlap",
        "chunk_pooling",
        "chunking",
    }
)


@dataclass
class LoadSpec:
    """Everything an adapter needs to load: where the weights are and how to run them."""

    config: ModelConfig
    profile_name: str
    weights_dir: str | None
    device: str
    precision: str  # float32 | bfloat16 | float16
    loadtime: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestContext:
    """Per-request parameters that decide how inputs are prepared and which forward pass runs.

    Items whose contexts are equal may share a forward pass (``batch_key``).
    """

    op: str  # encode | score | extract
    output_types: tuple[str, ...] = ("dense",)
    is_query: bool = False
    instruction: str | None = None
    lora: str | None = None
    options_json: str = "{}"  # adapter-relevant runtime options, canonical JSON
    labels: tuple[str, ...] = ()
    max_length: int | None = None
    truncate: bool = True

    @functools.cached_property
    def options(self) -> Mapping[str, Any]:
        """``options_json`` parsed once per context (read for every item of a batch: templates, the
        query flag's options), read-only because every item of the context shares it."""
        return types.MappingProxyType(json.loads(self.options_json))

    @staticmethod
    def canonical_options(options: dict[str, Any]) -> str:
        relevant = {k: v for k, v in options.items() if k not in POSTPROCESS_OPTION_KEYS}
        return json.dumps(relevant, sort_keys=True, separators=(",", ":"), default=str)

    def batch_key(self) -> tuple[Any, ...]:
        return (
            self.op,
            self.output_types,
            self.is_query,
            self.instruction,
            self.lora,
            self.options_json,
            self.labels,
        )


@dataclass
class Prepared:
    """One unit of forward work: ``cost`` is its token count (what padding is measured in).

    ``input_tokens`` counts the tokens the forward pass sees; ``full_tokens`` the input's tokens
    before truncation, when truncation cut some off (0 when it did not).
    """

    cost: int
    data: Any
    input_tokens: int = 0
    full_tokens: int = 0

    @property
    def truncated(self) -> bool:
        return self.full_tokens > self.input_tokens


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error (CUDA or host), which the runtime recovers from."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


class InputTooLong(SIEError):
    def __init__(self, index: int, length: int, limit: int) -> None:
        super().__init__(
            ErrorCode.INPUT_TOO_LONG,
            f"Item {index} has {length} tokens, more than the model's limit of {limit}",
            param=f"items.{index}",
        )


class Adapter:
    """Base class. Subclasses set ``operations`` and implement the methods they support."""

    operations: ClassVar[frozenset[str]] = frozenset()
    #: whether the unit cost is a token count, so padding is meaningful for the batcher
    token_costed: ClassVar[bool] = True
    #: whether a float32 profile may run in bfloat16 on a CPU with native bf16 (SIE_CPU_PRECISION,
    #: worker/models/precision.py): set only where the outputs pass the gate, cosine >= 0.99
    #: against fp32 (tests/integration/lifecycle/test_cpu_precision.py)
    cpu_bf16_safe: ClassVar[bool] = False

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.max_length = spec.config.max_sequence_length or 512

    # ---- lifecycle (load thread) -----------------------------------------------------------
    def load(self) -> None:
        raise NotImplementedError

    def unload(self) -> None:
        """Drop references to weights; the runtime clears device caches afterwards."""

    def memory_bytes(self) -> int:
        return 0

    # ---- work (prepare: CPU pool; forward: one of the model's forward threads) ------------
    def prepare(self, ctx: RequestContext, inputs: list[Any]) -> list[Prepared]:
        """Tokenise. ``inputs`` are items (:class:`protocol.api.Item`; encode, extract) or (query, item)
        pairs of them (score): what the client sent, parsed once at the front door."""
        raise NotImplementedError

    def forward(self, ctx: RequestContext, batch: list[Prepared]) -> list[Any]:
        """Run one batch; return one raw output per unit, in order."""
        raise NotImplementedError

    # ---- LoRA (adapters that support it override) ------------------------------------------
    # The runtime (worker/models/lora.py) keeps an LRU of loaded LoRAs per model and calls these two on
    # a forward thread while no forward runs, so they never race a forward pass. Batches are
    # homogeneous in LoRA: ``forward`` activates ``ctx.lora`` (or none: the base model) before it
    # computes.
    supports_lora: ClassVar[bool] = False

    def load_lora(self, name: str, path: str) -> None:
        """Load the LoRA adapter saved in directory ``path`` under ``name``."""
        raise SIEError(ErrorCode.INVALID_INPUT, "this model does not support LoRA adapters")

    def unload_lora(self, name: str) -> None:
        """Drop a loaded LoRA adapter (the runtime evicted it from its LRU)."""

    def runs_packed(self, ctx: RequestContext) -> bool:
        """Whether ``forward`` runs ``ctx``'s batches packed (no padding, worker/modeling/packed.py): the
        batchers then cut them by total tokens instead of into length bands."""
        return False

    def forwards_share_state(self) -> bool:
        """Whether a forward changes state that a forward on another forward thread would see (it activates
        a LoRA): such forwards run one at a time (worker/batching/forward_threads.py)."""
        return False


def apply_template(text: str, ctx: RequestContext) -> str:
    """Query/document templates and instructions (``{text}``, ``{instruction}`` placeholders)."""
    template = ctx.options.get("query_template" if ctx.is_query else "doc_template")
    instruction = ctx.instruction or (ctx.options.get("default_instruction") if ctx.is_query else None) or ""
    if template:
        return str(template).replace("{instruction}", instruction).replace("{text}", text)
    if instruction:
        return f"{instruction} {text}"
    return text
