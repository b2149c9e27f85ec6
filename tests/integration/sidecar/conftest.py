"""Fixtures shared by the sidecar tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def worker_dirs(tmp_path):
    """Empty models and bundles directories for a worker process started by the test."""
    models = tmp_path / "models"
    bundles = tmp_path / "bundles"
    models.mkdir()
    bundles.mkdir()
    return models, bundles
