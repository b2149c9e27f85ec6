"""The sans-I/O core of both clients: what a call sends, and what it makes of each answer.

Every public call is written once, in :mod:`sdk._calls`, as a generator over a :class:`Session`:
it yields a :class:`Request` (and gets back a :class:`Response` or a :class:`Failure`), a
:class:`Sleep` (and gets back ``None``) or a :class:`Renewal` (start or stop renewing a pool's
lease), and returns the call's result or raises its exception. A client is the loop that performs
those steps with its HTTP library, its sleep and its renewers; nothing in here touches a socket.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from sdk import _wire as W
from sdk._retry import Transport
from sdk.types import Options

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request, complete: the client sends it as it is."""

    method: str
    url: str
    headers: dict[str, str]
    body: bytes | None
    read_timeout: float
    connect_timeout: float  # never longer than the read timeout of the attempt


@dataclass(frozen=True, slots=True)
class Response:
    """One HTTP answer, read to its end (``headers`` looks names up case-insensitively)."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True, slots=True)
class Failure:
    """A request that got no HTTP answer: how it failed (which decides a retry), and why."""

    kind: Transport
    error: BaseException


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Renewal:
    """Start (``keep``) or stop renewing the lease of ``pool`` in the background."""

    pool: str
    keep: bool


Step = Request | Sleep | Renewal
Reply = Response | Failure
Call = Generator[Step, Reply | None, T]


def method_signature(call: Callable[..., object]) -> inspect.Signature:
    """The signature of the client method that runs ``call``: ``self`` where the call takes the
    session, and the call's result (``X`` of ``Call[X]``) as what it returns."""
    signature = inspect.signature(call)
    session, *parameters = signature.parameters.values()
    result = signature.return_annotation
    if isinstance(result, str) and result.startswith("Call[") and result.endswith("]"):
        result = result[len("Call[") : -1]
    return signature.replace(
        parameters=[session.replace(name="self", annotation=inspect.Parameter.empty), *parameters],
        return_annotation=result,
    )


@dataclass
class Session:
    """A client's settings, and what it has learnt from the answers it got."""

    base_url: str
    headers: dict[str, str]  # sent with every request
    admin_headers: dict[str, str]  # on top of those for pool writes
    connect_timeout: float
    read_timeout: float
    gpu: str | None
    priority: str | None
    options: dict[str, object]
    clock: Callable[[], float] = time.monotonic
    server_seen: bool = False  # an HTTP answer came: a refused connection is then a restart
    last_retry_count: int = 0
    last_model_revision: str | None = None
    warned_skew: bool = field(default=False, repr=False)

    @classmethod
    def configure(
        cls,
        base_url: str | None,
        *,
        timeout_s: float | None,
        api_key: str | None,
        admin_key: str | None,
        gpu: str | None,
        priority: str | None,
        options: Options | None,
        base_url_headers: Mapping[str, str] | None,
        connect_timeout_s: float | None,
        read_timeout_s: float | None,
        remote: str | None,
    ) -> Session:
        """The settings of a client's constructor, checked and resolved (environment included)."""
        url = W.resolve_base_url(base_url)
        connect, read = W.resolve_timeouts(timeout_s, connect_timeout_s, read_timeout_s)
        return cls(
            base_url=url,
            headers={
                **W.default_headers(W.resolve_api_key(api_key, url), remote),
                **(base_url_headers or {}),
            },
            admin_headers=W.admin_headers(admin_key),  # pool writes: the gateway's admin token
            connect_timeout=connect,
            read_timeout=read,
            gpu=gpu,
            priority=W.check_priority(priority),
            options=dict(options or {}),
        )

    def request(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None = None,
        read_timeout: float | None = None,
    ) -> Request:
        read = read_timeout or self.read_timeout
        return Request(
            method,
            self.base_url + path,
            {**self.headers, **headers},
            body,
            read,
            min(self.connect_timeout, read),
        )

    def observe(self, response: Response) -> None:
        """Note what every answer says about the server: it is up, its model revision, its version."""
        self.server_seen = True
        revision = response.headers.get("X-SIE-Model-Revision")
        if revision:
            self.last_model_revision = revision
        if not self.warned_skew:
            warning = W.version_skew(response.headers.get("X-SIE-Server-Version"))
            if warning:
                self.warned_skew = True
                W.log.warning(warning)


class SessionFacts:
    """What both clients tell about their session, read-only."""

    _session: Session

    @property
    def base_url(self) -> str:
        return self._session.base_url

    @property
    def last_retry_count(self) -> int:
        """How many retries the most recent inference call of this client made."""
        return self._session.last_retry_count

    @property
    def last_model_revision(self) -> str | None:
        """``X-SIE-Model-Revision`` of the latest answer that carried one."""
        return self._session.last_model_revision
