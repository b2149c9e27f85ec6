"""The Executor alone: a loaded fake model and a CPU pool; the batched path and the direct one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from protocol.api import Item
from protocol.errors import ErrorCode, SIEError
from tests.support.worker_parts import fake_config, loaded_fake, settings
from worker.adapters.base import RequestContext
from worker.runtime.executor import Executor
from worker.runtime.results import Timing

CTX = RequestContext(op="encode")
ITEMS = [Item(text=f"item {i} " + "word " * i) for i in range(6)]


@pytest.fixture
def executor():
    pool = ThreadPoolExecutor(2)
    yield Executor(pool, max_padding_share=1.0)
    pool.shutdown()


def dense(outputs) -> list[list[float]]:
    return [o["dense"].tolist() for o in outputs]


@pytest.mark.parametrize("direct", [True, False])
async def test_outputs_are_the_adapters_in_item_order(executor, direct):
    lm = await loaded_fake(fake_config("m"))
    timing = Timing()
    units, outputs = await executor.infer(lm, CTX, ITEMS, direct, timing)
    assert dense(outputs) == dense(lm.adapter.forward(CTX, lm.adapter.prepare(CTX, ITEMS)))
    assert [u.input_tokens for u in units] == [u.cost for u in units] and len(units) == 6
    assert lm.stats.forwards >= 1 and lm.stats.units == 6
    assert timing.inference_ms >= 0 and lm.former.preparing == 0
    await lm.former.close()


async def test_a_direct_batch_runs_in_forwards_of_the_models_batch_cost(executor):
    lm = await loaded_fake(fake_config("m"), worker_settings=settings(max_batch_cost=8))
    await executor.infer(lm, CTX, ITEMS, True, Timing())
    assert lm.stats.forwards > 1 and lm.stats.units == 6
    await lm.former.close()


@pytest.mark.parametrize("direct", [True, False])
async def test_post_runs_on_the_outputs_before_they_leave(executor, direct):
    lm = await loaded_fake(fake_config("m"))
    timing = Timing()

    def post(units, outputs):
        return [len(u.data[1]) for u in units]

    _, outputs = await executor.infer(lm, CTX, ITEMS[:3], direct, timing, post=post)
    assert outputs == [2, 3, 4]  # the words of "item N" and its N extra words
    assert timing.postprocessing_ms >= 0
    await lm.former.close()


@pytest.mark.parametrize("direct", [True, False])
async def test_an_operation_the_model_lacks_is_refused_and_releases_the_batcher(executor, direct):
    lm = await loaded_fake(fake_config("m"))
    with pytest.raises(SIEError) as err:
        await executor.infer(lm, RequestContext(op="tokenize"), ITEMS, direct, Timing())
    assert err.value.code == ErrorCode.INVALID_INPUT and "does not support tokenize" in err.value.message
    assert lm.former.preparing == 0  # an announced request that failed does not hold a batch back
    await lm.former.close()


async def test_a_lora_on_a_model_without_lora_support_is_refused(executor):
    lm = await loaded_fake(fake_config("m"))
    with pytest.raises(SIEError) as err:
        await executor.infer(lm, RequestContext(op="encode", lora="x"), ITEMS, True, Timing())
    assert err.value.code == ErrorCode.INVALID_INPUT and err.value.param == "lora"
    await lm.former.close()


async def test_offload_runs_on_the_pool(executor):
    import threading

    assert (await executor.offload(lambda: threading.current_thread().name)).startswith("ThreadPoolExecutor")
