"""Cross-request batching and length sorting, observed on the real MiniLM runtime."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

from protocol.api import Item
from tests.support.vectors import assert_same_direction
from worker.runtime import Runtime
from worker.settings import WorkerSettings

D = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture
async def runtime():
    rt = Runtime(
        WorkerSettings(
            hf_offline=True, torch_threads=1, preload_models=D, max_batch_wait_ms=50, batch_coalesce_ms=20
        )
    )
    await rt.start()
    yield rt
    await rt.close()


def _stats(rt):
    return rt.batch_stats()


async def test_concurrent_requests_share_forward_passes(runtime):
    texts = [f"sentence number {i} about batching" for i in range(16)]
    before = _stats(runtime).forwards
    results = await asyncio.gather(*(runtime.encode(D, [Item(text=t)]) for t in texts))
    forwards = _stats(runtime).forwards - before
    assert forwards < len(texts) / 2, forwards  # 16 requests, a handful of forward passes
    solo = await runtime.encode(D, [Item(text=texts[3])])
    np.testing.assert_allclose(
        results[3].items[0]["dense"]["values"], solo.items[0]["dense"]["values"], atol=1e-5
    )
    # queue time is reported per request
    assert all(r.timing.queue_ms >= 0 and r.timing.inference_ms > 0 for r in results)


async def test_mixed_lengths_are_sorted_so_padding_stays_small(runtime):
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 200))) for _ in range(64)]
    before = _stats(runtime)
    b_real, b_pad = before.real_tokens, before.padded_tokens
    res = await runtime.encode(D, [Item(text=t) for t in texts])
    after = _stats(runtime)
    real, padded = after.real_tokens - b_real, after.padded_tokens - b_pad
    assert real == res.input_tokens
    # the same units batched in arrival order (no sorting) would pad far more
    lm = runtime.loaded()[0]
    lengths = [
        len(runtime.loaded()[0].adapter.tokenizer(t, truncation=True, max_length=256)["input_ids"])
        for t in texts
    ]
    assert sum(lengths) == real
    fifo_pad = 0
    for i in range(0, len(lengths), lm.max_requests):
        chunk = lengths[i : i + lm.max_requests]
        fifo_pad += max(chunk) * len(chunk) - sum(chunk)
    assert padded < fifo_pad / 3, (padded, fifo_pad)
    assert padded / (real + padded) <= runtime.settings.max_padding_share


async def test_two_forward_threads_run_two_forwards_at_once_with_the_same_vectors():
    """SIE_FORWARD_THREADS=2: two batches are inside the model's forward at the same time (a barrier
    on the forward breaks, failing the requests, if they ran one after the other), the threads share
    one model, and the vectors equal the one-thread ones. In float32 on both: in bfloat16 (the CPU
    default where the CPU has it) a batch of 4 and one of 8 round differently, by up to 1e-3."""
    import threading

    texts = [f"thread test sentence {i} with a few more words" for i in range(8)]
    one = Runtime(WorkerSettings(hf_offline=True, torch_threads=2, preload_models=D, cpu_precision="float32"))
    await one.start()
    try:
        want = await one.encode(D, [Item(text=t) for t in texts])
    finally:
        await one.close()
    rt = Runtime(
        WorkerSettings(
            hf_offline=True,
            torch_threads=2,
            forward_threads=2,
            preload_models=D,
            cpu_precision="float32",
            max_batch_wait_ms=50,
            batch_coalesce_ms=20,
        )
    )
    await rt.start()
    try:
        lm = rt.loaded()[0]
        assert (lm.forward_threads, lm.forwards_in_flight) == (2, 2)
        both_in = threading.Barrier(2, timeout=20)
        forward = lm.adapter.forward

        def meeting_forward(ctx, batch):
            both_in.wait()
            return forward(ctx, batch)

        lm.adapter.forward = meeting_forward  # type: ignore[method-assign]
        got = await rt.encode(D, [Item(text=t) for t in texts])  # idle threads: two forwards of 4
        lm.adapter.forward = forward  # type: ignore[method-assign]
        for a, b in zip(got.items, want.items, strict=True):
            np.testing.assert_allclose(a["dense"]["values"], b["dense"]["values"], atol=1e-5)
    finally:
        await rt.close()


@pytest.mark.parametrize("direct", [False, True])
async def test_a_packed_model_runs_mixed_lengths_in_one_forward_without_padding(direct):
    """A model whose forward runs packed (load-time ``packed: true``, the default on CUDA) needs no
    length bands: 48 texts of 6–200 words share one forward pass with no pad positions, through
    the batcher (``sie serve``) and the direct path (what the sidecar hands over), with the padded
    model's vectors. The padded model cuts the same request into several bands."""
    from pathlib import Path

    from protocol.catalog import Catalog
    from protocol.model_config import parse_model_yaml

    text = (Path(__file__).parents[3] / "worker/catalog/models/all-minilm-l6-v2.yaml").read_text()
    packed_yaml = text.replace(
        "    adapter_options:\n", "    adapter_options:\n      loadtime: {packed: true}\n"
    )
    assert packed_yaml != text
    rng = random.Random(11)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 200))) for _ in range(48)]
    runs = {}
    for name, yaml in (("packed", packed_yaml), ("padded", text)):
        rt = Runtime(
            WorkerSettings(hf_offline=True, torch_threads=1, preload_models=D),
            catalog=Catalog([parse_model_yaml(yaml)]),
        )
        await rt.start()
        try:
            assert (rt.loaded()[0].adapter.packed is not None) == (name == "packed")
            before = _stats(rt)
            forwards, pad = before.forwards, before.padded_tokens
            res = await rt.encode(D, [Item(text=t) for t in texts], direct=direct)
            after = _stats(rt)
            runs[name] = (res, after.forwards - forwards, after.padded_tokens - pad)
        finally:
            await rt.close()
    (packed, p_forwards, p_pad), (padded, b_forwards, b_pad) = runs["packed"], runs["padded"]
    assert (p_forwards, p_pad) == (1, 0)
    assert b_forwards > 2 and b_pad > 0
    assert packed.input_tokens == padded.input_tokens
    # the same vectors; in bf16 (a CPU with native bf16) packed and padded round differently
    assert_same_direction(
        [a["dense"]["values"] for a in packed.items], [b["dense"]["values"] for b in padded.items]
    )


