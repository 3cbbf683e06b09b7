"""The server's end of worker tunnels: one `TunnelSession` per connected worker.

A session lives in the memory of the instance the worker dialed (`ServerLocalState.tunnels`);
the store records that this instance holds it (`tunnel_owners`), renewed on every heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.websockets import WebSocketDisconnect
from uvicorn.protocols.utils import ClientDisconnected

from sandgate.agent.frames import FrameError, Header, decode, encode
from sandgate.errors import AuthError
from sandgate.tunnel.rpc import Handler, LinkClosedError, RpcChannel

log = logging.getLogger(__name__)


@dataclass
class TunnelSession:
    worker: str
    capacity: int
    features: dict[str, Any]
    channel: RpcChannel
    token_hash: str  # the worker token it authenticated with
    disconnect: Callable[[int], Awaitable[None]]  # closes the WebSocket with this code
    connected_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)


class TunnelEvents(Protocol):
    """What the control plane does when tunnels come, talk and go, in this order:

    `attached` (the hello is read; its answer becomes the welcome, the first frame the
    worker gets), `serving` (the welcome is sent and frames are read: from now on requests
    may be routed to the session), `event` for each event, `detached` once, at the end,
    whether or not the session got as far as serving.
    """

    async def attached(self, session: TunnelSession, hello: Header) -> Header: ...
    async def serving(self, session: TunnelSession) -> None: ...
    async def event(self, session: TunnelSession, header: Header) -> None: ...
    async def detached(self, session: TunnelSession) -> None: ...


# What starlette and uvicorn raise when a frame is sent on a WebSocket that went away.
_SEND_FAILURES = (WebSocketDisconnect, ClientDisconnected, RuntimeError, OSError)


WORKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_REPORTED_SANDBOXES = 100_000


def parse_hello(hello: Header) -> tuple[str, int, dict[str, Any], list[str]] | None:
    """The fields of a worker's hello, or None when any is missing or of the wrong type."""
    name, capacity = hello.get("name"), hello.get("capacity")
    features, sandboxes = hello.get("features", {}), hello.get("sandboxes", [])
    if hello.get("event") != "hello" or not isinstance(name, str) or not WORKER_NAME.match(name):
        return None
    if type(capacity) is not int or not 1 <= capacity <= 100_000:
        return None
    if not isinstance(features, dict) or not isinstance(sandboxes, list):
        return None
    if len(sandboxes) > MAX_REPORTED_SANDBOXES or not all(isinstance(n, str) for n in sandboxes):
        return None
    return name, capacity, features, sandboxes


class ServerLink(Protocol):
    """What a tunnel needs of the server's end of its link: a starlette WebSocket, or the
    in-memory pair of fast tests (`sandgate.tunnel.memory`)."""

    async def accept(self) -> None: ...
    async def receive_bytes(self) -> bytes: ...
    async def receive(self) -> Any: ...
    async def send_bytes(self, data: bytes) -> None: ...
    async def close(self, code: int = 1000) -> None: ...


async def serve_tunnel(
    ws: ServerLink,
    events: TunnelEvents,
    *,
    token_hash: str,
    hello_timeout: float = 10.0,
    handler: Handler | None = None,
) -> None:
    """Run one worker's tunnel until it closes. The caller has authenticated the token.
    `handler` answers the worker's own requests (its `blob` fetches)."""
    await ws.accept()
    channel: RpcChannel | None = None

    async def send(frame: bytes) -> None:
        try:
            await ws.send_bytes(frame)
        except _SEND_FAILURES as exc:
            # the link is gone: every call waiting on it fails now, not at its timeout
            lost = LinkClosedError(f"tunnel {name} lost ({type(exc).__name__})", retry_after=1.0)
            if channel is not None:
                channel.close(lost)
            raise lost from None

    try:
        first = await asyncio.wait_for(ws.receive_bytes(), hello_timeout)
        hello, _ = decode(first)
    except (TimeoutError, FrameError, WebSocketDisconnect, KeyError, RuntimeError) as exc:
        log.warning("tunnel.bad_hello", extra={"error": repr(exc)})
        await _close(ws, 1002)
        return
    fields = parse_hello(hello)
    if fields is None:
        log.warning("tunnel.bad_hello", extra={"keys": sorted(hello)})
        await _close(ws, 1002)
        return
    name, capacity, features, reported = fields

    async def on_event(header: Header, payload: bytes) -> None:
        await events.event(session, header)  # bound below, before any frame is served

    channel = RpcChannel(send, handler=handler, on_event=on_event, name=f"tunnel {name}")

    async def disconnect(code: int) -> None:
        await _close(ws, code)  # 4409 replaced by a newer tunnel, 4408 went silent

    session = TunnelSession(
        worker=name,
        capacity=capacity,
        features=features,
        channel=channel,
        token_hash=token_hash,
        disconnect=disconnect,
    )
    try:
        welcome = await events.attached(session, {**hello, "sandboxes": reported})
    except AuthError as exc:
        log.warning("tunnel.refused", extra={"worker": name, "error": exc.message})
        await _close(ws, 4403)
        return  # never attached
    except Exception:
        log.exception("tunnel.attach_failed", extra={"worker": name})
        await _close(ws, 1011)  # the worker redials
        await asyncio.shield(events.detached(session))
        return

    async def frames() -> tuple[Header, bytes] | None:
        try:
            message = await ws.receive()
        except (WebSocketDisconnect, RuntimeError):
            return None
        if message["type"] == "websocket.disconnect":
            return None
        data = message.get("bytes")
        if data is None:
            raise FrameError("tunnel frames must be binary")
        session.last_heartbeat = time.monotonic()
        return decode(data)

    async def serving() -> None:
        await events.serving(session)

    try:
        # the welcome is the first frame on the link: nothing is routed here before it
        await send(encode({"event": "welcome", **welcome}))
        await channel.serve(frames, started=serving)
    except* FrameError as group:
        log.warning("tunnel.bad_frame", extra={"worker": name, "error": str(group.exceptions[0])})
        await _close(ws, 1002)
    except* (LinkClosedError, *_SEND_FAILURES):
        pass  # the link dropped mid-send: detach below
    finally:
        channel.close(LinkClosedError(f"tunnel {name} closed", retry_after=1.0))
        await asyncio.shield(events.detached(session))


async def _close(ws: ServerLink, code: int) -> None:
    try:
        await ws.close(code)
    except Exception:
        pass
