"""Which torch build ``make install`` asks pip for (issue 36, item 3): the CPU build where there is
no NVIDIA GPU, the CUDA build (the default index) where there is one."""

from __future__ import annotations

import http.server
import re
import socket
import subprocess
import threading
from pathlib import Path

from deploy import torch_install
from deploy.torch_install import CPU_INDEX, plan

REPO = Path(__file__).resolve().parents[2]
SPEC = "torch==2.13.0"


def test_without_a_gpu_the_cpu_index_first_then_the_default():
    assert plan(SPEC, nvidia=False, cpu_index=True) == [["--index-url", CPU_INDEX, SPEC], [SPEC]]


def test_with_a_gpu_the_default_index_that_carries_the_cuda_build():
    for cpu_index in (True, False):
        assert plan(SPEC, nvidia=True, cpu_index=cpu_index) == [[SPEC]]


def test_without_a_gpu_or_the_cpu_index_the_default_index_as_configured():
    # offline machines whose pip configuration serves a local CPU build (this one) take this path
    assert plan(SPEC, nvidia=False, cpu_index=False) == [[SPEC]]
    assert "CUDA build" in torch_install.why(nvidia=False, cpu_index=False)


def test_the_cpu_index_probe_asks_for_the_torch_page():
    pages: list[str] = []

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's API
            pages.append(self.path)
            self.send_response(200 if self.path == "/whl/cpu/torch/" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert torch_install.cpu_index_answers(f"{base}/whl/cpu", timeout_s=30) is True
        assert torch_install.cpu_index_answers(f"{base}/elsewhere", timeout_s=30) is False
    finally:
        server.shutdown()
        server.server_close()
    assert pages == ["/whl/cpu/torch/", "/elsewhere/torch/"]
    with socket.socket() as s:  # nothing listens: no answer, at once
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert torch_install.cpu_index_answers(closed, timeout_s=30) is False


def test_make_install_runs_it_before_anything_else():
    out = subprocess.run(
        ["make", "-n", "-B", "install"], cwd=REPO, capture_output=True, text=True, timeout=30, check=True
    )
    pip_lines = [ln for ln in out.stdout.splitlines() if "pip install" in ln or "torch_install" in ln]
    assert "deploy/torch_install.py torch==2.13.0" in pip_lines[1], pip_lines  # after pip's own upgrade
    assert not any("torch==" in ln for ln in pip_lines if "torch_install" not in ln)


def test_the_readme_says_which_build_make_up_installs():
    text = (REPO / "README.md").read_text()
    assert CPU_INDEX in text
    assert re.search(r"GPU host[^.]{0,120}CUDA build", text), "say what happens on a GPU host"
