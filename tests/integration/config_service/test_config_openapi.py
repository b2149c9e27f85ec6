"""The config service's ``/openapi.json`` validates and ``/docs`` loads with its assets from the
service itself, without a token."""

from __future__ import annotations

import pytest

from tests.integration.config_service.conftest import Instance, make_settings
from tests.support.fuzz import LoopThread
from tests.support.openapi_checks import check_document_and_docs


@pytest.fixture
def config_url(nats_server, tmp_path, catalog_dirs):
    settings = make_settings(f"sqlite:///{tmp_path / 'state' / 'config.db'}", nats_server.url, catalog_dirs)
    loop = LoopThread()
    inst = Instance(settings)
    loop.run(inst.start())
    try:
        yield inst.url
    finally:
        loop.run(inst.close())
        loop.close()


def test_document_and_docs_page(config_url):
    doc = check_document_and_docs(config_url)
    assert "/v1/configs/resolve" in doc["paths"]


def _fuzz(url: str, examples: int) -> None:
    from tests.integration.config_service.conftest import ADMIN
    from tests.support.schema_fuzz import fuzz_service

    statuses = fuzz_service(url, max_examples=examples, headers={"Authorization": f"Bearer {ADMIN}"})
    print("config service schemathesis:", dict(statuses))
    assert statuses["GET /v1/configs/epoch 200"] >= 1, statuses


def test_schemathesis_bounded(config_url):
    _fuzz(config_url, 8)


@pytest.mark.slow
def test_schemathesis_long(config_url):
    _fuzz(config_url, 200)
