#!/usr/bin/env python3
"""Kubernetes exec probe for the worker container: an IPC ``Ping`` over the shared socket.

Installed in the worker images as ``/usr/local/bin/sie-probe``.

    sie-probe [--socket PATH] [--require-ready] [--timeout S]

Exit 0 when the worker answers Ping (and, with ``--require-ready``, reports ``ready``);
exit 1 otherwise, with the reason on stderr. It is the same call the sidecar makes every
2 s, so "live" means the IPC server answers and "ready" means the runtime says it is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid

from iokit.frames import read_frame_bytes
from protocol.ipc import PING, PingResponse, decode_payload, encode_frame, request_envelope

DEFAULT_SOCKET = "/var/run/sie/ipc.sock"


async def ping(socket_path: str, timeout_s: float) -> PingResponse:
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(socket_path), timeout_s)
    try:
        request_id = uuid.uuid4().hex
        writer.write(encode_frame(request_envelope(PING, request_id, {})))
        await writer.drain()
        while True:
            raw = await asyncio.wait_for(read_frame_bytes(reader), timeout_s)
            if raw is None:
                raise ConnectionError("worker closed the connection")
            reply = decode_payload(raw)
            if reply.get("request_id") != request_id:
                continue
            if not reply.get("ok"):
                raise RuntimeError(f"Ping failed: {reply.get('error')}")
            return PingResponse.from_map(reply.get("body"))
    finally:
        writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sie-probe")
    parser.add_argument("--socket", default=os.environ.get("SIE_IPC_SOCKET_PATH", DEFAULT_SOCKET))
    parser.add_argument("--require-ready", action="store_true")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        resp = asyncio.run(ping(args.socket, args.timeout))
    except Exception as exc:  # noqa: BLE001 - any failure is a failed probe
        print(f"sie-probe: {args.socket}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.require_ready and not resp.ready:
        print(
            f"sie-probe: worker {resp.worker_id} not ready (loading {resp.loading_models})", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
