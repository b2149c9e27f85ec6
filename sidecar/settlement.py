"""Settling held deliveries: publish a result then ACK, NAK with a delay, ACK-drop, progress-ACK,
dead-letter (DLQ copy, then TERM).

:class:`Settlement` sees NATS through two small Protocols (:class:`Publisher` for core publishes,
:class:`JetStreamPublisher` for the DLQ copy) and knows nothing of pulling or scheduling; it owns the
release of a delivery from :class:`sidecar.deliveries.Held`. See :mod:`sidecar.lane` for the table of
which situation gets which settlement.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import nats.errors
from nats.aio.msg import Msg

from protocol import ipc, tracing
from protocol.clock import Clock
from protocol.errors import ErrorCode
from protocol.logs import bind
from protocol.subjects import (
    DLQ_REASON_HEADER,
    DLQ_STREAM_SEQ_HEADER,
    DLQ_SUBJECT_HEADER,
    dlq_subject,
    work_model_token,
)
from protocol.work import WorkResult
from protocol.work_codec import WorkCodec
from sidecar.deliveries import Delivery, Held, Lease, ModelScheduler

log = logging.getLogger("sie.sidecar")


class Publisher(Protocol):
    """Core NATS publishes (a connected ``nats.aio.client.Client``)."""

    @property
    def max_payload(self) -> int: ...

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None: ...


class PayloadWriter(Protocol):
    """:class:`iokit.payloads.PayloadStore`, as settlement uses it."""

    async def put(self, name: str, data: bytes) -> None: ...


class JetStreamPublisher(Protocol):
    """JetStream publishes (``nats.js.JetStreamContext``): the DLQ copy of a dead message."""

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> object: ...


class Settlement:
    def __init__(
        self,
        nc: Publisher,
        js: JetStreamPublisher,
        *,
        payloads: PayloadWriter | None = None,
        worker_id: str,
        nak_delay_s: float,
        oom_nak_delay_s: float,
        held: Held,
        stats: dict[str, int],
        clock: Clock,
    ) -> None:
        self.nc = nc
        self.js = js
        self.payloads = payloads  # results over the max payload go there (iokit.payloads)
        self.worker_id = worker_id
        self.nak_delay_s = nak_delay_s
        self.oom_nak_delay_s = oom_nak_delay_s
        self.held = held
        self.stats = stats
        self.clock = clock

    # ------------------------------------------------------------------ outcomes of RunBatch
    async def settle(self, sched: ModelScheduler, d: Delivery, outcome: ipc.ItemOutcome) -> None:
        """Settle ``d`` as the worker's ``outcome`` for it says (one at a time: see
        :meth:`goes_with_others` and :meth:`publish_together` for results that share a message)."""
        disposition = outcome.disposition
        if disposition in (ipc.PUBLISH_AND_ACK, ipc.PUBLISH_ERROR_AND_ACK):
            if outcome.result is None:
                log.warning("outcome of %s carries no result", d.route.work_item_id)
                await self.nak(d, self.nak_delay_s)
                return
            # the worker's bytes, as they are
            await self.publish_and_ack(d, outcome.result, success=disposition == ipc.PUBLISH_AND_ACK)
            return
        if disposition == ipc.DEAD_LETTER:
            # the worker could not decode the body: no retry can fix it. The routing header still
            # names the item and its inbox, so the request is answered now rather than at its deadline.
            reason = outcome.error or "undecodable work item"
            await self.publish_result(d, self.error_result(d, ErrorCode.INTERNAL_ERROR, reason))
            # published or not, the DLQ copy is what must happen (once the message's other items are settled)
            d.lease.dead_reason = reason
            await self._close(d)
            return
        code = outcome.error_code
        if code == ErrorCode.RESOURCE_EXHAUSTED:
            delay = self.oom_nak_delay_s
        else:
            delay_ms = outcome.nak_delay_ms
            delay = delay_ms / 1000.0 if delay_ms is not None and delay_ms >= 0 else self.nak_delay_s
        if code in (ErrorCode.MODEL_NOT_LOADED, ErrorCode.MODEL_LOADING, ErrorCode.LORA_LOADING):
            sched.ready = False  # re-ensure before the next batch
        await self.nak(d, delay)

    @staticmethod
    def goes_with_others(d: Delivery, outcome: ipc.ItemOutcome) -> bool:
        """A result the worker encoded, for a gateway that takes several in one message."""
        return (
            d.route.results_subject is not None
            and outcome.disposition in (ipc.PUBLISH_AND_ACK, ipc.PUBLISH_ERROR_AND_ACK)
            and outcome.result is not None
        )

    async def publish_together(self, results: list[tuple[Delivery, bytes, bool]]) -> None:
        """Publish the results of a batch's deliveries (:meth:`goes_with_others`) to their gateways'
        results subjects, in as few messages as the max payload allows, then ACK each. One alone in
        its message goes to its reply subject, as any other. A failed publish leaves its items
        un-acked: JetStream redelivers them after ack_wait."""
        by_subject: dict[str, list[tuple[Delivery, bytes, bool]]] = {}
        for entry in results:
            subject = entry[0].route.results_subject
            if subject is not None and not entry[0].settled:
                by_subject.setdefault(subject, []).append(entry)
        limit = max(1, (self.nc.max_payload or 1 << 20) - 1024)
        for subject, entries in by_subject.items():
            for chunk in WorkCodec.results_chunks([len(data) for _, data, _ in entries], limit):
                if len(chunk) == 1:
                    d, data, success = entries[chunk[0]]
                    await self.publish_and_ack(d, data, success=success)
                    continue
                part = [entries[i] for i in chunk]
                # one span per message: a child of its first item's request, linked to the others'
                with tracing.span(
                    "sidecar.result_publish",
                    parent=part[0][0].route.traceparent,
                    links=[
                        d.route.traceparent for d, _, _ in part[1:] if isinstance(d.route.traceparent, str)
                    ]
                    if tracing.enabled()
                    else (),
                    attributes={"items": len(part)},
                ):
                    try:
                        await self.nc.publish(
                            subject, WorkCodec.results_message([data for _, data, _ in part])
                        )
                    except Exception as exc:  # noqa: BLE001 - redelivered; nothing else to do
                        log.warning("publishing %d results to %s failed: %s", len(part), subject, exc)
                        for d, _, _ in part:
                            self.held.release(d)
                        continue
                self.stats["published"] += len(part)
                for d, _, _ in part:
                    await self.ack(d)

    # ------------------------------------------------------------------ settling a held delivery
    def error_result(self, d: Delivery, code: str, message: str) -> WorkResult:
        return WorkResult.failure(d.route, code, message, worker_id=self.worker_id)

    async def publish_and_ack(
        self, d: Delivery, result: WorkResult | bytes, *, success: bool = False
    ) -> None:
        """Publish the result (a WorkResult, or one the worker encoded, whose ``success`` the caller
        gives) to the reply inbox, then ACK; a failed publish leaves the message un-acked."""
        if d.settled:
            return
        ok = result.success if isinstance(result, WorkResult) else success
        with (
            bind(request_id=d.route.request_id),
            tracing.span("sidecar.result_publish", parent=d.route.traceparent, attributes={"success": ok}),
        ):
            if not await self.publish_result(d, result):
                self.held.release(d)  # no ACK: JetStream redelivers after ack_wait
                return
            await self.ack(d)

    async def publish_result(self, d: Delivery, result: WorkResult | bytes) -> bool:
        """Publish ``result`` to the item's reply inbox (a compact error in its place when it is
        over the NATS max payload); False, logged, when the publish failed."""
        try:
            data = result if isinstance(result, bytes) else result.to_msgpack()
            try:
                await self.nc.publish(d.route.reply_subject, WorkCodec.results_message([data]))
            except nats.errors.MaxPayloadError:
                ref = (await self._by_reference(d, data)).to_msgpack()
                await self.nc.publish(d.route.reply_subject, WorkCodec.results_message([ref]))
        except Exception as exc:  # noqa: BLE001 - the caller decides what a failed publish means
            log.warning("publishing result of %s failed: %s", d.route.work_item_id, exc)
            return False
        self.stats["published"] += 1
        return True

    async def _by_reference(self, d: Delivery, data: bytes) -> WorkResult:
        """What stands for a result too large for one message: a result naming the payload store's
        object that holds it, or an error result where there is no store or it refused the bytes."""
        name = f"result.{d.route.work_item_id}"
        if self.payloads is not None:
            try:
                await self.payloads.put(name, data)
            except Exception as exc:  # noqa: BLE001 - the item fails; others go on
                log.warning("result of %s not put in the payload store: %s", d.route.work_item_id, exc)
            else:
                ref = WorkResult(d.route.work_item_id, d.route.request_id, d.route.item_index, True)
                ref.result_ref, ref.worker_id = name, self.worker_id
                return ref
        return self.error_result(d, ErrorCode.INTERNAL_ERROR, "result larger than the NATS max payload")

    async def ack(self, d: Delivery, *, drop: bool = False) -> None:
        if d.settled:
            return
        await self._close(d, drop=drop)

    async def nak(self, d: Delivery, delay_s: float) -> None:
        if d.settled:
            return
        lease = d.lease
        lease.nak_delay_s = delay_s if lease.nak_delay_s is None else max(lease.nak_delay_s, delay_s)
        await self._close(d)

    async def _close(self, d: Delivery, *, drop: bool = False) -> None:
        """``d`` is settled; its message too when it was the message's last item not settled: NAKed
        when any of its items was (a chunk is redelivered whole; a result the gateway has already
        comes again for the same slot), dead-lettered when one could not be decoded, else ACKed."""
        self.held.release(d)
        lease = d.lease
        if not lease.close():
            return
        if lease.nak_delay_s is not None:
            await self.nak_msg(lease.msg, lease.nak_delay_s)
        elif lease.dead_reason is not None:
            await self.dead_letter(lease.msg, lease.dead_reason)
        else:
            await self.ack_msg(lease.msg, drop=drop)

    async def progress(self, lease: Lease) -> None:
        """Progress-ACK: JetStream restarts the message's ack_wait (the lease stays with this pod)."""
        if lease.open <= 0:
            return
        lease.last_progress = self.clock.now()
        if not lease.msg.reply:  # the direct path: no lease on the stream to keep
            return
        try:
            await lease.msg.in_progress()
            self.stats["progress"] += 1
        except Exception as exc:  # noqa: BLE001
            log.debug("progress ack failed: %s", exc)

    # ------------------------------------------------------------------ settling a message not held
    # A message without a reply subject came on the direct path (Intake.delivered_direct): nothing
    # to settle on the stream; the gateway sends again what it does not get a result for.
    async def ack_msg(self, msg: Msg, *, drop: bool = False) -> None:
        self.stats["dropped" if drop else "acked"] += 1
        if not msg.reply:
            return
        try:
            await msg.ack()
        except Exception as exc:  # noqa: BLE001 - redelivered later; nothing else to do
            log.warning("ack failed: %s", exc)

    async def nak_msg(self, msg: Msg, delay_s: float) -> None:
        self.stats["naked"] += 1
        if not msg.reply:
            return
        try:
            await msg.nak(delay=delay_s if delay_s > 0 else None)
        except Exception as exc:  # noqa: BLE001
            log.warning("nak failed: %s", exc)

    async def dead_letter(self, msg: Msg, reason: str) -> None:
        """A message no retry can fix (undecodable): write it to the DLQ with ``reason``, then
        terminate it, which also removes it from the work stream, instead of NAKing it until
        max_deliver runs out."""
        self.stats["dead_lettered"] += 1
        reason = " ".join(reason.encode("ascii", "backslashreplace").decode().split())[:400] or "dead"
        try:
            meta = msg.metadata
            stream, seq = meta.stream, meta.sequence.stream
        except Exception:  # noqa: BLE001 - not a JetStream delivery: nothing to terminate
            stream, seq = "", None
        headers = {DLQ_REASON_HEADER: reason, DLQ_SUBJECT_HEADER: msg.subject}
        if seq is not None:
            headers[DLQ_STREAM_SEQ_HEADER] = str(seq)
            headers["Nats-Msg-Id"] = f"dlq-term:{stream}:{seq}"
        try:
            await self.js.publish(
                dlq_subject(work_model_token(msg.subject)), msg.data, headers=headers, timeout=2
            )
        except Exception as exc:  # noqa: BLE001 - still terminate: a poison message must not circulate
            log.warning("DLQ publish of a dead work message failed: %s", exc)
        if not msg.reply:
            return
        try:
            await self.nc.publish(msg.reply, b"+TERM " + reason.encode())
        except Exception as exc:  # noqa: BLE001
            log.warning("term failed: %s", exc)
