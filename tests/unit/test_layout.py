"""The house rule of the layout: process packages import protocol and iokit, never each other;
protocol (the pure wire contract) imports none of them and does no I/O; iokit (the shared I/O)
imports protocol only."""

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


@pytest.mark.parametrize("package", [*PROCESSES, "protocol", "iokit"])
def test_packages_import_only_protocol(package):
    forbidden = set(PROCESSES) - {package}
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & forbidden)
        for path in sorted((ROOT / package).rglob("*.py"))
        if imported_packages(path) & forbidden
    }
    assert not offenders, f"{package} imports another process package: {offenders}"


@pytest.mark.parametrize("package", ["protocol", "iokit"])
def test_the_shared_packages_stay_below_the_processes(package):
    below = {"protocol"} if package == "iokit" else set()
    reached = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & ({*PROCESSES, "iokit"} - below))
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert not {k: v for k, v in reached.items() if v}


def test_protocol_does_no_io():
    """protocol/ is the wire contract: no HTTP server or client, no NATS, no sockets."""
    io = {"aiohttp", "nats", "socket", "uvloop", "requests", "httpx"}
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & io)
        for path in sorted((ROOT / "protocol").rglob("*.py"))
        if imported_packages(path) & io
    }
    assert not offenders, offenders


def _project_ancestors(cls: type, packages: tuple[str, ...]) -> list[str]:
    return [
        f"{base.__module__}.{base.__qualname__}"
        for base in cls.__mro__[1:]
        if base.__module__.split(".")[0] in packages
    ]


@pytest.mark.parametrize("package", ["gateway", "sidecar", "worker", "config_service"])
def test_classes_are_composed_not_stacked(package):
    """Issue 38: no class of a process package has more than two project-defined ancestors; the
    worker's adapters' family bases are the exception (an adapter extends HFTextAdapter, which
    extends Adapter)."""
    import importlib
    import inspect

    packages = (*PROCESSES, "protocol")
    tall, seen = {}, 0
    for path in sorted((ROOT / package).rglob("*.py")):
        if "adapters" in path.parts or "migrations" in path.parts or path.name == "__main__.py":
            continue  # adapters: the exception above; migrations: alembic's scripts; __main__: runs
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            seen += 1
            if len(_project_ancestors(cls, packages)) > 2:
                tall[f"{cls.__module__}.{cls.__qualname__}"] = _project_ancestors(cls, packages)
    assert seen > 5  # the walk found the package's classes
    assert not tall, f"classes built as stacks of subclasses: {tall}"


@pytest.mark.parametrize("package", ["gateway", "sidecar", "worker", "config_service"])
def test_no_part_calls_back_up_through_a_stub(package):
    """A layer that raised NotImplementedError for a method a subclass above it provided: gone with
    the stacks. (Abstract adapter hooks are the worker's adapters' own business.)"""
    stubs = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / package).rglob("*.py"))
        if "adapters" not in p.parts and "raise NotImplementedError" in p.read_text()
    ]
    assert not stubs
