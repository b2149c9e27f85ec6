"""The worker's one settings object, read from ``SIE_*`` environment variables."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from protocol.batching import BatchLimits
from protocol.priority import priority_setting
from worker import DEFAULT_BUNDLES_DIR, DEFAULT_MODELS_DIR


def _default_cpu_pool() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SIE_", extra="ignore", populate_by_name=True)

    # front door
    host: str = "0.0.0.0"  # bind address of sie serve
    port: int = 8080  # port of sie serve
    api_key: str = Field(
        default="", repr=False
    )  # sie serve: comma-separated bearer keys (sie serve --api-key); when set, every route but the probes (/healthz, /livez, /readyz) and the API docs (/openapi.json, /docs) needs Authorization: Bearer <key> (401 UNAUTHORIZED without or with a wrong one); empty = open
    auth_exempt_operational: bool = False  # true: /, /health, /metrics and /ws/* answer without a token (on the gateway; on sie serve with SIE_API_KEY), for a scraper that cannot send one
    model_processes: int = Field(
        default=0, ge=0, validation_alias=AliasChoices("SIE_MODEL_PROCESSES", "SIE_SERVE_PROCESSES")
    )  # whole workers on this device, each its own process (one Python process cannot keep a GPU busy): sie serve's share the port (SO_REUSEPORT), a pod's (python -m worker.ipc) each serve their own IPC socket to their own sidecar; 0 = 4 on CUDA, 1 on CPU; metrics are per process (SIE_SERVE_PROCESSES is its deprecated former name)
    process_index: int = Field(
        default=0, ge=0
    )  # set by the first process for the sibling processes it starts (0 = the first, which starts and restarts the others)
    # catalog
    models_dir: str = str(DEFAULT_MODELS_DIR)  # directory of model YAML files
    bundles_dir: str = str(DEFAULT_BUNDLES_DIR)  # directory of bundle YAML files
    bundle: str = "default"  # the bundle this worker serves (its adapters and models)
    preload_models: str = ""  # comma-separated model specs loaded at start-up
    pinned_models: str = (
        ""  # comma-separated model specs loaded at start-up and never evicted or unloaded when idle
    )
    model_idle_timeout_s: float = Field(
        default=0.0, ge=0
    )  # unload a model (not a pinned one) after this long without a request; 0 = never (off)
    machine_profile: str = ""  # when set, requests naming another profile are refused
    pool: str = "default"  # the pool this worker serves; scopes its bundle_config_hash (models of other pools do not count)
    # queue mode (python -m worker.ipc)
    ipc_socket_path: str = "/tmp/sie-ipc.sock"  # Unix socket of the IPC front door the sidecar connects to
    worker_id: str = Field(
        default_factory=socket.gethostname
    )  # worker identity in Ping answers and results (default: hostname)
    # execution
    device: str = "auto"  # auto | cpu | cuda
    cpu_precision: Literal["auto", "float32", "bfloat16"] = (
        "auto"  # CPU: what float32 profiles of bf16-safe adapters (dense text encoders) compute in: auto = bfloat16 where the CPU has native bf16 (avx512_bf16 or amx_bf16 in /proc/cpuinfo), else float32; float32 = as the profile asks; bfloat16 = bfloat16 even without native bf16 (slow, emulated); profiles that ask a half precision and GPUs are not affected
    )
    torch_threads: int = 0  # intra-op threads of all inference together; 0 = torch default (the cores)
    forward_threads: int = Field(
        default=1, ge=1, validation_alias=AliasChoices("SIE_FORWARD_THREADS", "SIE_FORWARD_LANES")
    )  # CPU: forwards of one model that run at once, each on its own thread with torch_threads/forward_threads intra-op threads (worker/batching/forward_threads.py; CUDA: always 1; SIE_FORWARD_LANES is its deprecated former name)
    cpu_workers: int = Field(default_factory=_default_cpu_pool)  # tokenisation / postprocessing pool
    max_batch_cost: int = 16384  # tokens per forward pass (capped by the profile's max_batch_tokens)
    max_batch_requests: int = 64  # items per forward pass
    max_batch_wait_ms: float = 10.0  # longest wait for a batch to fill
    batch_coalesce_ms: float = 2.0  # flush early when nothing new arrived for this long
    max_padding_share: float = (
        0.2  # cut a batch where pad positions would pass this share (padded forwards; packed ones have none)
    )
    forwards_in_flight: int = Field(
        default=0, ge=0
    )  # batches handed to a model's forward threads at once; 0 = 2 on CUDA (the next queued behind the running one), one per forward thread on CPU
    preempt_max_share: float = Field(
        default=0.9, ge=0, le=1
    )  # CPU, one forward thread: the most of a bulk forward's time that interactive batches run inside it (and its waits for them, SIE_PREEMPT_QUIET_MS) may take (worker/batching/preemption.py); past it they wait for its end, so bulk keeps the rest; 0 = never inside
    preempt_quiet_ms: float = Field(
        default=8.0, ge=0
    )  # CPU, one forward thread: after an interactive batch, a bulk forward waits this long at its next block for the next one (within SIE_PREEMPT_MAX_SHARE), so that a client's next request finds the cores free; 0 = bulk goes on at once
    preempt_spare_core_ms: float = Field(
        default=1000.0, ge=0
    )  # CPU, one forward thread: for this long after interactive work, bulk forwards run on one intra-op thread fewer (work run inside them on all), leaving a core to the processes that carry the next request in and the answer out; 0 = bulk always on all
    gil_switch_interval_ms: float = Field(
        default=0.0, ge=0
    )  # Python's thread switch interval; 0 = 0.5 on CUDA, Python's 5 on CPU
    # priority classes of sie serve (X-SIE-Priority: interactive | bulk), as the sidecar's SIE_BULK_*
    serve_default_priority: str = (
        "interactive"  # sie serve: priority class of requests without X-SIE-Priority (interactive or bulk)
    )
    serve_bulk_mixed_batch_requests: int = Field(
        default=8, gt=0
    )  # sie serve: most items per bulk batch while interactive work of the model is arriving (at most one bulk batch runs at a time)
    serve_bulk_mixed_window_s: float = Field(
        default=2.0, ge=0
    )  # sie serve: interactive work seen this recently makes bulk batches the mixed size
    serve_bulk_max_wait_ms: float = Field(
        default=2000.0, gt=0
    )  # sie serve: a bulk batch waiting this long is scheduled like an interactive one
    # limits
    max_request_body_bytes: int = 34 * 1024 * 1024  # largest request body (413 INPUT_TOO_LONG above)
    request_body_timeout_s: float = Field(
        default=30.0, gt=0
    )  # the whole request body must arrive within this (408 after)
    max_items_per_request: int = 4096  # most items in one encode/extract request (400 above)
    serve_result_cache_items: int = Field(
        default=0, ge=0
    )  # sie serve: encoded items kept in an in-process LRU result cache (0 = off; X-SIE-Cache: off opts a request out)
    serve_result_cache_ttl_s: float = Field(
        default=3600.0, gt=0
    )  # sie serve: a cached encode result expires this long after it was stored
    max_score_items: int = 1000  # most items in one score request (400 above)
    rerank_default_model: str = (
        ""  # sie serve: the model of a TEI-style POST /rerank that names none (400 when unset)
    )
    max_item_text_bytes: int = 2 * 1024 * 1024  # largest UTF-8 text of one item (400 above)
    max_chunks_per_item: int = Field(
        default=64, ge=1
    )  # most chunks one item may split into with overflow_policy chunk (400 INPUT_TOO_LONG above)
    # lifecycle
    model_loading_retry_after_s: float = 5.0  # Retry-After of 503 MODEL_LOADING
    load_failure_cooldown_s: float = 30.0  # a transient load failure is answered 502 this long
    resource_exhausted_retry_after_s: float = 5.0  # Retry-After of 503 RESOURCE_EXHAUSTED
    disable_oom_recovery: bool = (
        False  # answer OOM at once instead of clearing caches, evicting and splitting
    )
    # memory manager (worker/models/memory.py)
    memory_pressure_threshold_percent: float = Field(
        default=85.0, gt=0, le=100
    )  # evict LRU models above this
    memory_budget_bytes: int = Field(
        default=0, ge=0
    )  # >0: synthetic device, usage = loaded models' memory_bytes()
    memory_monitor_interval_s: float = Field(default=1.0, ge=0)  # background pressure check; 0 = off
    # LoRA (worker/models/lora.py)
    max_loras_per_model: int = Field(default=10, ge=1)  # LRU of loaded LoRA adapters per model
    lora_loading_retry_after_s: float = 1.0  # Retry-After of 503 LORA_LOADING
    max_lora_bytes: int = Field(
        default=512 * 1024 * 1024, gt=0
    )  # largest LoRA adapter fetched from the hub (its adapter_config.json and *.safetensors); larger ones are refused
    # weights (worker/models/weights.py): local disk cache -> cluster cache -> hub
    hf_offline: bool = False  # never contact the hub (HF_HUB_OFFLINE=1 also honoured)
    disk_cache_dir: str = "~/.cache/sie/weights"  # local weight cache (hub and cluster downloads land here)
    disk_pressure_threshold_percent: float = Field(default=85.0, gt=0, le=100)  # evict LRU weights above this
    disk_budget_bytes: int = Field(default=0, ge=0)  # >0: synthetic disk, usage = size of the cache's entries
    cluster_cache_url: str = ""  # shared directory, file://, s3:// or gs:// (fsspec); "" = none
    download_progress_interval_s: float = Field(default=10.0, gt=0)  # progress log period while downloading
    weights_check_interval_s: float = Field(
        default=60.0, ge=0
    )  # how often /v1/models re-checks where each model's weights are (one short hub probe, one cluster-cache listing; nothing downloaded); 0 = never (weights: unknown)
    log_level: str = "INFO"  # logging level
    log_format: Literal["text", "json"] = (
        "text"  # log lines: text, or json (one object per line with request_id and trace_id)
    )

    @field_validator("serve_default_priority")
    @classmethod
    def _priority(cls, value: str) -> str:
        return priority_setting(value, "SIE_SERVE_DEFAULT_PRIORITY")

    def batch_limits(self, max_batch_tokens: int | None = None) -> BatchLimits:
        """The batching policy's limits for one model of sie serve (``max_batch_tokens``: its
        profile's, capping SIE_MAX_BATCH_COST); at most one bulk batch runs at a time."""
        return BatchLimits(
            max_requests=self.max_batch_requests,
            max_cost=min(self.max_batch_cost, max_batch_tokens or self.max_batch_cost),
            max_wait_s=self.max_batch_wait_ms / 1000.0,
            coalesce_s=self.batch_coalesce_ms / 1000.0,
            max_pad_share=self.max_padding_share,
            bulk_max_requests=self.max_batch_requests,
            bulk_mixed_requests=self.serve_bulk_mixed_batch_requests,
            bulk_mixed_window_s=self.serve_bulk_mixed_window_s,
            bulk_max_wait_s=self.serve_bulk_max_wait_ms / 1000.0,
            bulk_max_running=1,
        )

    def api_keys(self) -> list[str]:
        """The bearer keys sie serve accepts (SIE_API_KEY, comma-separated); empty: no auth."""
        return [k.strip() for k in self.api_key.split(",") if k.strip()]

    def preload_list(self) -> list[str]:
        return [m.strip() for m in self.preload_models.split(",") if m.strip()]

    def pinned_list(self) -> list[str]:
        return [m.strip() for m in self.pinned_models.split(",") if m.strip()]
