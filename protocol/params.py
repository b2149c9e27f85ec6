"""Validation of request parameters, shared by the front doors: the gateway and ``sie serve``.

Each operation's parameters are checked and resolved against the model's profile by one function
(:func:`encode_options`, :func:`score_options`, :func:`extract_options`, :func:`tokenize_options`)
into a typed, frozen result, once, where a request comes in: the gateway puts it in the request's
job (protocol.jobs), which the worker runs as it is; ``sie serve`` checks its own requests. A
request gets the same 400 INVALID_INPUT from either, and the worker plans its forward pass from
the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.api import OVERFLOW_POLICIES, EncodeParams, ExtractParams, Item, ScoreParams, TokenizeParams
from protocol.catalog import Resolved, model_dims, supported_outputs
from protocol.errors import SIEError, invalid_input
from protocol.model_config import LORA_NAME_MAX, OUTPUT_TYPES, ModelConfig

MEDIA = ("images", "audio", "video", "document")
OUTPUT_DTYPES = ("float32", "float16", "int8", "uint8", "binary", "ubinary")
# how an encoder's token states become one vector (worker.adapters.dense.pool)
POOLING_MODES = ("mean", "cls", "max", "last")


def request_options(value: Any) -> dict[str, Any]:
    """A request's ``options`` as a fresh dict (``None`` → ``{}``); anything but a map is refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_input("options must be a map", param="options")
    return dict(value)


def merged_options(resolved: Resolved, request: Any) -> dict[str, Any]:
    """Profile runtime options overlaid with the request's options (request wins; ``profile`` dropped)."""
    options = {**resolved.runtime_options, **request_options(request)}
    options.pop("profile", None)
    return options


def instruction(explicit: Any, options: dict[str, Any]) -> str | None:
    """``params.instruction`` → ``options.instruction`` → none; must be a string."""
    value = explicit if explicit is not None else options.get("instruction")
    if value is not None and not isinstance(value, str):
        raise invalid_input("instruction must be a string", param="instruction")
    return value or None


def max_length(options: dict[str, Any], is_query: bool) -> int | None:
    """Token limit of one input: ``query_max_length`` for queries, else ``max_seq_length``; positive ints only."""
    value = options.get("query_max_length") if is_query else None
    value = value or options.get("max_seq_length")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise invalid_input("max_seq_length must be a positive integer", param="max_seq_length")
    return value


def pooling(options: dict[str, Any]) -> str | None:
    """``options.pooling`` (profile or request): one of POOLING_MODES, or unset (the model's own)."""
    value = options.get("pooling")
    if value is not None and value not in POOLING_MODES:
        raise invalid_input(f"pooling must be one of {list(POOLING_MODES)}, got {value!r}", param="pooling")
    return value


def truncates(options: dict[str, Any]) -> bool:
    """Whether over-long inputs are truncated (``overflow_policy`` default/truncate_text/chunk: a chunk
    that still runs over is cut) or refused (error)."""
    policy = options.get("overflow_policy", "default")
    if policy not in OVERFLOW_POLICIES:
        raise invalid_input(
            f"overflow_policy must be one of {list(OVERFLOW_POLICIES)}, got {policy!r}",
            param="overflow_policy",
        )
    return bool(policy != "error")


def output_types(resolved: Resolved, options: dict[str, Any], requested: Any) -> list[str]:
    """Encode outputs: options/profile ``output_types`` → ``params.output_types`` → ``["dense"]``, checked
    against the outputs the profile can produce."""
    if resolved.config.tasks.encode is None:
        raise invalid_input(f"Model '{resolved.routable_id}' does not support encoding")
    value = options.get("output_types") or requested or ["dense"]
    if not isinstance(value, list) or not value or any(t not in OUTPUT_TYPES for t in value):
        raise invalid_input(
            f"output_types must be a non-empty list of {list(OUTPUT_TYPES)}", param="output_types"
        )
    supported = supported_outputs(resolved)
    unsupported = [t for t in value if t not in supported]
    if unsupported:
        raise invalid_input(
            f"Model '{resolved.routable_id}' does not support output types: {unsupported} (supported: {supported})",
            param="output_types",
        )
    return list(dict.fromkeys(value))


