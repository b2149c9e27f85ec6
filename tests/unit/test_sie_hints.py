"""The ``sie`` commands that ``sie up`` prints as hints run when pasted (issue 36, item 5): after
``make up`` the ``sie`` script is ``.venv/bin/sie``, which is not on PATH."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from deploy.state import sie_command

README = Path(__file__).resolve().parents[2] / "README.md"


def _install(root: Path) -> Path:
    """A venv-like layout: bin/python and bin/sie."""
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").touch()
    (bin_dir / "sie").touch()
    return bin_dir


def test_sie_on_path_and_ours_is_just_sie(tmp_path):
    bin_dir = _install(tmp_path)
    cmd = sie_command(
        which=lambda name: str(bin_dir / name), executable=str(bin_dir / "python"), cwd=tmp_path
    )
    assert cmd == "sie"


def test_after_make_up_in_the_checkout_it_is_the_venv_path(tmp_path):
    bin_dir = _install(tmp_path)
    cmd = sie_command(which=lambda name: None, executable=str(bin_dir / "python"), cwd=tmp_path)
    assert cmd == ".venv/bin/sie"


def test_another_sie_on_path_is_not_ours(tmp_path):
    bin_dir = _install(tmp_path)
    other = tmp_path / "elsewhere" / "sie"
    other.parent.mkdir()
    other.touch()
    cmd = sie_command(which=lambda name: str(other), executable=str(bin_dir / "python"), cwd=tmp_path)
    assert cmd == ".venv/bin/sie"


def test_from_another_directory_it_is_the_absolute_path(tmp_path):
    bin_dir = _install(tmp_path / "checkout with space")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd = sie_command(which=lambda name: None, executable=str(bin_dir / "python"), cwd=elsewhere)
    assert shlex.split(cmd) == [str(bin_dir / "sie")]


def test_in_the_bin_directory_it_still_names_a_path(tmp_path):
    bin_dir = _install(tmp_path)
    assert sie_command(which=lambda name: None, executable=str(bin_dir / "python"), cwd=bin_dir) == "./sie"


def test_without_a_sie_script_it_is_python_dash_m(tmp_path):
    python = tmp_path / "bin" / "python3"
    python.parent.mkdir()
    python.touch()
    cmd = sie_command(which=lambda name: None, executable=str(python), cwd=tmp_path)
    assert cmd == f"{python} -m deploy.cli"


def test_the_readme_says_make_up_holds_the_terminal_and_how_to_detach():
    text = README.read_text()
    assert re.search(r"`make up`[^.]{0,200}(holds|keeps) the terminal", text), (
        "say that make up holds the terminal"
    )
    assert "make up SIE_ARGS=--detach" in text
    assert ".venv/bin/sie down" in text  # the stop command as a new user can run it
