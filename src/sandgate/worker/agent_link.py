"""The worker's side of one sandbox's agent: frames over the agent's stdin/stdout pipes."""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from sandgate.agent.frames import FrameDecoder, FrameError, Header
from sandgate.tunnel.rpc import RpcChannel

log = logging.getLogger(__name__)


class AgentLink:
    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.name = name
        self._process = process
        self._stdin = process.stdin
        self._stdout = process.stdout
        self._decoder = FrameDecoder()
        self._buffered: deque[tuple[Header, bytes]] = deque()
        self.ready = asyncio.Event()
        self.ready_info: Header = {}
        self.channel = RpcChannel(self._send, on_event=self._on_event, name=f"agent {name}")

    async def serve(self) -> None:
        """Read the agent's frames until its stdout closes (the agent exited)."""
        await self.channel.serve(self._next_frame)

    async def close(self) -> None:
        """Close the agent's stdin: it kills what it started and exits."""
        if not self._stdin.is_closing():
            self._stdin.close()

    async def _send(self, frame: bytes) -> None:
        self._stdin.write(frame)
        await self._stdin.drain()

    async def _next_frame(self) -> tuple[Header, bytes] | None:
        while not self._buffered:
            data = await self._stdout.read(1 << 16)
            if not data:
                return None
            try:
                self._buffered.extend(self._decoder.feed(data))
            except FrameError as exc:
                log.error("agent.bad_frame", extra={"sandbox": self.name, "error": str(exc)})
                return None
        return self._buffered.popleft()

    async def _on_event(self, header: Header, payload: bytes) -> None:
        if header.get("event") == "ready":
            self.ready_info = header
            self.ready.set()
