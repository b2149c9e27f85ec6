"""Shared by the framework adapters: the model they call and the SDK clients they open for it
(:class:`Backend`), batching texts through ``encode`` into plain float lists, and ranking texts
through ``score``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from sdk.async_client import SIEAsyncClient
from sdk.client import SIEClient
from sdk.types import EncodeResult, Options, ScoreResult


def missing_extra(what: str, package: str, extra: str) -> ImportError:
    """The error of an adapter imported without its framework (the SDK's extra ``extra``)."""
    return ImportError(
        f"{what} need {package}: pip install {package} (in the checkout: .venv/bin/pip install -e '.[{extra}]')"
    )


class Settings(TypedDict, total=False):
    """What an adapter's calls go with, besides the model (see :class:`Backend`)."""

    base_url: str | None
    api_key: str | None
    gpu: str | None
    options: Options | None


class _Routed(TypedDict, total=False):
    options: Options
    gpu: str


class _Encoding(_Routed, total=False):
    output_types: list[str]
    is_query: bool
    instruction: str


@dataclass
class Backend:
    """A model on an sie-cluster gateway or ``sie serve``, the settings of the adapter's calls to
    it, and the SDK clients (opened on first use, unless given)."""

    model: str
    base_url: str | None = None
    api_key: str | None = None
    gpu: str | None = None
    options: Options | None = None
    instruction: str | None = None
    client_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more SIEClient settings
    client: SIEClient | None = None
    async_client: SIEAsyncClient | None = None

    def sync(self) -> SIEClient:
        if self.client is None:
            self.client = SIEClient(self.base_url, api_key=self.api_key, **self.client_kwargs)
        return self.client

    def async_(self) -> SIEAsyncClient:
        if self.async_client is None:
            self.async_client = SIEAsyncClient(self.base_url, api_key=self.api_key, **self.client_kwargs)
        return self.async_client

    def _routed(self) -> _Routed:
        kwargs: _Routed = {}
        if self.options:
            kwargs["options"] = dict(self.options)
        if self.gpu is not None:
            kwargs["gpu"] = self.gpu
        return kwargs

    def _encoding(self, is_query: bool) -> _Encoding:
        kwargs: _Encoding = {"output_types": ["dense"], "is_query": is_query, **self._routed()}
        if self.instruction is not None:
            kwargs["instruction"] = self.instruction
        return kwargs

    def embed(
        self, texts: Sequence[str], *, is_query: bool, batch_size: int | None = None
    ) -> list[list[float]]:
        """Dense vectors of ``texts`` (queries or documents), ``batch_size`` texts per ``encode``."""
        kwargs = self._encoding(is_query)
        out: list[list[float]] = []
        for batch in batches(texts, batch_size):
            out.extend(vectors(self.sync().encode(self.model, batch, **kwargs)))
        return out

    async def aembed(
        self, texts: Sequence[str], *, is_query: bool, batch_size: int | None = None
    ) -> list[list[float]]:
        kwargs = self._encoding(is_query)
        out: list[list[float]] = []
        for batch in batches(texts, batch_size):
            out.extend(vectors(await self.async_().encode(self.model, batch, **kwargs)))
        return out

    def rank(self, query: str, texts: Sequence[str], top_n: int | None) -> list[tuple[int, float]]:
        """(position in ``texts``, score) by descending score (ties in input order), at most ``top_n``."""
        return ranking(self.sync().score(self.model, {"text": query}, _ided(texts), **self._routed()), top_n)

    async def arank(self, query: str, texts: Sequence[str], top_n: int | None) -> list[tuple[int, float]]:
        result = await self.async_().score(self.model, {"text": query}, _ided(texts), **self._routed())
        return ranking(result, top_n)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    async def aclose(self) -> None:
        if self.async_client is not None:
            await self.async_client.close()


def batches(texts: Sequence[str], size: int | None) -> list[list[dict[str, str]]]:
    """``texts`` as items, in batches of ``size`` (all in one without a size)."""
    size = max(1, int(size or len(texts) or 1))
    return [[{"text": t} for t in texts[i : i + size]] for i in range(0, len(texts), size)]


def _ided(texts: Sequence[str]) -> list[dict[str, str]]:
    """Items with their positions as ids, so that scores map back to the inputs."""
    return [{"id": str(i), "text": t} for i, t in enumerate(texts)]


def vectors(results: list[EncodeResult]) -> list[list[float]]:
    return [[float(x) for x in r["dense"].astype("float32").tolist()] for r in results]


def ranking(result: ScoreResult, top_n: int | None) -> list[tuple[int, float]]:
    ranked = sorted(
        ((int(e["item_id"]), float(e["score"])) for e in result["scores"]), key=lambda p: (-p[1], p[0])
    )
    return ranked if top_n is None else ranked[: max(0, int(top_n))]
