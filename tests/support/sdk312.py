"""Run the public sie-sdk 0.10.1 (Python 3.12) against one of our servers.

A Python 3.12 interpreter is looked up (``SIE_PY312``, pyenv's 3.12, or ``python3.12`` on PATH);
the venv ``.venv312`` in the repository is created once and reused (built under a lock, so the
workers of ``pytest -n`` build it once between them and the others wait for it). Tests call ``run_sdk(script,
url)``: the script runs in that venv with ``URL`` set, and prints one JSON document on its last
line, which is returned. Where no Python 3.12 or no sie-sdk can be had, ``sdk_unavailable()``
says why and tests skip with that reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from functools import lru_cache
from pathlib import Path

from tests.support.shared import locked

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv312"
SDK = "sie-sdk==0.10.1"


def _python312() -> str | None:
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [os.environ.get("SIE_PY312")]
    candidates += sorted(str(p) for p in pyenv_root.glob("versions/3.12*/bin/python3.12"))
    candidates.append(shutil.which("python3.12"))  # may be a pyenv shim: tried last
    for c in candidates:
        if c and Path(c).exists():
            return c
    return None


@lru_cache(maxsize=1)
def sdk_unavailable() -> str | None:
    """None when the SDK venv is ready, else the reason it is not."""
    with locked(REPO / ".venv312.lock"):
        return _build()


def _build() -> str | None:
    py = VENV / "bin" / "python"
    marker = VENV / ".sdk-installed"
    if marker.exists() and py.exists():
        return None
    base = _python312()
    if base is None:
        return "no Python 3.12 interpreter found (set SIE_PY312)"
    try:
        if not py.exists():
            shutil.rmtree(VENV, ignore_errors=True)
            subprocess.run([base, "-m", "venv", str(VENV)], check=True, capture_output=True, timeout=120)
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", SDK], check=True, capture_output=True, timeout=600
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        out = getattr(exc, "stderr", b"") or b""
        return f"could not install {SDK} into {VENV}: {out.decode(errors='replace')[-500:]}"
    marker.touch()
    return None


def run_sdk(script: str, url: str, timeout: float = 240.0, env: dict[str, str] | None = None) -> dict:
    """Run ``script`` (Python source using sie_sdk; ``URL`` is defined) and return its JSON output."""
    code = "import json, os\nURL = os.environ['SIE_TEST_URL']\n" + textwrap.dedent(script)
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "SIE_TEST_URL": url, **(env or {})},
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"sdk script failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    return json.loads(lines[-1])
