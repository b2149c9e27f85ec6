"""ControlConfig alone: the catalog under config deltas, what it tells the models it changed
(StaleModels), the bundle hash and the models this image cannot run."""

from __future__ import annotations

from protocol.catalog import Catalog
from protocol.model_config import Bundle, bundle_config_hash
from tests.support.worker_parts import fake_config
from worker.runtime.control_config import ControlConfig

FAKE_MODULE = "worker.adapters.fake"
MISSING = "worker.adapters.not_in_this_image"


class Stale:
    """The models told to drop instances, in order."""

    def __init__(self) -> None:
        self.dropped: list[str] = []

    async def drop_stale(self, model_id: str) -> None:
        self.dropped.append(model_id)


def missing_adapter(sie_id: str):
    config = fake_config(sie_id).model_copy(deep=True)
    config.profiles["default"].adapter_path = f"{MISSING}:Nope"
    return config


def control(*configs, adapters=(FAKE_MODULE,)) -> tuple[ControlConfig, Stale]:
    catalog = Catalog(list(configs), [Bundle(name="default", adapters=list(adapters))])
    stale = Stale()
    return ControlConfig(catalog, bundle="default", pool="default", stale=stale), stale


async def test_a_changed_model_drops_its_instances_an_unchanged_one_does_not():
    cc, stale = control(fake_config("m"))
    await cc.apply_model_config(fake_config("m"))
    await cc.apply_model_config(fake_config("new"))  # nothing loaded of a new model
    assert stale.dropped == []
    await cc.apply_model_config(fake_config("m", memory_bytes=5))
    assert stale.dropped == ["m"] and cc.catalog.get("m") == fake_config("m", memory_bytes=5)


async def test_a_tombstone_brings_back_the_image_config_or_removes_the_model():
    cc, stale = control(fake_config("m"))
    await cc.apply_model_config(fake_config("m", memory_bytes=5))
    await cc.apply_model_config(fake_config("api"))
    await cc.remove_model_config("m")
    await cc.remove_model_config("api")
    assert cc.catalog.get("m") == fake_config("m") and cc.catalog.get("api") is None
    assert stale.dropped == ["m", "m", "api"]


async def test_an_export_replaces_all_but_keeps_image_models_it_does_not_name():
    cc, stale = control(fake_config("m"), fake_config("n"))
    await cc.apply_model_config(fake_config("api"))
    await cc.replace_model_configs([fake_config("n", memory_bytes=5)])
    assert sorted(m.sie_id for m in cc.catalog.models()) == ["m", "n"]
    assert sorted(stale.dropped) == ["api", "n"]


async def test_an_adapter_the_image_lacks_makes_the_model_unsupported():
    cc, _ = control(fake_config("m"), adapters=(FAKE_MODULE, MISSING))
    assert cc.is_supported(fake_config("m"))
    await cc.apply_model_config(missing_adapter("gone"))
    assert cc.unsupported_models == {"gone"}
    # a bundle that does not serve that adapter does not care
    await cc.apply_model_config(missing_adapter("gone"), bundle_adapters=[FAKE_MODULE])
    assert cc.unsupported_models == set()
    await cc.remove_model_config("gone")
    assert cc.unsupported_models == set()


async def test_the_bundle_hash_is_scoped_to_the_pool_unless_asked_otherwise():
    other = fake_config("elsewhere").model_copy(update={"pool": "gpu"})
    cc, _ = control(fake_config("m"), other)
    bundle = Bundle(name="default", adapters=[FAKE_MODULE])
    models = cc.catalog.models()
    assert cc.bundle_config_hash() == bundle_config_hash(bundle, models, pool="default")
    assert cc.bundle_config_hash(pool=None) == bundle_config_hash(bundle, models)
    assert cc.bundle_config_hash(pool=None) != cc.bundle_config_hash()
    assert cc.bundle_config_hash(adapters=[]) == ""  # the control plane's bundle serves nothing
