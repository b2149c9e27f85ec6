from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.helm_binary import find_helm

CHART = Path(__file__).resolve().parents[2] / "helm" / "sie-cluster"
CRD_APIS = [
    "keda.sh/v1alpha1/ScaledObject",
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PodMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
]


@pytest.fixture(scope="session")
def helm() -> str:
    path, reason = find_helm()
    if path is None:
        pytest.skip(f"no helm binary: {reason}")
    return path


class Renderer:
    def __init__(self, helm: str) -> None:
        self.helm = helm

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.helm, *args], capture_output=True, text=True, timeout=120)

    def template(self, *values_files: str, **options) -> list[dict]:
        """The documents ``helm template`` renders (``options``: as template_raw's)."""
        res = self.template_raw(*values_files, **options)
        assert res.returncode == 0, res.stderr
        return [d for d in yaml.safe_load_all(res.stdout) if d]

    def template_raw(
        self,
        *values_files: str,
        crds: bool = False,
        sets: dict[str, str] | None = None,
        release: str = "sie",
        namespace: str = "sie",
    ) -> subprocess.CompletedProcess:
        args = ["template", release, str(CHART), "--namespace", namespace]
        for f in values_files:
            args += ["-f", str(CHART / f)]
        if crds:
            for api in CRD_APIS:
                args += ["--api-versions", api]
        for k, v in (sets or {}).items():
            args += ["--set", f"{k}={v}"]
        return self.run(*args)


@pytest.fixture(scope="session")
def render(helm) -> Renderer:
    return Renderer(helm)
