"""The gateway resolves every request's model through a cache of routes that a catalog write empties."""

from __future__ import annotations

import pytest

from gateway.registry import CatalogRegistry
from protocol.catalog import Catalog
from protocol.errors import SIEError
from worker import DEFAULT_BUNDLES_DIR, DEFAULT_MODELS_DIR

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture
def registry() -> CatalogRegistry:
    return CatalogRegistry(Catalog.from_dirs(DEFAULT_MODELS_DIR, DEFAULT_BUNDLES_DIR))


def test_a_route_is_resolved_once_per_catalog_version(registry):
    first = registry.resolve(MINILM, {})
    assert registry.resolve(MINILM, {}) is first and registry.resolve(MINILM) is first
    config = registry.catalog.get(MINILM)
    assert config is not None
    changed = config.model_copy(update={"description": "changed"})
    registry.catalog.put(changed)  # a delta from the config service
    again = registry.resolve(MINILM, {})
    assert again is not first and again.resolved.config is changed
    registry.catalog.remove(MINILM)
    with pytest.raises(SIEError) as err:
        registry.resolve(MINILM, {})
    assert err.value.code == "MODEL_NOT_FOUND"


def test_the_profile_option_is_part_of_the_key_and_bad_ones_are_refused_every_time(registry):
    default = registry.resolve(MINILM, {})
    profiles = sorted(registry.catalog.get(MINILM).profiles)
    other = next((p for p in profiles if p != "default"), "default")
    assert registry.resolve(MINILM, {"profile": other}).resolved.profile_name == other
    assert registry.resolve(MINILM, {}) is default
    for bad in ("no-such-profile", 7, ["default"]):
        for _ in range(2):  # a refusal is never cached as a route
            with pytest.raises(SIEError):
                registry.resolve(MINILM, {"profile": bad})
