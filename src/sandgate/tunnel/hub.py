"""The server's end of worker tunnels: one `TunnelSession` per connected worker.

A session lives in the memory of the instance the worker dialed (`ServerLocalState.tunnels`);
the store records that this instance holds it (`tunnel_owners`), renewed on every heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.websockets import WebSocket, WebSocketDisconnect

from sandgate.agent.frames import FrameError, Header, decode, encode
from sandgate.tunnel.rpc import RpcChannel

log = logging.getLogger(__name__)


@dataclass
class TunnelSession:
    worker: str
    capacity: int
    features: dict[str, Any]
    channel: RpcChannel
    connected_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)


class TunnelEvents(Protocol):
    """What the control plane does when tunnels come, talk and go."""

    async def attached(self, session: TunnelSession, hello: Header) -> Header: ...
    async def event(self, session: TunnelSession, header: Header) -> None: ...
    async def detached(self, session: TunnelSession) -> None: ...


async def serve_tunnel(ws: WebSocket, events: TunnelEvents, *, hello_timeout: float = 10.0) -> None:
    """Run one worker's tunnel until it closes. The caller has authenticated the token."""
    await ws.accept()

    async def send(frame: bytes) -> None:
        await ws.send_bytes(frame)

    try:
        first = await asyncio.wait_for(ws.receive_bytes(), hello_timeout)
        hello, _ = decode(first)
    except (TimeoutError, FrameError, WebSocketDisconnect, KeyError) as exc:
        log.warning("tunnel.bad_hello", extra={"error": repr(exc)})
        await _close(ws, 1002)
        return
    name = hello.get("name")
    if hello.get("event") != "hello" or not isinstance(name, str) or not name:
        await _close(ws, 1002)
        return

    session_box: list[TunnelSession] = []

    async def on_event(header: Header, payload: bytes) -> None:
        await events.event(session_box[0], header)

    channel = RpcChannel(send, on_event=on_event, name=f"tunnel {name}")
    session = TunnelSession(
        worker=name,
        capacity=int(hello.get("capacity") or 1),
        features=dict(hello.get("features") or {}),
        channel=channel,
    )
    session_box.append(session)
    try:
        welcome = await events.attached(session, hello)
        await ws.send_bytes(encode({"event": "welcome", **welcome}))

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

        await channel.serve(frames)
    except FrameError as exc:
        log.warning("tunnel.bad_frame", extra={"worker": name, "error": str(exc)})
        await _close(ws, 1002)
    finally:
        await asyncio.shield(events.detached(session))


async def _close(ws: WebSocket, code: int) -> None:
    try:
        await ws.close(code)
    except Exception:
        pass
