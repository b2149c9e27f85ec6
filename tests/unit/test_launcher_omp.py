"""The OpenMP settings ``sie up`` gives its worker processes (worker.POD_OMP_SPINCOUNT, POD_OMP_PROC_BIND)."""

from __future__ import annotations

import glob
import os

import pytest

from deploy.launcher import Cluster, split_cpus, worker_runs_on_cpu
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


def test_sie_up_deploys_as_the_chart_one_pod_per_gpu_of_several_model_processes(tmp_path, monkeypatch):
    """``sie up`` without ``--workers`` / ``--model-processes``: one pod of one process on a CPU host;
    on a GPU host one pod per GPU (each with the next GPU), CUDA_PROCESSES model processes in each
    (one Python process cannot keep a GPU fed), as the chart deploys them."""
    from deploy import launcher
    from deploy.cli import build_parser
    from worker import CUDA_PROCESSES

    assert CUDA_PROCESSES > 1
    assert launcher.default_workers({"SIE_DEVICE": "cpu"}) == 1
    assert launcher.default_model_processes({"SIE_DEVICE": "cpu"}) == 1
    assert launcher.default_model_processes({"SIE_DEVICE": "cuda"}) == CUDA_PROCESSES
    assert launcher.default_model_processes({"SIE_DEVICE": "cuda", "SIE_MODEL_PROCESSES": "2"}) == 2
    monkeypatch.setattr(launcher, "gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("SIE_DEVICE", "cuda")
    assert launcher.default_workers({"SIE_DEVICE": "cuda"}) == 2
    cluster = launcher.Cluster(state_dir=tmp_path, workers=3, model_processes=4, metrics_port=9100)
    pods = cluster.pods
    assert [p.device for p in pods] == ["0", "1", "0"]
    assert [p.metrics_ports for p in pods] == [
        [9100, 9101, 9102, 9103],
        [9104, 9105, 9106, 9107],
        [9108, 9109, 9110, 9111],
    ]
    assert [s.name for s in pods[1].sockets] == [
        "ipc-2.sock",
        "ipc-2.p1.sock",
        "ipc-2.p2.sock",
        "ipc-2.p3.sock",
    ]
    assert pods[0].env["SIE_MODEL_PROCESSES"] == "4"
    monkeypatch.setattr(launcher, "gpu_count", lambda: 0)  # the device nodes are not visible
    assert launcher.default_workers({"SIE_DEVICE": "cuda"}) == 1
    assert build_parser().parse_args(["up"]).workers is None  # resolved by default_workers at start
    assert build_parser().parse_args(["up"]).model_processes is None
    assert build_parser().parse_args(["up", "--workers", "2", "--model-processes", "3"]).model_processes == 3


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


def test_worker_cpus_go_to_the_workers_from_the_top_and_leave_the_rest_one(tmp_path):
    assert split_cpus({0, 1}, 1) == (frozenset({1}), frozenset({0}))
    assert split_cpus({0, 2, 5, 7}, 3) == (frozenset({2, 5, 7}), frozenset({0}))
    for bad in (0, 2, 3, -1):
        with pytest.raises(ValueError, match="give the workers 1 to 1"):
            split_cpus({0, 1}, bad)
    assert Cluster(state_dir=tmp_path).cpu_split() is None


def test_worker_cpus_set_the_workers_threads_unless_the_operator_did(tmp_path, monkeypatch):
    monkeypatch.setenv("SIE_DEVICE", "cpu")
    env = Cluster(state_dir=tmp_path, worker_cpus=4, workers=2).worker_omp_env()
    assert env["SIE_TORCH_THREADS"] == "2" and "OMP_PROC_BIND" not in env  # two pods: not bound
    two = Cluster(state_dir=tmp_path, worker_cpus=2).worker_omp_env()  # one pod: bound, within its CPUs
    assert two["SIE_TORCH_THREADS"] == "2" and two["OMP_PROC_BIND"] == POD_OMP_PROC_BIND
    assert Cluster(state_dir=tmp_path, worker_cpus=1).worker_omp_env() == {
        "GOMP_SPINCOUNT": POD_OMP_SPINCOUNT,
        "SIE_TORCH_THREADS": "1",
    }
    monkeypatch.setenv("SIE_TORCH_THREADS", "3")
    assert "SIE_TORCH_THREADS" not in Cluster(state_dir=tmp_path, worker_cpus=1).worker_omp_env()


def test_sie_up_refuses_worker_cpus_the_host_cannot_give(tmp_path, capsys):
    from deploy.launcher import up

    n = len(os.sched_getaffinity(0))
    assert up(str(tmp_path / "state"), 1, 2, 3, None, worker_cpus=n) == 2
    assert f"--worker-cpus {n}: sie up may run on {n} CPUs here" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # refused before anything started


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_sie_up_starts_the_workers_on_their_cpus_and_the_rest_on_the_others(tmp_path):
    import sys

    cluster = Cluster(state_dir=tmp_path, worker_cpus=1)
    workers, others = cluster.cpu_split() or (None, None)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        worker = cluster._spawn("worker", sleeper, worker=True)
        gateway = cluster._spawn("gateway", sleeper)
        assert os.sched_getaffinity(worker.pid) == workers == {max(os.sched_getaffinity(0))}
        assert os.sched_getaffinity(gateway.pid) == others and not workers & others
    finally:
        cluster.supervisor.stop_all(timeout_s=5)
