"""Install the torch build that suits this host, before anything that depends on torch.

``make install`` (and so ``make up``, ``make dev``) runs ``python deploy/torch_install.py torch==2.13.0``
with the new venv's Python. pip's default index carries the CUDA build of torch for Linux (several
GB of CUDA libraries), which a host without an NVIDIA GPU cannot use. So:

- NVIDIA GPU here (a ``/dev/nvidia<N>`` device node, or ``nvidia-smi`` on PATH): the default
  index, that is the CUDA build;
- no NVIDIA GPU: the CPU build from the PyTorch CPU index, as the worker image installs it; if
  that index does not answer (a host without internet access, whose pip configuration serves a
  local CPU build), or the install from it fails, the default index with what pip is configured
  with, said out loud.

Standard library only: it runs before the project is installed.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
import sys
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 10.0


def nvidia_gpu_present() -> bool:
    """An NVIDIA GPU on this host: a device node (as ``sie up`` decides) or the driver's tool."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None


def cpu_index_answers(index: str = CPU_INDEX, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the PyTorch CPU index answers: one bounded request for its torch page."""
    try:
        with urllib.request.urlopen(f"{index}/torch/", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (OSError, ValueError):
        return False


def plan(spec: str, *, nvidia: bool, cpu_index: bool) -> list[list[str]]:
    """The ``pip install`` arguments to try in order; the first that succeeds installed torch."""
    if nvidia or not cpu_index:
        return [[spec]]
    return [["--index-url", CPU_INDEX, spec], [spec]]


def why(*, nvidia: bool, cpu_index: bool) -> str:
    if nvidia:
        return "an NVIDIA GPU is present: the CUDA build from the default index"
    if cpu_index:
        return f"no NVIDIA GPU: the CPU build from {CPU_INDEX}"
    return (
        f"no NVIDIA GPU, and {CPU_INDEX} does not answer: the default index as pip is configured "
        "(on Linux that is the CUDA build, several GB, unless your pip configuration serves a CPU build)"
    )


def main(argv: list[str]) -> int:
    spec = argv[0] if argv else "torch"
    nvidia = nvidia_gpu_present()
    cpu_index = not nvidia and cpu_index_answers()
    print(f"installing {spec}; {why(nvidia=nvidia, cpu_index=cpu_index)}", flush=True)
    attempts = plan(spec, nvidia=nvidia, cpu_index=cpu_index)
    for i, args in enumerate(attempts):
        if subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args]).returncode == 0:
            return 0
        if i + 1 < len(attempts):
            print(f"installing {spec} from {CPU_INDEX} failed; trying the default index", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
