"""A TCP proxy that makes network faults on demand: the tests' stand-in for a load balancer
restart, a network blip or a partition between a worker and its instance.

It runs its own asyncio loop in a thread, so sync tests drive it directly:

    with FaultProxy.to(deployment.url) as proxy:     # listen on 127.0.0.1:<free port>
        start the worker with --server proxy.url
        proxy.cut()                 # reset every open connection now (RST), like a restart
        proxy.cut(refuse_for=0.5)   # ... and refuse new connections for 0.5 s
        proxy.blackhole()           # nothing passes either way, open or new; bytes wait
        proxy.delay(0.2)            # every chunk is held 0.2 s before it is relayed
        proxy.drop_after(4096)      # each connection is reset after 4096 more bytes
        proxy.heal()                # back to passing everything

A blackhole keeps what it read (one chunk per direction) and relays it on `heal()`, as TCP
would after a healed partition; it never loses or reorders bytes of a connection it keeps.

Hand-written on purpose: toxiproxy, the usual tool, is not installable here (not in Debian 12;
PyPI has only stale clients, no server) and `tc netem` is missing from this kernel
(../shared/research/reliability.md, section 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK = 65536


@dataclass(eq=False)  # kept in a set by identity
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    budget: int | None = None  # bytes left before a drop_after reset
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                _abort(writer)
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.accepted = 0  # connections accepted so far (a redial shows up here)
        self.resets = 0  # connections this proxy reset (cut or drop_after)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._links: set[_Link] = set()
        self._open: asyncio.Event | None = None  # set while not blackholed
        self._delay = 0.0
        self._drop_after: int | None = None
        self._refuse_until = 0.0
        self._server: asyncio.Server | None = None

    @classmethod
    @contextlib.contextmanager
    def to(cls, url: str) -> Iterator[FaultProxy]:
        """A proxy to the host:port of an http:// URL, stopped on exit."""
        host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
        proxy = cls(host, int(port))
        proxy.start()
        try:
            yield proxy
        finally:
            proxy.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- control (from any thread) --------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._call(self._start())

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def cut(self, *, refuse_for: float = 0.0) -> int:
        """Reset every open connection; refuse new ones for `refuse_for` s. Returns how many."""
        return self._call(self._cut(refuse_for))

    def blackhole(self) -> None:
        self._call(self._set_open(False))

    def heal(self) -> None:
        """Pass everything again: no blackhole, delay or drop_after."""
        self._delay = 0.0
        self._drop_after = None
        self._call(self._heal())

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    def drop_after(self, nbytes: int) -> None:
        """Reset each connection (open or new) once `nbytes` more bytes went through it."""
        self._call(self._arm_drop(nbytes))

    @property
    def connections(self) -> int:
        return len(self._links)

    # -- inside the proxy's loop ----------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.reset()
        self._links.clear()

    async def _cut(self, refuse_for: float) -> int:
        self._refuse_until = time.monotonic() + refuse_for
        links = list(self._links)
        for link in links:
            link.reset()
        self.resets += len(links)
        self._links.clear()
        return len(links)

    async def _set_open(self, value: bool) -> None:
        assert self._open is not None
        if value:
            self._open.set()
        else:
            self._open.clear()

    async def _heal(self) -> None:
        for link in self._links:
            link.budget = None
        await self._set_open(True)

    async def _arm_drop(self, nbytes: int) -> None:
        self._drop_after = nbytes
        for link in self._links:
            link.budget = nbytes

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._open is not None
        if time.monotonic() < self._refuse_until:
            _abort(writer)
            return
        self.accepted += 1
        link = _Link(client=writer, budget=self._drop_after)
        self._links.add(link)
        try:
            await self._open.wait()  # a blackhole accepts and never dials on
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except (OSError, asyncio.CancelledError):
            self._links.discard(link)
            _abort(writer)
            return
        link.upstream = up_writer
        if link not in self._links:  # cut while dialing
            link.reset()
            return
        link.tasks = [
            asyncio.create_task(self._pump(link, reader, up_writer)),
            asyncio.create_task(self._pump(link, up_reader, writer)),
        ]
        await asyncio.gather(*link.tasks, return_exceptions=True)
        self._links.discard(link)
        link.reset()

    async def _pump(
        self, link: _Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter
    ) -> None:
        assert self._open is not None
        try:
            while data := await source.read(CHUNK):
                await self._open.wait()
                if self._delay:
                    await asyncio.sleep(self._delay)
                    await self._open.wait()
                if link.budget is not None:
                    if len(data) >= link.budget:
                        sink.write(data[: link.budget])
                        self.resets += 1
                        self._links.discard(link)
                        link.reset()
                        return
                    link.budget -= len(data)
                sink.write(data)
                await sink.drain()
            if sink.can_write_eof():
                sink.write_eof()  # half-close, as the peer did
        except (OSError, ConnectionError):
            for task in link.tasks:
                if task is not asyncio.current_task():
                    task.cancel()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dropped link or restarted balancer does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
