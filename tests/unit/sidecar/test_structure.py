"""The sidecar is composed, not stacked: no class has more than two project-defined ancestors, and
no part calls back up through a stub."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import sidecar

PROJECT = ("protocol", "gateway", "sidecar", "worker", "config_service", "sdk")


def sidecar_classes() -> list[type]:
    found = []
    for info in pkgutil.iter_modules(sidecar.__path__, "sidecar."):
        if info.name == "sidecar.__main__":
            continue  # runs the process
        module = importlib.import_module(info.name)
        found += [
            c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__
        ]
    return found


def test_no_class_has_more_than_two_project_defined_ancestors():
    classes = sidecar_classes()
    assert len(classes) > 10  # the walk found the package
    tall = {
        c.__qualname__: names
        for c in classes
        if len(names := [a.__qualname__ for a in c.__mro__[1:] if a.__module__.split(".")[0] in PROJECT]) > 2
    }
    assert not tall, tall


def test_no_stub_calls_back_up():
    stubs = [
        p.name for p in Path(sidecar.__file__).parent.glob("*.py") if "NotImplementedError" in p.read_text()
    ]
    assert not stubs
