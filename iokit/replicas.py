"""The config service's replicas as its clients (gateways, sidecars) see them: a comma-separated list of
base URLs (``SIE_CONFIG_SERVICE_URL``). Reads go to one replica and stay there; when it cannot be
reached they move on to the next, so a client keeps reading through the writer's failover. Any
replica answers reads (standbys serve them from the shared database)."""

from __future__ import annotations

import aiohttp


class ReplicaUrls:
    def __init__(self, urls: str) -> None:
        self.urls = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
        if not self.urls:
            raise ValueError("no config service URL given")
        self._current = 0

    @property
    def url(self) -> str:
        """The replica that reads go to now."""
        return self.urls[self._current]

    async def get(
        self, session: aiohttp.ClientSession, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """GET ``path`` from the current replica, or from the next ones in turn while a replica
        cannot be reached (refused, reset, timed out); (status, body). An HTTP answer, any status,
        ends the turn: it is the replica's to give. Raises the last failure when none answered."""
        failure: Exception | None = None
        for _ in self.urls:
            try:
                async with session.get(self.url + path, headers=headers) as resp:
                    return resp.status, await resp.text()
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                failure = exc
                self._current = (self._current + 1) % len(self.urls)
        assert failure is not None
        raise failure