def output_dtype(explicit: Any, options: dict[str, Any]) -> str:
    """``params.output_dtype`` → ``options.output_dtype`` → ``float32``; must be a known dtype."""
    value = explicit or options.get("output_dtype") or "float32"
    if value not in OUTPUT_DTYPES:
        raise invalid_input(
            f"output_dtype must be one of {list(OUTPUT_DTYPES)}, got {value!r}", param="output_dtype"
        )
    return value


def add_special_tokens(options: dict[str, Any]) -> bool:
    """The tokenize route's ``add_special_tokens`` option (default true); must be a boolean."""
    value = options.get("add_special_tokens", True)
    if not isinstance(value, bool):
        raise invalid_input("add_special_tokens must be true or false", param="add_special_tokens")
    return value


CHUNK_POOLINGS = ("mean", "max")
CHUNKINGS = ("separate", "late")


@dataclass(frozen=True)
class ChunkSpec:
    """``overflow_policy: chunk``: token windows of ``size`` (None: as many as the model takes)
    overlapping by ``overlap`` tokens; the item's vector pools the chunks' (``pooling``);
    ``chunking: late`` pools each chunk's span out of one forward pass over the whole text."""

    size: int | None = None
    overlap: int = 32
    pooling: str = "mean"
    late: bool = False


def _positive(options: dict[str, Any], key: str, minimum: int) -> int | None:
    value = options.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise invalid_input(f"{key} must be an integer of at least {minimum}", param=key)
    return value


def chunking(options: dict[str, Any], operation: str) -> ChunkSpec | None:
    """The chunking a request asks for (``overflow_policy: chunk``), checked; None when it does not.
    Encode and score chunk; other operations refuse it."""
    if options.get("overflow_policy") != "chunk":
        return None
    if operation not in ("encode", "score"):
        raise invalid_input(
            f"overflow_policy 'chunk' is for encode and score, not {operation}", param="overflow_policy"
        )
    size = _positive(options, "chunk_size", 8)
    overlap = _positive(options, "chunk_overlap", 0)
    overlap = 32 if overlap is None else overlap
    if size is not None and overlap >= size:
        raise invalid_input("chunk_overlap must be smaller than chunk_size", param="chunk_overlap")
    pooling = options.get("chunk_pooling", "mean")
    if pooling not in CHUNK_POOLINGS:
        raise invalid_input(f"chunk_pooling must be one of {list(CHUNK_POOLINGS)}", param="chunk_pooling")
    mode = options.get("chunking", "separate")
    if mode not in CHUNKINGS:
        raise invalid_input(f"chunking must be one of {list(CHUNKINGS)}", param="chunking")
    if mode == "late" and operation != "encode":
        raise invalid_input("chunking 'late' is for encode", param="chunking")
    return ChunkSpec(size, overlap, pooling, mode == "late")


MUVERA_DEFAULTS: dict[str, Any] = {
    "num_repetitions": 20,
    "num_simhash_projections": 5,
    "projection_dim": 16,  # None or 0: no inner projection (keep the token dim)
    "final_projection_dim": None,
    "fill_empty_partitions": True,
    "seed": 42,
}


