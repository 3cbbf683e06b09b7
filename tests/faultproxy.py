"""A TCP proxy that makes network faults on demand: the tests' stand-in for a load balancer
restart, a network blip or a partition between a worker and its instance, or a client's
network losing an answer. The only proxy the tests use (the `fault_proxy` fixture of
tests/conftest.py opens them; scripts/multi-instance-check.sh runs this file as its forwarder).

It runs its own asyncio loop in a thread, so sync tests drive it directly:

    with FaultProxy.to(deployment.url) as proxy:     # listen on 127.0.0.1:<free port>
        start the worker with --server proxy.url
        proxy.cut()                 # reset every open connection now (RST), like a restart
        proxy.cut(refuse_for=0.5)   # ... and refuse new connections for 0.5 s
        proxy.blackhole()           # nothing passes either way, open or new; bytes wait
        proxy.delay(0.2)            # every chunk is held 0.2 s before it is relayed
        proxy.drop_after(4096)      # each connection is reset after 4096 more bytes
        proxy.heal()                # back to passing everything
        proxy.redirect(other_url)   # dial another upstream from now on, and cut (the
                                    # balancer moved: a worker redials to another instance)

With a `rule`, it reads the head of each HTTP request (one request per connection: it asks
the server to close after answering), records it in `proxy.seen` and asks the rule what to do
with the answer: "pass", "drop" (wait for the server's answer head, then close without relaying
any of it: the server did the work, the client never hears it) or an int N (relay the first N
bytes of the answer, then close). `first_n` makes the usual rule.

    FaultProxy.to(url, rule=first_n(2, "POST", "/api/v1/sandboxes"))

Run as a script it forwards 127.0.0.1:LISTEN to TARGET until SIGTERM, which resets every
connection: `python tests/faultproxy.py LISTEN [HOST:]PORT`.

A blackhole keeps what it read (one chunk per direction) and relays it on `heal()`, as TCP
would after a healed partition; it never loses or reorders bytes of a connection it keeps.

Hand-written on purpose: toxiproxy, the usual tool, is not installable here (not in Debian 12;
PyPI has only stale clients, no server) and `tc netem` is missing from this kernel
(../shared/research/reliability.md, section 4).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

CHUNK = 65536
HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True)
class Seen:
    """The head of one HTTP request that went through a proxy with a rule."""

    method: str
    target: str
    headers: dict[str, str]  # names in lower case

    @property
    def path(self) -> str:
        return self.target.split("?")[0]


Action = str | int  # "pass", "drop", or N: relay the first N bytes of the answer, then close
Rule = Callable[[Seen], Action]


def first_n(n: int, method: str, path_suffix: str, action: Action = "drop") -> Rule:
    """A rule: the first `n` requests matching get `action`, the rest pass."""
    done = [0]
    lock = threading.Lock()

    def rule(seen: Seen) -> Action:
        if seen.method == method and seen.path.endswith(path_suffix):
            with lock:
                if done[0] < n:
                    done[0] += 1
                    return action
        return "pass"

    return rule


class OpenProxy(Protocol):
    """The `fault_proxy` fixture: a started proxy to `url`, stopped after the test."""

    def __call__(self, url: str, *, rule: Rule | None = None, port: int = 0) -> FaultProxy: ...


@dataclass(eq=False)  # kept in a set by identity
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    budget: int | None = None  # bytes left before a drop_after reset
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def reset(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None and not writer.transport.is_closing():
                _abort(writer)  # one closed on purpose (`end`) still flushes its last bytes
        for task in self.tasks:
            task.cancel()

    def end(self) -> None:
        """Close both ways with a FIN after what was written, as a server closing does."""
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.close()
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()


class FaultProxy:
    def __init__(
        self, upstream_host: str, upstream_port: int, *, rule: Rule | None = None, port: int = 0
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = port  # 0: a free port, known once started
        self.rule = rule
        self.seen: list[Seen] = []  # with a rule: every request head, in arrival order
        self._seen_lock = threading.Lock()
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
    def at(cls, url: str, *, rule: Rule | None = None, port: int = 0) -> FaultProxy:
        """A started proxy to the host:port of an http:// URL (listening on `port`, or a
        free one); the caller stops it."""
        proxy = cls(*_host_port(url), rule=rule, port=port)
        proxy.start()
        return proxy

    @classmethod
    @contextlib.contextmanager
    def to(cls, url: str, *, rule: Rule | None = None, port: int = 0) -> Iterator[FaultProxy]:
        """A proxy to the host:port of an http:// URL, stopped on exit."""
        proxy = cls.at(url, rule=rule, port=port)
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

    def redirect(self, url: str) -> int:
        """Dial the host:port of `url` from now on and reset every open connection, so each
        redials there (a balancer moved to another backend). Returns how many were reset."""
        return self._call(self._redirect(_host_port(url)))

    @property
    def connections(self) -> int:
        return len(self._links)

    def count(self, method: str, path: str) -> list[Seen]:
        """The requests seen (with a rule) with this method and exactly this path."""
        with self._seen_lock:
            return [s for s in self.seen if s.method == method and s.path == path]

    # -- inside the proxy's loop ----------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.reset()
        self._links.clear()
        # let every connection's task see its end before the loop stops
        others = asyncio.all_tasks() - {asyncio.current_task()}
        if others:
            await asyncio.wait(others, timeout=2)

    async def _cut(self, refuse_for: float) -> int:
        self._refuse_until = time.monotonic() + refuse_for
        links = list(self._links)
        for link in links:
            link.reset()
        self.resets += len(links)
        self._links.clear()
        return len(links)

    async def _redirect(self, upstream: tuple[str, int]) -> int:
        self.upstream = upstream
        return await self._cut(0.0)

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
        action: Action = "pass"
        head = b""
        try:
            await self._open.wait()  # a blackhole accepts and never dials on
            if self.rule is not None:
                head, action = self._judge(await reader.readuntil(HEAD_END))
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except (
            OSError,
            asyncio.CancelledError,
            asyncio.IncompleteReadError,  # closed before a whole request head
            asyncio.LimitOverrunError,  # a head over 64 KiB
            ValueError,  # not an HTTP request line
        ):
            self._links.discard(link)
            _abort(writer)
            return
        link.upstream = up_writer
        if link not in self._links:  # cut while dialing
            link.reset()
            return
        up_writer.write(head)
        answer = (
            self._pump(link, up_reader, writer)
            if action == "pass"
            else self._answer(link, up_reader, writer, action)
        )
        link.tasks = [
            asyncio.create_task(self._pump(link, reader, up_writer)),
            asyncio.create_task(answer),
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

    def _judge(self, head: bytes) -> tuple[bytes, Action]:
        """Record a request head, ask the rule, and rewrite the head so the server closes
        the connection after its answer (the next request is seen on a new one)."""
        assert self.rule is not None
        lines = head[: -len(HEAD_END)].decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        seen = Seen(method, target, headers)
        with self._seen_lock:
            self.seen.append(seen)
        action = self.rule(seen)
        kept = [line for line in lines[1:] if not line.lower().startswith("connection:")]
        rewritten = "\r\n".join([lines[0], *kept, "Connection: close"]).encode("latin-1")
        return rewritten + HEAD_END, action

    async def _answer(
        self, link: _Link, source: asyncio.StreamReader, sink: asyncio.StreamWriter, action: Action
    ) -> None:
        """Relay at most `action` bytes of the answer ("drop": none, once its head came),
        then end the connection both ways."""
        limit = 0 if action == "drop" else int(action)
        relayed = 0
        answer = b""
        try:
            while data := await source.read(CHUNK):
                if action == "drop":
                    answer += data
                    if HEAD_END in answer:
                        break  # the server answered; the client never hears it
                    continue
                sink.write(data[: limit - relayed])
                relayed += min(len(data), limit - relayed)
                await sink.drain()
                if relayed >= limit:
                    break
        except (OSError, ConnectionError):
            pass
        self._links.discard(link)
        link.end()


def _host_port(url: str) -> tuple[str, int]:
    """The host and port of an http:// URL, or of a bare host:port."""
    host, _, port = url.removeprefix("http://").rstrip("/").partition(":")
    return host, int(port)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a dropped link or restarted balancer does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def main(argv: Sequence[str] | None = None) -> None:
    """Forward 127.0.0.1:LISTEN to TARGET until SIGTERM or SIGINT, then reset every
    connection and exit (scripts/multi-instance-check.sh moves a worker this way)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("listen", type=int, help="the port to listen on (127.0.0.1)")
    parser.add_argument("target", help="PORT or HOST:PORT to forward to (127.0.0.1 if no host)")
    args = parser.parse_args(argv)
    target = args.target if ":" in args.target else f"127.0.0.1:{args.target}"

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    proxy = FaultProxy.at(target, port=args.listen)
    try:
        sys.stdout.write(f"faultproxy: {proxy.url} -> {target}\n")
        sys.stdout.flush()
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()


if __name__ == "__main__":
    main()
