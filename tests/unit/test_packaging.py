"""The package metadata builds without deprecation warnings (issue 36, item 6): setuptools
announced that the ``project.license`` table stops building on 2027-02-18."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it():
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    (requirement,) = [r for r in doc["build-system"]["requires"] if r.startswith("setuptools")]
    assert requirement.replace(" ", "") == "setuptools>=77"  # the first to read an SPDX license


def test_building_the_metadata_warns_of_nothing(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} here; the build requires 77 or later")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "always",
            "-c",
            "import os, setuptools.build_meta as b; os.mkdir('meta'); print(b.prepare_metadata_for_build_wheel('meta'))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr and "deprecated" not in out.stderr.lower(), out.stderr
    metadata = next((tmp_path / "meta").glob("*.dist-info")) / "METADATA"
    assert "License-Expression: Apache-2.0" in metadata.read_text()
