"""ModelTable alone: one entry per load signature, and what an unload does."""

from __future__ import annotations

import pytest

from protocol.catalog import Catalog
from protocol.errors import ErrorCode, SIEError
from tests.support.typed import inputs
from tests.support.worker_parts import fake_config, loaded_fake
from worker.adapters.base import RequestContext
from worker.models.table import ModelTable


def table(cleared: list[int] | None = None) -> ModelTable:
    return ModelTable(retry_after_s=4, clear_cache=lambda: (cleared if cleared is not None else []).append(1))


def test_profiles_of_one_load_signature_share_an_entry():
    config = fake_config("m").model_copy(deep=True)
    config.profiles["other"] = config.profiles["default"].model_copy(deep=True)
    catalog = Catalog([config])
    t = table()
    assert t.entry(catalog.resolve("m")) is t.entry(catalog.resolve("m:other"))
    assert [e.model_id for e in t.entries()] == ["m"] and t.loaded() == []
    t.forget(t.entries()[0].key)
    assert t.entries() == []


async def test_an_unload_fails_queued_requests_closes_the_model_and_clears_the_cache():
    cleared: list[int] = []
    t = table(cleared)
    lm = await loaded_fake(fake_config("m"))
    entry = t.entry(lm.resolved)
    entry.loaded, entry.state = lm, "loaded"
    assert t.loaded() == [lm]
    lm.former.expect()  # a request still tokenising: the queued one waits for it
    (queued,) = lm.former.submit(
        RequestContext(op="encode"), lm.adapter.prepare(RequestContext(op="encode"), inputs([{"text": "x"}]))
    )
    await t.evict(entry.key)
    assert entry.state == "absent" and entry.loaded is None and t.loaded() == []
    assert lm.closed and not lm.adapter.loaded and cleared == [1]
    with pytest.raises(SIEError) as err:
        await queued
    assert err.value.code == ErrorCode.MODEL_LOADING and err.value.retry_after == 4


async def test_evicting_what_is_not_loaded_does_nothing():
    cleared: list[int] = []
    t = table(cleared)
    await t.evict(("nothing",))
    await t.evict("not a key")
    assert cleared == []
