"""The OpenMP settings ``sie up`` gives its worker processes (worker.POD_OMP_SPINCOUNT, POD_OMP_PROC_BIND)."""

from __future__ import annotations

import glob

import pytest

from deploy.launcher import Cluster, worker_runs_on_cpu
from worker import POD_OMP_PROC_BIND, POD_OMP_SPINCOUNT


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for name in (
        "GOMP_SPINCOUNT",
        "OMP_PROC_BIND",
        "SIE_DEVICE",
        "SIE_FORWARD_THREADS",
        "SIE_FORWARD_LANES",
        "SIE_TORCH_THREADS",
    ):
        monkeypatch.delenv(name, raising=False)


def test_one_cpu_worker_is_bound_and_spins_briefly(tmp_path, monkeypatch):
    monkeypatch.setenv("SIE_DEVICE", "cpu")
    monkeypatch.setenv("SIE_TORCH_THREADS", "2")
    env = Cluster(state_dir=tmp_path).worker_omp_env()
    assert env == {"GOMP_SPINCOUNT": POD_OMP_SPINCOUNT, "OMP_PROC_BIND": POD_OMP_PROC_BIND}


def test_no_binding_for_several_workers_or_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SIE_DEVICE", "cpu")
    assert "OMP_PROC_BIND" not in Cluster(state_dir=tmp_path, workers=2).worker_omp_env()
    # forward threads are threads of one worker: they would share a core (the former name counts too)
    for name in ("SIE_FORWARD_THREADS", "SIE_FORWARD_LANES"):
        monkeypatch.setenv(name, "2")
        assert "OMP_PROC_BIND" not in Cluster(state_dir=tmp_path).worker_omp_env()
        monkeypatch.setenv(name, "1")
        assert Cluster(state_dir=tmp_path).worker_omp_env()["OMP_PROC_BIND"] == POD_OMP_PROC_BIND
        monkeypatch.delenv(name)
    monkeypatch.setenv("SIE_TORCH_THREADS", "1")  # one intra-op thread: bound, the whole worker gets one core
    assert "OMP_PROC_BIND" not in Cluster(state_dir=tmp_path).worker_omp_env()
    monkeypatch.setenv("SIE_DEVICE", "cuda")
    assert Cluster(state_dir=tmp_path).worker_omp_env() == {"GOMP_SPINCOUNT": POD_OMP_SPINCOUNT}


def test_the_operators_values_win(tmp_path, monkeypatch):
    monkeypatch.setenv("SIE_DEVICE", "cpu")
    monkeypatch.setenv("OMP_PROC_BIND", "false")
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert Cluster(state_dir=tmp_path).worker_omp_env() == {
        "GOMP_SPINCOUNT": "300000",
        "OMP_PROC_BIND": "false",
    }
    monkeypatch.setenv(
        "SIE_DEVICE", "cuda"
    )  # set explicitly, it is passed on even where it would not be chosen
    assert Cluster(state_dir=tmp_path, workers=3).worker_omp_env()["OMP_PROC_BIND"] == "false"


def test_auto_device_means_cpu_only_without_an_nvidia_device_node():
    expected = not glob.glob("/dev/nvidia[0-9]*")
    assert worker_runs_on_cpu({}) is expected
    assert worker_runs_on_cpu({"SIE_DEVICE": "auto"}) is expected
    assert worker_runs_on_cpu({"SIE_DEVICE": "CPU"}) is True
    assert worker_runs_on_cpu({"SIE_DEVICE": "cuda:1"}) is False


def test_sie_up_runs_as_many_worker_pods_on_a_gpu_host_as_sie_serve_runs_processes():
    """``sie up`` without ``--workers``: one pod on a CPU host; on a GPU host as many as ``sie serve``
    runs processes there (one Python process cannot keep the GPU fed), so both front doors match."""
    from deploy.cli import build_parser
    from deploy.launcher import default_workers
    from worker import CUDA_PROCESSES

    assert CUDA_PROCESSES > 1
    assert default_workers({"SIE_DEVICE": "cpu"}) == 1
    assert default_workers({"SIE_DEVICE": "cuda"}) == CUDA_PROCESSES
    assert default_workers({}) == (1 if worker_runs_on_cpu({}) else CUDA_PROCESSES)
    assert build_parser().parse_args(["up"]).workers is None  # resolved by default_workers at start
    assert build_parser().parse_args(["up", "--workers", "2"]).workers == 2


def test_sie_up_runs_two_gateways_on_a_gpu_host():
    """``sie up`` without ``--gateways``: one on a CPU host, where a second would take CPU from the
    forward; two on a GPU host, where one gateway's CPU per request limits short requests."""
    from deploy.cli import build_parser
    from deploy.launcher import GPU_HOST_GATEWAYS, default_gateways

    assert GPU_HOST_GATEWAYS > 1
    assert default_gateways({"SIE_DEVICE": "cpu"}) == 1
    assert default_gateways({"SIE_DEVICE": "cuda"}) == GPU_HOST_GATEWAYS
    assert default_gateways({}) == (1 if worker_runs_on_cpu({}) else GPU_HOST_GATEWAYS)
    assert build_parser().parse_args(["up"]).gateways is None  # resolved by default_gateways at start
    assert build_parser().parse_args(["up", "--gateways", "3"]).gateways == 3
