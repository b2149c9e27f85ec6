"""The result inbox: the one ``_INBOX.{router_id}.>`` subscription of a gateway, where sidecars
send its results (one per message, or several in one) and say that they took a message sent on
the direct path. Decodes the results (protocol.work_codec), reads those too large to travel from the
payload store, and fills the slots of the requests waiting for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter

from gateway.pending import PendingRequests
from iokit.payloads import PayloadStore
from protocol.errors import ErrorCode
from protocol.jobs import ItemRef, work_item_id
from protocol.subjects import TAKEN_TOKEN, inbox_prefix, reply_subject, results_subject
from protocol.work import WorkResult
from protocol.work_codec import WorkCodec

log = logging.getLogger(__name__)


class ResultInbox:
    def __init__(
        self,
        nc: NATS,
        router_id: str,
        pending: PendingRequests,
        payloads: PayloadStore,
        *,
        skips: Counter,
    ) -> None:
        self.nc = nc
        self.router_id = router_id
        self.pending = pending
        self.payloads = payloads
        self._skips = skips  # results for no request waiting (late, duplicate)
        # where sidecars send several of this gateway's results in one message
        self.results_subject = results_subject(router_id)
        self._taken_prefix = f"{inbox_prefix(router_id)}.{TAKEN_TOKEN}."  # then request and slot
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(inbox_prefix(self.router_id) + ".>", cb=self._on_result)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    def reply_subject(self, request_id: str) -> str:
        """Where the results of ``request_id``'s items go one at a time."""
        return reply_subject(self.router_id, request_id)

    def fail_item(self, request_id: str, item_index: int, code: str, message: str) -> bool:
        """Complete one item of a pending request with an error (e.g. dead-lettered). False if unknown."""
        col = self.pending.get(request_id)
        if col is None:
            return False
        col.put(
            WorkResult.failure(
                ItemRef(work_item_id(request_id, item_index), request_id, item_index), code, message
            )
        )
        return True

    async def _on_result(self, msg: Msg) -> None:
        if msg.subject.startswith(self._taken_prefix):  # a sidecar took a message sent directly
            request_id, _, slot = msg.subject[len(self._taken_prefix) :].partition(".")
            col = self.pending.get(request_id)
            if col is not None and slot.isdigit():
                col.untaken.discard(int(slot))
            return
        if msg.subject != self.results_subject:
            request_id = msg.subject.rsplit(".", 1)[-1]
            if request_id not in self.pending:  # decided before decoding: late or duplicate
                self._skips.inc()
                return
        try:
            results = WorkCodec.results(msg.data)
        except ValueError as exc:
            log.warning("dropping a malformed result message on %s: %s", msg.subject, exc)
            return
        for result in results:
            if result.result_ref is None:
                self._deliver(result.request_id, result)
            else:
                await self._deliver_resolved(result.request_id, result)

    async def _deliver_resolved(self, request_id: str, result: WorkResult) -> None:
        """Deliver ``result``, read first from the payload store when it was too large to travel."""
        ref = result.result_ref
        if ref is not None:
            if request_id not in self.pending:
                self._skips.inc()
                return
            try:
                result = WorkResult.from_msgpack(await self.payloads.get(ref))
            except Exception as exc:  # noqa: BLE001 - gone, or the store unreachable: the item fails
                log.warning("result %s of %s not read from the payload store: %s", ref, request_id, exc)
                result = dataclasses.replace(
                    result,
                    success=False,
                    error_code=ErrorCode.INTERNAL_ERROR.value,
                    error=f"the result was too large for one message and could not be read back ({exc})",
                    result_ref=None,
                )
            else:
                with contextlib.suppress(Exception):
                    await self.payloads.delete(ref)
        self._deliver(request_id, result)

    def _deliver(self, request_id: str, result: WorkResult) -> None:
        col = self.pending.get(request_id)
        if col is None:
            self._skips.inc()
            return
        col.put(result)