@pytest.mark.parametrize("in_flight", [0, 2])
async def test_a_direct_batch_runs_on_its_thread_in_one_call_unless_another_may_queue_behind_it(in_flight):
    """The sidecar's batches (direct): with one batch per forward thread (CPU's default) tokenising,
    the forwards and the postprocessing all run on the forward thread; with a second batch allowed in
    flight (CUDA's default), tokenising and postprocessing stay on the CPU pool, so the next batch
    tokenises while a forward runs. The answer is the same either way."""
    rt = Runtime(
        WorkerSettings(hf_offline=True, torch_threads=1, preload_models=D, forwards_in_flight=in_flight)
    )
    await rt.start()
    try:
        lm = rt.loaded()[0]
        seen: dict[str, set[str]] = {"prepare": set(), "forward": set()}
        prepare, forward = lm.adapter.prepare, lm.adapter.forward

        def watched_prepare(ctx, inputs):
            seen["prepare"].add(threading.current_thread().name)
            return prepare(ctx, inputs)

        def watched_forward(ctx, batch):
            seen["forward"].add(threading.current_thread().name)
            return forward(ctx, batch)

        lm.adapter.prepare = watched_prepare  # type: ignore[method-assign]
        lm.adapter.forward = watched_forward  # type: ignore[method-assign]
        texts = [f"a sentence about threads, number {i}" for i in range(5)]
        direct = await rt.encode(D, [Item(text=t) for t in texts], direct=True)
        [thread] = seen["forward"]
        assert thread.startswith("infer-")
        if in_flight == 0:
            assert seen["prepare"] == {thread}
        else:
            assert seen["prepare"] and all(name.startswith("cpu") for name in seen["prepare"])
        assert direct.timing.inference_ms > 0 and direct.timing.tokenization_ms > 0
        assert direct.item_tokens and all(n > 2 for n in direct.item_tokens)
        batched = await rt.encode(D, [Item(text=t) for t in texts])
        for a, b in zip(direct.items, batched.items, strict=True):
            np.testing.assert_allclose(a["dense"]["values"], b["dense"]["values"], atol=1e-5)
    finally:
        await rt.close()
