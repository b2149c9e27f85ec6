from __future__ import annotations

import pytest

from tests.support.nats_server import NatsServer


@pytest.fixture
def nats_server():
    """A fresh nats-server with JetStream for one test; can be stopped and restarted."""
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.close()
