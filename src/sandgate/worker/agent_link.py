"""The worker's side of one sandbox's agent: frames over the agent's stdin/stdout pipes."""

from __future__ import annotations

import asyncio
import logging

from sandgate.agent.frames import PREFIX, FrameError, Header, lengths, parse_header
from sandgate.tunnel.rpc import RpcChannel
from sandgate.worker.child import ChildProcess

log = logging.getLogger(__name__)


async def read_frame(reader: asyncio.StreamReader) -> tuple[Header, bytes] | None:
    """One frame from a stream, read to its exact length (one copy of the payload, out of the
    reader's buffer). None at a clean end (between frames); FrameError on a bad prefix or
    header, or a stream that ends inside a frame."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("stream ended inside a frame") from None
        return None
    hlen, plen = lengths(prefix)
    try:
        header = parse_header(await reader.readexactly(hlen))
        payload = await reader.readexactly(plen) if plen else b""
    except asyncio.IncompleteReadError:
        raise FrameError("stream ended inside a frame") from None
    return header, payload


class AgentLink:
    def __init__(self, name: str, process: ChildProcess) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.name = name
        self._process = process
        self._stdin = process.stdin
        self._stdout = process.stdout
        self.ready = asyncio.Event()
        self.ready_info: Header = {}
        self.channel = RpcChannel(
            self._send, on_event=self._on_event, name=f"agent {name}", send_parts=self._send_parts
        )

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

    async def _send_parts(self, head: bytes, payload: bytes) -> None:
        self._stdin.write(head)
        self._stdin.write(payload)  # no copy behind the head: the pipe takes most at once
        await self._stdin.drain()

    async def _next_frame(self) -> tuple[Header, bytes] | None:
        try:
            return await read_frame(self._stdout)
        except FrameError as exc:
            log.error("agent.bad_frame", extra={"sandbox": self.name, "error": str(exc)})
            return None

    async def _on_event(self, header: Header, payload: bytes) -> None:
        if header.get("event") == "ready":
            self.ready_info = header
            self.ready.set()
