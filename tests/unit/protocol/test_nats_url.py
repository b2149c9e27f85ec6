"""SIE_NATS_URL as a list of a JetStream cluster's members (issue 35)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from config_service.settings import ConfigServiceSettings
from gateway.settings import GatewaySettings
from protocol.nats_url import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, failover_options, nats_servers
from sidecar.settings import SidecarSettings


def test_one_server_and_a_cluster_list():
    assert nats_servers("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert nats_servers(" nats://a:4222, nats://b:4222,,tls://c:4222 ") == [
        "nats://a:4222",
        "nats://b:4222",
        "tls://c:4222",
    ]


def test_each_client_takes_the_members_in_an_order_of_its_own_and_keeps_it():
    url = "nats://a:4222,nats://b:4222,nats://c:4222"
    options = [failover_options(url) for _ in range(60)]
    assert all(sorted(o["servers"]) == nats_servers(url) for o in options)
    # nats-py then rotates them, the member connected to last at the end, instead of reshuffling
    assert all(o["dont_randomize"] is True for o in options)
    assert {o["servers"][0] for o in options} == {"nats://a:4222", "nats://b:4222", "nats://c:4222"}
    assert options[0]["ping_interval"] == PING_INTERVAL_S
    assert options[0]["max_outstanding_pings"] == MAX_OUTSTANDING_PINGS


@pytest.mark.parametrize("bad", ["", " , ", "http://a:4222", "a:4222", "nats://a:4222,localhost:4222"])
def test_a_list_without_servers_or_with_a_non_nats_member_is_refused(bad):
    with pytest.raises(ValueError, match="SIE_NATS_URL"):
        nats_servers(bad)


@pytest.mark.parametrize("settings", [GatewaySettings, SidecarSettings])
def test_the_clients_settings_check_the_list(settings, monkeypatch):
    monkeypatch.setenv("SIE_NATS_URL", "nats://a:1, nats://b:2")
    assert settings().nats_url == "nats://a:1,nats://b:2"
    monkeypatch.setenv("SIE_NATS_URL", "http://a:1")
    with pytest.raises(ValidationError, match="is not a NATS URL"):
        settings()


def test_the_config_service_may_run_without_nats_but_not_with_a_bad_list(monkeypatch):
    monkeypatch.setenv("SIE_NATS_URL", "")
    assert not ConfigServiceSettings().nats_url
    monkeypatch.setenv("SIE_NATS_URL", "nats://a:1,nats://b:2")
    assert ConfigServiceSettings().nats_url == "nats://a:1,nats://b:2"
    monkeypatch.setenv("SIE_NATS_URL", "nats://a:1,b:2")
    with pytest.raises(ValidationError, match="is not a NATS URL"):
        ConfigServiceSettings()


def test_redacted_hides_every_members_password():
    from protocol.nats_url import redacted

    url = "nats://gateway:s3cr:et@127.0.0.1:4250,tls://sidecar:pw@h2:4222,nats://h3:4222"
    shown = redacted(url)
    assert "s3cr" not in shown and ":pw@" not in shown
    assert shown == "nats://gateway:***@127.0.0.1:4250,tls://sidecar:***@h2:4222,nats://h3:4222"
