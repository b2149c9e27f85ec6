"""Jobs and their work messages as a gateway makes them, for tests of the sidecar and the worker."""

from __future__ import annotations

import time
from typing import Any

from protocol.api import Item
from protocol.jobs import EncodeJob, ScoreInput, ScoreJob, job_items
from protocol.params import EncodeOptions, ScoreOptions
from protocol.work_codec import WorkCodec, WorkMessage


def encode_params(**change: Any) -> EncodeOptions:
    values: dict[str, Any] = dict(
        options={}, output_types=("dense",), output_dtype="float32", instruction=None, is_query=False,
        lora=None, max_length=None, truncate=True, normalize=True, output_dim=None, muvera=None, chunk=None,
    )  # fmt: skip
    values.update(change)
    return EncodeOptions(**values)


def route(request_id: str = "r", total_items: int = 1, **change: Any) -> dict[str, Any]:
    values: dict[str, Any] = dict(
        request_id=request_id, model_id="m", profile_id="default", pool_name="default",
        machine_profile="cpu", router_id="gw", reply_subject=f"_INBOX.gw.{request_id}",
        timestamp=time.time(), total_items=total_items,
    )  # fmt: skip
    values.update(change)
    return values


def encode_job(request_id: str = "r", total_items: int = 1, *, params: EncodeOptions | None = None,
               **change: Any) -> EncodeJob:  # fmt: skip
    return EncodeJob(**route(request_id, total_items, **change), params=params or encode_params())


def score_job(request_id: str = "r", **change: Any) -> ScoreJob:
    params = ScoreOptions(options={}, instruction=None, lora=None, max_length=None, truncate=True, chunk=None)
    return ScoreJob(**route(request_id, 1, **change), params=params)


def encode_messages(
    job: EncodeJob, texts: list[str], *, per_message: int = 1024, max_bytes: int = 1 << 20, **kw: Any
) -> list[WorkMessage]:
    """``texts`` as the items of ``job``, in the messages the gateway publishes."""
    items = job_items(job, [Item(text=t) for t in texts])
    return WorkCodec.messages(items, per_message=per_message, max_bytes=max_bytes, **kw)


def score_messages(job: ScoreJob, query: str, texts: list[str]) -> list[WorkMessage]:
    pair = ScoreInput(Item(text=query), tuple(Item(text=t) for t in texts))
    return WorkCodec.messages(job_items(job, [pair]), per_message=1, max_bytes=1 << 20)
