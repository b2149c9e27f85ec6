"""The house rule of the layout: process packages import protocol, never each other; protocol
imports none of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = ("gateway", "sidecar", "worker", "config_service", "sdk")


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", [*PROCESSES, "protocol"])
def test_packages_import_only_protocol(package):
    forbidden = set(PROCESSES) - {package}
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & forbidden)
        for path in sorted((ROOT / package).rglob("*.py"))
        if imported_packages(path) & forbidden
    }
    assert not offenders, f"{package} imports another process package: {offenders}"
