"""The worker's end of the tunnel: dial out, say hello, serve requests, redial with backoff."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from sandgate.agent.frames import MAX_PAYLOAD_BYTES, FrameError, Header, decode
from sandgate.tunnel.rpc import Handler, RpcChannel

log = logging.getLogger(__name__)

TUNNEL_PROTOCOL_VERSION = 1


def tunnel_url(server_url: str) -> str:
    base = server_url.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base.removeprefix("https://") + "/tunnel"
    if base.startswith("http://"):
        return "ws://" + base.removeprefix("http://") + "/tunnel"
    return base + "/tunnel"


class Link(Protocol):
    """What a session needs of its link: a websockets ClientConnection, or an in-memory
    pair in fast tests (`sandgate.tunnel.memory`)."""

    async def send(self, message: bytes) -> None: ...
    async def recv(self) -> bytes | str: ...


class TunnelClient:
    def __init__(
        self,
        server_url: str,
        token: str,
        *,
        hello: Callable[[], dict[str, Any]],
        handler: Handler,
        on_welcome: Callable[[Header], Coroutine[Any, Any, None]],
        on_channel: Callable[[RpcChannel | None], None],
        heartbeat_interval: float = 10.0,
        reconnect_min: float = 0.2,
        reconnect_max: float = 5.0,
    ) -> None:
        self.url = tunnel_url(server_url)
        self._token = token
        self._hello = hello
        self._handler = handler
        self._on_welcome = on_welcome
        self._on_channel = on_channel
        self._heartbeat_interval = heartbeat_interval
        self._reconnect_min = reconnect_min
        self._reconnect_max = reconnect_max
        self.connected = asyncio.Event()

    async def run(self) -> None:
        """Stay connected until cancelled."""
        delay = self._reconnect_min
        while True:
            try:
                async with connect(
                    self.url,
                    additional_headers={"Authorization": f"Bearer {self._token}"},
                    max_size=MAX_PAYLOAD_BYTES + (2 << 20),
                    ping_interval=5,  # a silent link is dropped and redialed within ~15 s
                    ping_timeout=10,
                    open_timeout=10,
                    compression=None,
                ) as ws:
                    delay = self._reconnect_min
                    await self.serve_link(ws)
                log.warning("tunnel.lost", extra={"url": self.url})
            except InvalidStatus as exc:
                status = exc.response.status_code
                log.error("tunnel.refused", extra={"url": self.url, "status": status})
                if status in (401, 403):
                    delay = self._reconnect_max  # a bad token will not fix itself quickly
            except (OSError, ConnectionClosed, TimeoutError, FrameError) as exc:
                log.warning("tunnel.dial_failed", extra={"url": self.url, "error": repr(exc)})
            except Exception:
                # whatever went wrong in this session, the worker must keep redialing
                log.exception("tunnel.session_failed", extra={"url": self.url})
            finally:
                self.connected.clear()
                self._on_channel(None)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self._reconnect_max)

    async def serve_link(self, ws: Link) -> None:
        """One session on a dialed link: hello, welcome, then serve until it closes."""

        async def send(frame: bytes) -> None:
            await ws.send(frame)

        channel = RpcChannel(send, handler=self._handler, name="tunnel")
        await channel.event("hello", version=TUNNEL_PROTOCOL_VERSION, **self._hello())
        welcome_raw = await asyncio.wait_for(ws.recv(), timeout=15)
        welcome, _ = decode(welcome_raw if isinstance(welcome_raw, bytes) else welcome_raw.encode())
        if welcome.get("event") != "welcome":
            raise FrameError(f"expected a welcome from the server, got {welcome!r}")
        log.info("tunnel.connected", extra={"url": self.url})
        self._on_channel(channel)
        self.connected.set()

        async def frames() -> tuple[Header, bytes] | None:
            try:
                message = await ws.recv()
            except ConnectionClosed:
                return None
            return decode(message if isinstance(message, bytes) else message.encode())

        async with asyncio.TaskGroup() as tasks:
            heartbeat = tasks.create_task(self._heartbeat(channel))
            tasks.create_task(self._on_welcome(welcome))
            try:
                await channel.serve(frames)
            finally:
                heartbeat.cancel()

    async def _heartbeat(self, channel: RpcChannel) -> None:
        """Beat every interval while the link is up. A beat that fails is logged with its
        traceback and the next one tries again; only the end of the link ends the loop (the
        session is over then, and `run` redials)."""
        while not channel.closed:
            await asyncio.sleep(self._heartbeat_interval)
            try:
                # what runs here, so the control plane can remove what it no longer knows
                hello = self._hello()
                await channel.event(
                    "heartbeat",
                    sandboxes=hello.get("sandboxes", []),
                    tearing_down=hello.get("tearing_down", []),
                )
            except ConnectionClosed:
                log.info("tunnel.heartbeat_link_closed", extra={"url": self.url})
                return  # the session's reader sees the close too and ends the session
            except Exception:
                if channel.closed:
                    return  # the link ended meanwhile: the session ends, `run` redials
                log.exception("tunnel.heartbeat_failed", extra={"url": self.url})
