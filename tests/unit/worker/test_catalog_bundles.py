"""Every model of the shipped catalog is served by some bundle: a profile whose adapter module no
bundle lists is unreachable through the gateway (MODEL_NOT_FOUND), as ColPali once was."""

from __future__ import annotations

from gateway.registry import CatalogRegistry
from protocol.catalog import Catalog
from worker import DEFAULT_BUNDLES_DIR, DEFAULT_MODELS_DIR


def test_every_catalog_profile_has_a_bundle():
    catalog = Catalog.from_dirs(DEFAULT_MODELS_DIR, DEFAULT_BUNDLES_DIR)
    assert len(catalog.models()) > 50
    unserved = [
        f"{m.sie_id}:{profile}"
        for m in catalog.models()
        for profile in m.profiles
        if not catalog.bundles_for(m, profile)
    ]
    assert unserved == []


def test_the_gateway_resolves_the_visual_retrievers():
    registry = CatalogRegistry.from_dirs(str(DEFAULT_MODELS_DIR), str(DEFAULT_BUNDLES_DIR))
    for model in ("vidore/colpali-v1.3-hf", "vidore/colqwen2-v1.0-hf"):
        route = registry.resolve(model, {})
        assert route.bundles == ["default"], route