@dataclass(frozen=True)
class MuveraConfig:
    """MUVERA's fixed-dimensional encoding (worker/runtime/muvera.py): the profile's load-time
    ``muvera_config`` overlaid with the request's ``options.muvera``."""

    num_repetitions: int = 20
    num_simhash_projections: int = 5
    projection_dim: int | None = 16
    final_projection_dim: int | None = None
    fill_empty_partitions: bool = True
    seed: int = 42

    @classmethod
    def from_options(cls, *maps: Any) -> MuveraConfig:
        """Merge maps left to right (later wins); ``None``/``True``/``{}`` add nothing."""
        merged = dict(MUVERA_DEFAULTS)
        for m in maps:
            if m is None or m is True or m == {}:
                continue
            if not isinstance(m, dict):
                raise invalid_input("muvera options must be a map", param="options.muvera")
            unknown = set(m) - set(MUVERA_DEFAULTS)
            if unknown:
                raise invalid_input(f"unknown muvera options: {sorted(unknown)}", param="options.muvera")
            merged.update(m)

        def pos_int(name: str, upper: int | None = None) -> int:
            v = merged[name]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or (upper is not None and v > upper):
                raise invalid_input(
                    f"muvera.{name} must be a positive integer" + (f" ≤ {upper}" if upper else ""),
                    param=f"options.muvera.{name}",
                )
            return v

        def optional(name: str) -> int | None:
            return pos_int(name) if merged[name] else None

        seed = merged["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise invalid_input("muvera.seed must be a non-negative integer", param="options.muvera.seed")
        return cls(
            num_repetitions=pos_int("num_repetitions", upper=1024),
            num_simhash_projections=pos_int("num_simhash_projections", upper=16),
            projection_dim=optional("projection_dim"),
            final_projection_dim=optional("final_projection_dim"),
            fill_empty_partitions=bool(merged["fill_empty_partitions"]),
            seed=seed,
        )

    @property
    def num_buckets(self) -> int:
        return 1 << self.num_simhash_projections

    def block_dim(self, token_dim: int) -> int:
        return self.projection_dim or token_dim

    def output_dim(self, token_dim: int) -> int:
        return self.final_projection_dim or self.num_repetitions * self.num_buckets * self.block_dim(
            token_dim
        )


def lora_refusal(config: ModelConfig, value: Any) -> SIEError | None:
    """Why ``value`` selects no LoRA of ``config`` (400 INVALID_INPUT, param ``lora``), or None when it
    names one the model declares. The message names the declared adapters and never repeats the
    value: whatever a client sends (a path, a hub id, a long string) is only ever compared to names."""
    if isinstance(value, str) and len(value) <= LORA_NAME_MAX and config.lora(value) is not None:
        return None
    names = config.lora_names()
    if not names:
        return invalid_input(f"Model '{config.sie_id}' declares no LoRA adapters", param="lora")
    if not isinstance(value, str):
        why = "must be a string naming one of the model's LoRA adapters"
    elif len(value) > LORA_NAME_MAX:
        why = f"is longer than {LORA_NAME_MAX} characters"
    else:
        why = "names no LoRA adapter the model declares"
    shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    return invalid_input(f"lora {why}; model '{config.sie_id}' declares: {shown}", param="lora")


def lora(resolved: Resolved, options: dict[str, Any]) -> str | None:
    """The LoRA a request runs with: ``options.lora`` or ``options.lora_id``, a NAME among the
    adapters the model's config declares (``loras:``); anything else is a 400 INVALID_INPUT, before
    any file or the hub is looked at."""
    value = options.get("lora") or options.get("lora_id")
    if not value:  # unset, null or empty: the base model
        return None
    error = lora_refusal(resolved.config, value)
    if error is not None:
        raise error
    return str(value)


def output_dim(value: Any, native: int | None) -> int:
    """Matryoshka truncation: 1 ≤ output_dim ≤ the model's dense dimension."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise invalid_input("output_dim must be a positive integer", param="output_dim")
    if native is None:
        raise invalid_input("output_dim needs a model with dense output", param="output_dim")
    if value > native:
        raise invalid_input(
            f"output_dim={value} is larger than the model's dimension {native}", param="output_dim"
        )
    return value


@dataclass(frozen=True)
class EncodeOptions:
    """An encode request's parameters, checked, with the profile's runtime options applied."""

    options: dict[str, Any]  # the effective options: profile runtime options, then the request's
    output_types: tuple[str, ...]  # what the client gets
    output_dtype: str
    instruction: str | None
    is_query: bool
    lora: str | None
    max_length: int | None
    truncate: bool
    normalize: bool
    output_dim: int | None  # Matryoshka truncation of ``dense``
    muvera: MuveraConfig | None  # ``dense`` is the FDE of the multivector
    chunk: ChunkSpec | None


def encode_options(resolved: Resolved, params: EncodeParams | None) -> EncodeOptions:
    params = params or EncodeParams()
    options = merged_options(resolved, params.options)
    requested = tuple(output_types(resolved, options, params.output_types))
    pooling(options)
    dtype = output_dtype(params.output_dtype, options)
    is_query = bool(options.get("is_query", False))
    muvera = None
    if "muvera" in options and "dense" in requested:
        # a bad MUVERA option is a 400 before any forward pass, not an error after it
        muvera = MuveraConfig.from_options(resolved.loadtime_options.get("muvera_config"), options["muvera"])
    explicit = instruction(params.instruction, options)
    limit = max_length(options, is_query)
    truncate = truncates(options)
    dim = None
    if options.get("output_dim") is not None:
        dim = output_dim(options["output_dim"], model_dims(resolved.config).get("dense"))
    chunk = chunking(options, "encode")
    if chunk is not None and (requested != ("dense",) or "muvera" in options):
        raise invalid_input(
            "overflow_policy 'chunk' gives dense vectors only (output_types ['dense'], no MUVERA)",
            param="overflow_policy",
        )
    return EncodeOptions(
        options=options,
        output_types=requested,
        output_dtype=dtype,
        instruction=explicit,
        is_query=is_query,
        lora=lora(resolved, options),
        max_length=limit,
        truncate=truncate,
        normalize=bool(options.get("normalize", True)),
        output_dim=dim,
        muvera=muvera,
        chunk=chunk,
    )


@dataclass(frozen=True)
class ScoreOptions:
    """A score request's parameters, checked, with the profile's runtime options applied."""

    options: dict[str, Any]
    instruction: str | None
    lora: str | None  # cross-encoders and LLM rerankers take LoRA adapters too
    max_length: int | None
    truncate: bool
    chunk: ChunkSpec | None


def score_options(resolved: Resolved, params: ScoreParams | None) -> ScoreOptions:
    params = params or ScoreParams()
    if resolved.config.tasks.score is None:
        raise invalid_input(f"Model '{resolved.model_id}' does not support scoring", param="model")
    options = merged_options(resolved, params.options)
    explicit = instruction(params.instruction, options)
    return ScoreOptions(
        options=options,
        instruction=explicit,
        lora=lora(resolved, options),
        max_length=max_length(options, False),
        truncate=truncates(options),
        chunk=chunking(options, "score"),
    )


@dataclass(frozen=True)
class ExtractOptions:
    """An extract request's parameters, checked, with the profile's runtime options applied."""

    options: dict[str, Any]
    labels: tuple[str, ...]
    output_schema: dict[str, Any] | None
    instruction: str | None
    lora: str | None
    max_length: int | None
    truncate: bool


def extract_options(resolved: Resolved, params: ExtractParams | None) -> ExtractOptions:
    params = params or ExtractParams()
    if resolved.config.tasks.extract is None:
        raise invalid_input(f"Model '{resolved.model_id}' does not support extraction", param="model")
    options = merged_options(resolved, params.options)
    chunking(options, "extract")  # refused: extraction does not chunk
    labels = params.labels or options.get("labels") or []
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise invalid_input("labels must be a list of strings", param="labels")
    explicit = instruction(params.instruction, options)
    return ExtractOptions(
        options=options,
        labels=tuple(labels),
        output_schema=params.output_schema or None,
        instruction=explicit,
        lora=lora(resolved, options),
        max_length=max_length(options, False),
        truncate=truncates(options),
    )


@dataclass(frozen=True)
class TokenizeOptions:
    """A tokenize request's parameters, checked, with the profile's runtime options applied."""

    options: dict[str, Any]
    add_special_tokens: bool


def tokenize_options(resolved: Resolved, params: TokenizeParams | None) -> TokenizeOptions:
    params = params or TokenizeParams()
    if not resolved.config.inputs.text:
        raise invalid_input(f"Model '{resolved.model_id}' does not take text", param="model")
    options = merged_options(resolved, params.options)
    return TokenizeOptions(options=options, add_special_tokens=add_special_tokens(options))


def check_items(resolved: Resolved, items: Sequence[Item], max_text_bytes: int) -> None:
    """What the model takes of each item: its kinds of media, a text where it reads text (or media in
    its place), and texts of at most ``max_text_bytes`` UTF-8 bytes (the worker's limit)."""
    inputs = resolved.config.inputs
    for i, item in enumerate(items):
        for media in MEDIA:
            if getattr(item, media) and not getattr(inputs, "image" if media == "images" else media):
                raise invalid_input(
                    f"Model '{resolved.routable_id}' does not accept {media} input",
                    param=f"items.{i}.{media}",
                )
        text = item.text
        if inputs.text and text is None and not item.has_media():
            raise invalid_input(f"Item {i} has no text", param=f"items.{i}.text")
        if text is not None and len(text.encode("utf-8")) > max_text_bytes:
            raise invalid_input(
                f"Item {i}: text is larger than {max_text_bytes} bytes", param=f"items.{i}.text"
            )
