"""DLQ forwarding: JetStream max-delivery advisories → ``sie.dlq.{model_token}`` in DEAD_LETTERS.

Every gateway replica receives each advisory; ``Nats-Msg-Id = dlq-advisory:{id}`` lets the stream's
duplicate window keep one copy. When the dead item belongs to one of this gateway's pending
requests, that item is failed at once instead of waiting for the deadline. Once forwarded, the
dead message is deleted from its work stream, so that it no longer counts as queued work (the
QUEUE_FULL admission counts the stream's messages). Undecodable messages never get here: the
sidecar writes them to the DLQ and terminates them at once.
"""

from __future__ import annotations

import json
import logging
from typing import Protocol

import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from gateway.jobs import dead_items
from gateway.metrics import GatewayMetrics
from protocol.errors import ErrorCode
from protocol.subjects import MAX_DELIVERIES_ADVISORY, dlq_subject, work_model_token

log = logging.getLogger(__name__)


class ItemFailer(Protocol):
    def fail_item(self, request_id: str, item_index: int, code: str, message: str) -> bool: ...


class DLQForwarder:
    def __init__(self, nc: NATS, router_id: str, inbox: ItemFailer, metrics: GatewayMetrics) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.router_id = router_id
        self.inbox = inbox  # fails this gateway's own dead items at once
        self.metrics = metrics
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(MAX_DELIVERIES_ADVISORY, cb=self._on_advisory)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection already closed
                log.debug("DLQ unsubscribe failed", exc_info=True)
            self._sub = None

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            adv = json.loads(msg.data)
            stream = str(adv.get("stream", ""))
            consumer = str(adv.get("consumer", ""))
            seq = int(adv.get("stream_seq", 0))
        except (ValueError, TypeError, AttributeError):
            log.warning("ignoring malformed max-deliveries advisory")
            return
        self.metrics.dlq_events.labels(stream, consumer).inc()
        token = "unknown"
        try:
            stored = await self.js.get_msg(stream, seq)
            token = work_model_token(stored.subject or "")
            try:
                for request_id, item_index in dead_items(stored.data or b"", self.router_id):
                    self.inbox.fail_item(
                        request_id,
                        item_index,
                        ErrorCode.INFERENCE_ERROR,
                        f"work item dead-lettered after {adv.get('deliveries')} deliveries",
                    )
            except Exception:
                log.debug("dead-lettered message is not a work item", exc_info=True)
        except Exception as exc:
            log.info("could not read dead-lettered message %s/%s: %s", stream, seq, exc)
        msg_id = f"dlq-advisory:{adv.get('id') or f'{stream}:{consumer}:{seq}'}"
        try:
            await self.js.publish(dlq_subject(token), msg.data, headers={"Nats-Msg-Id": msg_id})
        except Exception as exc:
            self.metrics.dlq_failures.inc()
            log.warning("DLQ forward failed: %s", exc)
            return  # keep the message in the work stream: it is the only copy
        try:
            await self.js.delete_msg(stream, seq)
        except nats.js.errors.NotFoundError:
            pass  # another gateway replica deleted it first
        except Exception as exc:
            log.info("could not delete dead-lettered message %s/%s: %s", stream, seq, exc)
