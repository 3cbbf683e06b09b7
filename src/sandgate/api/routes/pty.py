"""PTY terminals over a WebSocket, and the short-lived tokens browsers use to open one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, WebSocket
from starlette.types import Message
from starlette.websockets import WebSocketDisconnect

from sandgate.api.deps import Services, presented_key, resolve_key, services, tenant, tenant_of
from sandgate.api.errors import domain_response, status_of
from sandgate.api.responses import JSON_BODY, SANDBOX, TENANT, error_docs
from sandgate.api.schemas import PtyToken, PtyTokenOut
from sandgate.control.toolbox import LIMIT_RETRY_FLOOR
from sandgate.core.tokens import TokenError, sign, verify
from sandgate.errors import AuthError, LimitExceededError, SandgateError
from sandgate.store.base import TenantId

log = logging.getLogger(__name__)
T = TypeVar("T")

router = APIRouter(prefix="/api/v1/sandboxes/{name}/toolbox", tags=["pty"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]

PTY_PURPOSE = "pty"
READ_WAIT = 15.0
LIMIT_PATIENCE = 60.0  # seconds a terminal waits out its sandbox's pids limit, then ends


@router.post(
    "/pty-token",
    status_code=201,
    response_model=PtyTokenOut,
    responses=error_docs(TENANT, JSON_BODY, SANDBOX),
)
async def pty_token(name: str, who: Tenant, svc: Svc, body: PtyToken | None = None) -> Any:
    await svc.sandboxes.running(who, name)
    ttl = body.ttl if body is not None else 60.0
    expires = time.time() + ttl
    claims = {"purpose": PTY_PURPOSE, "tenant": who, "sandbox": name, "exp": expires}
    return {
        "token": sign(svc.settings.secret, claims),
        "expires_at": datetime.fromtimestamp(expires, UTC),
    }


async def _tenant_for(ws: WebSocket, svc: Services, name: str) -> TenantId:
    token = ws.query_params.get("token")
    if token:
        try:
            claims = verify(svc.settings.secret, token, now=time.time(), purpose=PTY_PURPOSE)
        except TokenError as exc:
            raise AuthError(str(exc)) from None
        if claims.get("sandbox") != name:
            raise AuthError("this token is for another sandbox")
        return TenantId(str(claims["tenant"]))
    return tenant_of(await resolve_key(svc, presented_key(ws.headers)))


def _size(ws: WebSocket, key: str, default: int) -> int:
    raw = ws.query_params.get(key)
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise SandgateError(f"{key} must be a number from 1 to 1000", code="invalid_request")
    return int(raw)


@router.websocket("/pty")
async def pty(ws: WebSocket, name: str) -> None:
    svc: Services = ws.app.state.services
    try:
        who = await _tenant_for(ws, svc, name)
        cols, rows = _size(ws, "cols", 80), _size(ws, "rows", 24)
        command = ws.query_params.get("command")
        pid = await svc.toolbox.open_terminal(who, name, cols=cols, rows=rows, command=command)
    except SandgateError as exc:
        status = status_of(exc) if status_of(exc) != 500 else 400
        await ws.send_denial_response(domain_response(exc, status))
        return
    await ws.accept()
    log.info("pty.opened", extra={"sandbox": name, "pid": pid})
    try:
        async with asyncio.TaskGroup() as tasks:
            output = tasks.create_task(_pump_output(ws, svc, who, name, pid))
            tasks.create_task(_pump_input(ws, svc, who, name, pid, output))
    except* (WebSocketDisconnect, SandgateError) as group:
        log.info("pty.ended", extra={"sandbox": name, "pid": pid, "why": repr(group.exceptions[0])})
    finally:
        with contextlib.suppress(SandgateError):
            await asyncio.shield(svc.toolbox.close_terminal(who, name, pid))
        with contextlib.suppress(Exception):
            await ws.close(1000)


async def _past_the_limit(
    call: Callable[[], Awaitable[T]], leaving: asyncio.Future[Message] | None = None
) -> T:
    """`call()`, asked again after each refusal for the sandbox's pids limit for up to
    `LIMIT_PATIENCE` seconds: such a refusal comes before the agent begins the call, so
    nothing is done twice, and a terminal outlives a moment of its sandbox at the limit.
    `leaving`, the client's next message: once it is the client's disconnect, nothing more
    is asked (keys it typed must not reach the shell after it left)."""
    give_up = time.monotonic() + LIMIT_PATIENCE
    while True:
        try:
            return await call()
        except LimitExceededError as exc:
            if exc.limit != "pids" or time.monotonic() >= give_up:
                raise
            pause = max(LIMIT_RETRY_FLOOR, exc.retry_after)
            if leaving is not None and not leaving.done():
                await asyncio.wait({leaving}, timeout=pause)
            else:
                await asyncio.sleep(pause)
            if leaving is not None and _left(leaving):
                raise WebSocketDisconnect(1001) from None


def _left(receive: asyncio.Future[Message]) -> bool:
    """Whether the client's next message, if it came, is its disconnect."""
    if not receive.done() or receive.cancelled():
        return False
    failed = receive.exception()
    return failed is not None or receive.result()["type"] == "websocket.disconnect"


async def _pump_output(ws: WebSocket, svc: Services, who: TenantId, name: str, pid: int) -> None:
    offset = 0
    while True:
        read = partial(svc.toolbox.terminal_output, who, name, pid, offset, wait=READ_WAIT)
        page = await _past_the_limit(read)
        payload = b"".join(chunk.data for chunk in page.chunks)
        if payload:
            await ws.send_bytes(payload)
        offset = max(offset + len(payload), page.next_offset)
        if page.exited:
            await ws.send_text(json.dumps({"type": "exit", "exit_code": page.exit_code}))
            return


async def _pump_input(
    ws: WebSocket,
    svc: Services,
    who: TenantId,
    name: str,
    pid: int,
    output: asyncio.Task[None],
) -> None:
    receive = asyncio.ensure_future(ws.receive())
    try:
        while not output.done():
            done, _ = await asyncio.wait({receive, output}, return_when=asyncio.FIRST_COMPLETED)
            if receive not in done:
                return  # the shell exited
            message = receive.result()
            if message["type"] == "websocket.disconnect":
                output.cancel()
                return
            # the next message is awaited meanwhile, so that a client leaving while a write
            # waits out the sandbox's pids limit is seen leaving
            receive = asyncio.ensure_future(ws.receive())
            data = message.get("bytes")
            if data:
                write = partial(svc.toolbox.write_terminal, who, name, pid, data)
                await _past_the_limit(write, receive)
                continue
            text = message.get("text")
            if text:
                await _control(svc, who, name, pid, text, receive)
    finally:
        receive.cancel()


async def _control(
    svc: Services,
    who: TenantId,
    name: str,
    pid: int,
    text: str,
    leaving: asyncio.Future[Message],
) -> None:
    try:
        message = json.loads(text)
        if message.get("type") != "resize":
            return
        cols, rows = int(message["cols"]), int(message["rows"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return  # not a control message we know: ignore, as terminals ignore unknown sequences
    if 1 <= cols <= 1000 and 1 <= rows <= 1000:
        resize = partial(svc.toolbox.resize_terminal, who, name, pid, cols=cols, rows=rows)
        await _past_the_limit(resize, leaving)
