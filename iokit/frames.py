"""Reading and writing the IPC's length-prefixed msgpack frames (protocol.ipc) on asyncio streams."""

from __future__ import annotations

import asyncio
from typing import Any

from protocol.ipc import FRAME_HEADER, MAX_FRAME_BYTES, FrameError, FrameTooLarge, encode_frame


async def read_frame_bytes(reader: asyncio.StreamReader, *, max_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """The raw body of the next frame; None on a clean EOF between frames.

    Raises FrameTooLarge when the length exceeds ``max_bytes`` (nothing of the body is read) and
    FrameError when the stream ends inside a frame.
    """
    try:
        header = await reader.readexactly(FRAME_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise FrameError("connection closed inside a frame header") from exc
    (length,) = FRAME_HEADER.unpack(header)
    if length > max_bytes:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the {max_bytes}-byte cap")
    if length == 0:
        return b""
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as exc:
        raise FrameError("connection closed inside a frame body") from exc


async def write_frame(
    writer: asyncio.StreamWriter, obj: dict[str, Any], *, max_bytes: int = MAX_FRAME_BYTES
) -> None:
    writer.write(encode_frame(obj, max_bytes=max_bytes))
    await writer.drain()
