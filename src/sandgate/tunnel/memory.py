"""A tunnel link in memory: the server's end and the worker's end of one pipe, no socket.

The server's end offers what `hub.serve_tunnel` uses of a starlette WebSocket, the worker's
what `TunnelClient.serve_link` uses of a websockets connection; both carry the same binary
frames. Closing either end ends both, as a dropped TCP connection would. Used to wire the
real server and the real worker service in one process (tests/fast).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.websockets import WebSocketDisconnect
from websockets.exceptions import ConnectionClosedOK

_CLOSED = object()


class MemoryLink:
    def __init__(self) -> None:
        self._to_server: asyncio.Queue[object] = asyncio.Queue()
        self._to_worker: asyncio.Queue[object] = asyncio.Queue()
        self.closed = False
        self.server = ServerEnd(self)
        self.worker = WorkerEnd(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._to_server.put_nowait(_CLOSED)
            self._to_worker.put_nowait(_CLOSED)


class ServerEnd:
    def __init__(self, link: MemoryLink) -> None:
        self._link = link

    async def accept(self) -> None:
        return None

    async def receive_bytes(self) -> bytes:
        message = await self.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(1000)
        data: bytes = message["bytes"]
        return data

    async def receive(self) -> dict[str, Any]:
        item = await self._link._to_server.get()
        if item is _CLOSED:
            self._link._to_server.put_nowait(_CLOSED)  # every later read sees it too
            return {"type": "websocket.disconnect", "code": 1000}
        return {"type": "websocket.receive", "bytes": item}

    async def send_bytes(self, data: bytes) -> None:
        if self._link.closed:
            raise WebSocketDisconnect(1000)
        self._link._to_worker.put_nowait(data)

    async def close(self, code: int = 1000) -> None:
        self._link.close()


class WorkerEnd:
    def __init__(self, link: MemoryLink) -> None:
        self._link = link

    async def send(self, message: bytes) -> None:
        if self._link.closed:
            raise ConnectionClosedOK(None, None)
        self._link._to_server.put_nowait(message)

    async def recv(self) -> bytes:
        item = await self._link._to_worker.get()
        if item is _CLOSED:
            self._link._to_worker.put_nowait(_CLOSED)
            raise ConnectionClosedOK(None, None)
        assert isinstance(item, bytes)
        return item
