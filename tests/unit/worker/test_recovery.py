"""OomRecovery alone: a fake model that runs out of memory on chosen forward calls, and Siblings
that free memory (or cannot)."""

from __future__ import annotations

import pytest

from protocol.errors import ErrorCode, SIEError
from tests.support.typed import inputs
from tests.support.worker_parts import fake_config, loaded_fake, settings
from worker.adapters.base import RequestContext
from worker.metrics import WorkerMetrics
from worker.models.recovery import OomRecovery

CTX = RequestContext(op="encode")


class Siblings:
    """Siblings to evict: ``available`` of them, each eviction recorded."""

    def __init__(self, available: int) -> None:
        self.available = available
        self.asked: list[str] = []

    def evict_for(self, keep) -> bool:
        self.asked.append(keep.model_id)
        if not self.available:
            return False
        self.available -= 1
        return True


async def recovering(oom_repeat: int, *, siblings: int = 0, **kw):
    """A recovery, a fake model that fails ``oom_repeat`` forward calls from its second one on,
    and four units of it (its first forward call prepared them: dispatch 1 never fails)."""
    metrics = WorkerMetrics()
    cleared: list[int] = []
    recovery = OomRecovery(
        settings(**kw), metrics, siblings=Siblings(siblings), clear_cache=lambda: cleared.append(1)
    )
    lm = await loaded_fake(fake_config("m", oom_on_batch=2, oom_repeat=oom_repeat), forward=recovery.forward)
    units = lm.adapter.prepare(CTX, inputs([{"text": f"text {i}"} for i in range(4)]))
    lm.adapter.forward(CTX, units)  # dispatch 1
    return recovery, lm, units, cleared, metrics


def dense(outputs) -> list[list[float]]:
    return [o["dense"].tolist() for o in outputs]


def steps(recovery: OomRecovery) -> list[str]:
    return [step for _, step in recovery.events]


async def test_a_forward_without_oom_is_the_adapters():
    recovery, lm, units, cleared, _ = await recovering(0)
    assert dense(recovery.forward(lm, CTX, units)) == dense(lm.adapter.forward(CTX, units))
    assert steps(recovery) == [] and cleared == []
    await lm.former.close()


async def test_clearing_the_cache_is_the_first_step():
    recovery, lm, units, cleared, metrics = await recovering(1)
    assert len(recovery.forward(lm, CTX, units)) == 4
    assert steps(recovery) == ["oom", "cache_clear"] and cleared == [1]
    assert metrics.oom_recoveries.labels("m", "cache_clear")._value.get() == 1
    await lm.former.close()


async def test_a_sibling_goes_when_clearing_was_not_enough():
    recovery, lm, units, _, _ = await recovering(2, siblings=1)
    assert len(recovery.forward(lm, CTX, units)) == 4
    assert steps(recovery) == ["oom", "cache_clear", "evict_sibling"]
    assert recovery.siblings.asked == ["m"]
    await lm.former.close()


async def test_without_a_sibling_the_batch_is_split_until_the_halves_fit():
    recovery, lm, units, _, _ = await recovering(3)
    outputs = recovery.forward(lm, CTX, units)
    assert dense(outputs) == dense(lm.adapter.forward(CTX, units))  # in order, whole
    # calls 2-4 fail: the batch, after the cache clear, the first half; its halves then fit
    assert steps(recovery) == ["oom", "cache_clear", "split", "split"]
    await lm.former.close()


async def test_what_never_fits_is_resource_exhausted_with_the_retry_after_setting():
    recovery, lm, units, _, _ = await recovering(1000, resource_exhausted_retry_after_s=7)
    with pytest.raises(SIEError) as err:
        recovery.forward(lm, CTX, units)
    assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED and err.value.retry_after == 7
    assert steps(recovery)[-1] == "exhausted"
    await lm.former.close()


async def test_recovery_switched_off_answers_the_first_oom():
    recovery, lm, units, cleared, _ = await recovering(1, disable_oom_recovery=True)
    with pytest.raises(SIEError) as err:
        recovery.forward(lm, CTX, units)
    assert err.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert steps(recovery) == ["oom"] and cleared == []
    await lm.former.close()


async def test_an_unloaded_model_runs_nothing_and_says_retry():
    recovery, lm, units, _, _ = await recovering(0, model_loading_retry_after_s=3)
    lm.closed = True
    with pytest.raises(SIEError) as err:
        recovery.forward(lm, CTX, units)
    assert err.value.code == ErrorCode.MODEL_LOADING and err.value.retry_after == 3
    await lm.former.close()


async def test_other_errors_are_not_recovered():
    recovery, lm, units, _, _ = await recovering(0)
    with pytest.raises(AttributeError):
        recovery.forward(lm, CTX, [*units, None])
    assert steps(recovery) == []
    await lm.former.close()
