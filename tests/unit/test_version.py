"""The version lives in one place, ``protocol.SERVER_VERSION``; everything that names it agrees."""

import re
import tomllib
from pathlib import Path

import yaml

from protocol import SERVER_VERSION

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_takes_its_version_from_the_protocol():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "protocol.SERVER_VERSION"}


def test_the_chart_and_the_compose_file_name_the_same_version():
    chart = yaml.safe_load((ROOT / "helm/sie-cluster/Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == SERVER_VERSION
    tags = re.findall(r"image: sie-[a-z]+:([0-9][^\s-]*)", (ROOT / "deploy/compose/compose.yaml").read_text())
    assert tags and set(tags) == {SERVER_VERSION}


def test_the_changelog_has_a_section_for_the_version():
    assert f"## [{SERVER_VERSION}]" in (ROOT / "CHANGELOG.md").read_text()
