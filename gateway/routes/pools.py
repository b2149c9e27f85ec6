"""The pool routes (``/v1/pools``): create, list, get, renew, delete."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.http_common import read_json_body
from gateway.parts import STORES_KEY
from gateway.pools import PoolStore
from protocol.errors import ErrorCode, SIEError


def _pools(request: web.Request) -> PoolStore:
    pools = request.app[STORES_KEY].pools
    if pools is None:
        raise SIEError(ErrorCode.QUEUE_UNAVAILABLE, "Pool store is not ready", retry_after=2)
    return pools


async def _json_body(request: web.Request) -> Any:
    return await read_json_body(request, "Pool body")


async def handle_pool_create(request: web.Request) -> web.Response:
    view = await _pools(request).create(await _json_body(request))
    return web.json_response(view, status=201)


async def handle_pool_list(request: web.Request) -> web.Response:
    return web.json_response({"pools": await _pools(request).list()})


async def handle_pool_get(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    view = await _pools(request).get(name)
    if view is None:
        raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{name.lower()}' not found")
    return web.json_response(view)


async def handle_pool_renew(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not await _pools(request).renew(name):
        raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{name.lower()}' not found")
    return web.json_response({"message": "Pool renewed"})


async def handle_pool_delete(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not await _pools(request).delete(name):
        raise SIEError(ErrorCode.NOT_FOUND, f"Pool '{name.lower()}' not found")
    return web.json_response({"message": "Pool deleted"})
