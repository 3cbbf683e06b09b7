"""TCP connections to ports inside the sandbox (docs/agent-protocol.md, "Ports").

Standard library only, deployed next to the agent (main.py) and imported by it on the first
``port_*`` request, so an agent whose sandbox never serves a port pays nothing for it. The
agent runs in the sandbox's own network namespace, so 127.0.0.1 here is the sandbox's own
loopback: a server started in the sandbox is reached even when the sandbox has no network.

Unlike the other operations, ``port_*`` requests get no thread each. A WebSocket keeps a read
waiting all the time, and threads count against the sandbox's pids limit, so 256 connections
would hold 256 threads. Instead one thread, the port loop, serves every connection with a
selector: main.py hands it each request (``Ports.submit``, on the reading thread, which only
checks the fields) and it answers when the request is done, through the two callbacks
main.py gave it. The connections belong to that thread alone.

Notes on behaviour the protocol leaves open:

* A connection is tried on 127.0.0.1, then on ::1 (a server bound to "localhost" may listen
  on either). Refused on both: ``port_not_listening``.
* Nothing is buffered beyond one answer: a read takes at most ``max`` bytes from the socket
  (what the server sent waits in the kernel until it is asked for), a write is answered once
  the kernel took all of it. The server, the agent and the caller so pace one another.
* A write the server takes nothing of for ``WRITE_SECONDS`` fails (``io_error``), and the
  connection writes no more.
* A reset by the server reads as the end of the stream.
* A connection no request used for its ``idle`` seconds (default ``IDLE_SECONDS``) is
  closed: one whose caller went away (an instance that died) does not stay open.
"""

from __future__ import annotations

import errno
import math
import os
import selectors
import socket
import threading
import time
from collections import deque

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from sandgate.agent.log import log
    from sandgate.agent.request import AgentError, Header, start_thread
else:
    from log import log
    from request import AgentError, start_thread

OPS = ("port_open", "port_write", "port_read", "port_shutdown", "port_close")
MAX_CONNECTIONS = 256  # open connections per agent (per sandbox)
MAX_READ_BYTES = 1 << 20  # one read's answer at most
DEFAULT_READ_BYTES = 256 << 10
MAX_WAIT = 30.0  # seconds a read may wait for data
MAX_LINGER = 1.0  # seconds a read that has data may wait more for the end of the stream
CONNECT_SECONDS = 5.0  # per address tried
WRITE_SECONDS = 30.0  # a write the server takes nothing of for this long fails
IDLE_SECONDS = 300.0  # a connection no request used for this long is closed (default)
MAX_IDLE_SECONDS = 3600.0
MAX_PENDING_WRITES = 8  # writes queued on one connection, not yet taken by the kernel
RECV_BYTES = 256 << 10  # one recv(2)
HOSTS = ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"))


class _Read:
    """A read waiting on a connection (port_read, or the read a port_open asked for)."""

    __slots__ = ("deadline", "extra", "first_at", "limit", "linger", "rid")

    def __init__(self, rid: int, deadline: float, linger: float, limit: int, extra: Header) -> None:
        self.rid = rid
        self.deadline = deadline
        self.linger = linger
        self.limit = limit
        self.extra = extra  # fields of the answer besides eof (a port_open's conn)
        self.first_at: float | None = None  # when its first byte came


class _Write:
    """Bytes for the server; ``rid`` None: a port_open's first bytes (answered by the open)."""

    __slots__ = ("deadline", "rid", "total", "view")

    def __init__(self, rid: int | None, data: bytes, deadline: float) -> None:
        self.rid = rid
        self.view = memoryview(data)
        self.total = len(data)
        self.deadline = deadline


class _Open:
    """A port_open until it is answered: connected, its first bytes written, its read made."""

    __slots__ = ("first", "limit", "linger", "rid", "wait")

    def __init__(self, rid: int, first: bytes, wait: float, linger: float, limit: int) -> None:
        self.rid = rid
        self.first = first
        self.wait = wait
        self.linger = linger
        self.limit = limit


class Conn:
    """One TCP connection to a port of the sandbox, owned by the port loop."""

    __slots__ = (
        "buffer",
        "cid",
        "connect_by",
        "eof",
        "error",
        "hosts",
        "idle",
        "mask",
        "opener",
        "port",
        "reader",
        "refused",
        "shut",
        "shutter",
        "sock",
        "used",
        "writes",
    )

    def __init__(self, cid: int, port: int, idle: float, now: float) -> None:
        self.cid = cid
        self.port = port
        self.idle = idle
        self.used = now
        self.sock: socket.socket | None = None
        self.hosts = list(HOSTS)  # addresses still to try
        self.connect_by = 0.0  # while connecting: when this address is given up
        self.refused = False  # an address refused the connection
        self.error = 0  # the last other errno of a connect
        self.mask = 0  # the selector events it is registered for
        self.opener: _Open | None = None
        self.reader: _Read | None = None
        self.buffer = bytearray()  # what the waiting read took so far (at most its limit)
        self.writes: deque[_Write] = deque()
        self.shutter: int | None = None  # a port_shutdown waiting for the writes before it
        self.eof = False  # the server ended its stream: nothing more to read
        self.shut = False  # no more writes: shut down, or a write failed

    @property
    def connecting(self) -> bool:
        return self.opener is not None and self.sock is not None and self.connect_by > 0

    def busy(self) -> bool:
        return bool(self.opener or self.reader or self.writes or self.shutter is not None)


class Ports:
    """The connections of one agent, and the loop thread that serves their requests."""

    def __init__(
        self,
        answer: Callable[[int, Header, bytes], None],  # request id, fields, payload
        fail: Callable[[int, str, str], None],  # request id, code, message
    ) -> None:
        self._answer = answer
        self._fail = fail
        self._lock = threading.Lock()  # the inbox, the thread and closing
        self._inbox: deque[tuple[int, str, Header, bytes]] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # the loop thread's own
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[int, Conn] = {}
        self._next = 0

    # ----------------------------------------------------------------------- requests

    def submit(self, rid: int, op: str, req: Header, payload: bytes) -> None:
        """Called on the agent's reading thread: check the fields, hand the request to the
        loop (which answers it) and return at once. A bad request raises AgentError."""
        if op == "port_open":
            fields: Header = {
                "port": _port(req.get("port")),
                "wait": _number(req, "wait", 0.0, MAX_WAIT),
                "linger": _number(req, "linger", 0.0, MAX_LINGER),
                "max": _limit(req),
                "idle": _number(req, "idle", IDLE_SECONDS, MAX_IDLE_SECONDS, low=1.0),
            }
        elif op in OPS:
            fields = {"conn": _conn_id(req)}
            if op == "port_read":
                fields["wait"] = _number(req, "wait", 0.0, MAX_WAIT)
                fields["linger"] = _number(req, "linger", 0.0, MAX_LINGER)
                fields["max"] = _limit(req)
        else:
            raise AgentError("invalid_request", f"unknown op {op!r}")
        with self._lock:
            if self._closing:
                raise AgentError("io_error", "the agent is shutting down")
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="ports", daemon=True)
                start_thread(thread)  # refused at the sandbox's pids limit: nothing queued
                self._thread = thread
            self._inbox.append((rid, op, fields, payload))
        self._wake()

    def shutdown(self) -> None:
        """The agent is exiting: the loop closes every connection (never waits for it)."""
        with self._lock:
            self._closing = True
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # woken already
            pass

    # ----------------------------------------------------------------------- the loop

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    items = list(self._inbox)
                    self._inbox.clear()
                    if self._closing:
                        break
                for rid, op, fields, payload in items:
                    try:
                        self._handle(time.monotonic(), rid, op, fields, payload)
                    except Exception as exc:
                        log(f"ports: {op} failed: {exc!r}")
                        self._fail(rid, "io_error", f"{op} failed: {type(exc).__name__}: {exc}")
                timeout = self._timeout(time.monotonic())
                for key, events in self._selector.select(timeout):
                    if key.data is None:
                        _drain(self._wake_r)
                        continue
                    conn: Conn = key.data
                    if events & selectors.EVENT_WRITE and conn.cid in self._conns:
                        self._writable(conn, time.monotonic())
                    if events & selectors.EVENT_READ and conn.cid in self._conns:
                        self._readable(conn, time.monotonic())
                self._expire(time.monotonic())
        except BaseException as exc:  # never leave a request unanswered
            log(f"ports: the port loop failed: {exc!r}")
        finally:
            for conn in list(self._conns.values()):
                self._drop(conn, "the agent is shutting down")
            with self._lock:
                left = list(self._inbox)
                self._inbox.clear()
                self._thread = None  # a later request starts a new loop (unless closing)
            for rid, _, _, _ in left:
                self._fail(rid, "io_error", "the agent is shutting down")

    def _timeout(self, now: float) -> float | None:
        """Seconds until the next deadline of any connection (None: none, wait for a wake)."""
        soonest: float | None = None
        for conn in self._conns.values():
            times = [conn.writes[0].deadline] if conn.writes else []
            if conn.connecting:
                times.append(conn.connect_by)
            if conn.reader is not None:
                times.append(conn.reader.deadline)
                if conn.reader.first_at is not None:
                    times.append(conn.reader.first_at + conn.reader.linger)
            if not conn.busy():
                times.append(conn.used + conn.idle)
            for at in times:
                soonest = at if soonest is None else min(soonest, at)
        return None if soonest is None else max(0.0, soonest - now)

    def _handle(self, now: float, rid: int, op: str, fields: Header, payload: bytes) -> None:
        if op == "port_open":
            self._open(now, rid, fields, payload)
            return
        conn = self._conns.get(fields["conn"])
        if conn is None:
            self._fail(rid, "not_found", f"no connection {fields['conn']} (closed, or idle)")
            return
        conn.used = now
        if op == "port_write":
            self._write(now, conn, rid, payload)
        elif op == "port_read":
            if conn.reader is not None:
                self._fail(rid, "conflict", f"a read is already waiting on connection {conn.cid}")
                return
            deadline = now + fields["wait"]
            conn.reader = _Read(rid, deadline, fields["linger"], fields["max"], {})
            self._readable(conn, now)
        elif op == "port_shutdown":
            if conn.writes:
                conn.shutter = rid
            else:
                self._shut(conn)
                self._answer(rid, {}, b"")
        elif op == "port_close":
            self._drop(conn, "closed")
            self._answer(rid, {}, b"")
        self._interest(conn)

    def _open(self, now: float, rid: int, fields: Header, first: bytes) -> None:
        if len(self._conns) >= MAX_CONNECTIONS:
            self._fail(
                rid,
                "limit_exceeded",
                f"too many connections to the sandbox's ports: {MAX_CONNECTIONS} are open "
                "(the limit); let some requests finish, or close WebSockets, and retry",
            )
            return
        self._next += 1
        conn = Conn(self._next, fields["port"], fields["idle"], now)
        conn.opener = _Open(rid, first, fields["wait"], fields["linger"], fields["max"])
        self._conns[conn.cid] = conn
        self._connect(conn, now)

    def _connect(self, conn: Conn, now: float) -> None:
        """Try the next address; answer the open's failure when none is left."""
        while conn.hosts:
            family, host = conn.hosts.pop(0)
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError as exc:  # no IPv6 here
                conn.error = exc.errno or conn.error
                continue
            sock.setblocking(False)
            code = sock.connect_ex((host, conn.port))
            if code in (0, errno.EINPROGRESS, errno.EAGAIN):
                conn.sock = sock
                conn.connect_by = now + CONNECT_SECONDS
                if code == 0:
                    self._connected(conn, now)
                else:
                    self._interest(conn)
                return
            sock.close()
            self._connect_failed(conn, code)
        opener = conn.opener
        self._forget(conn)
        if opener is None:
            return
        if conn.refused:
            self._fail(
                opener.rid,
                "port_not_listening",
                f"nothing listens on port {conn.port} in the sandbox (connection refused on "
                "127.0.0.1 and ::1)",
            )
        else:
            reason = os.strerror(conn.error) if conn.error else "no address to connect to"
            self._fail(opener.rid, "io_error", f"cannot connect to port {conn.port}: {reason}")

    def _connect_failed(self, conn: Conn, code: int) -> None:
        if code == errno.ECONNREFUSED:
            conn.refused = True
        else:
            conn.error = code

    def _connected(self, conn: Conn, now: float) -> None:
        conn.connect_by = 0.0
        opener = conn.opener
        if opener is not None and opener.first:
            conn.writes.appendleft(_Write(None, opener.first, now + WRITE_SECONDS))
            opener.first = b""
            self._flush(conn, now)
        elif opener is not None:
            self._opened(conn, now)
        self._interest(conn)

    def _opened(self, conn: Conn, now: float) -> None:
        """The open's first bytes are written: answer it, or make the read it asked for."""
        opener, conn.opener = conn.opener, None
        if opener is None:
            return
        if opener.wait > 0 or opener.linger > 0:
            extra = {"conn": conn.cid}
            conn.reader = _Read(opener.rid, now + opener.wait, opener.linger, opener.limit, extra)
            self._readable(conn, now)
        else:
            self._answer(opener.rid, {"conn": conn.cid}, b"")

    def _write(self, now: float, conn: Conn, rid: int, data: bytes) -> None:
        if conn.shut:
            self._fail(
                rid,
                "connection_closed",
                f"connection {conn.cid} writes no more (shut down, or a write failed)",
            )
            return
        if len(conn.writes) >= MAX_PENDING_WRITES:
            self._fail(rid, "conflict", f"{MAX_PENDING_WRITES} writes wait on connection already")
            return
        conn.writes.append(_Write(rid, data, now + WRITE_SECONDS))
        self._flush(conn, now)

    # ----------------------------------------------------------------------- I/O

    def _writable(self, conn: Conn, now: float) -> None:
        if conn.connecting:
            assert conn.sock is not None
            code = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code == 0:
                self._connected(conn, now)
                return
            self._unregister(conn)
            conn.sock.close()
            conn.sock = None
            self._connect_failed(conn, code)
            self._connect(conn, now)
            return
        self._flush(conn, now)
        self._interest(conn)

    def _flush(self, conn: Conn, now: float) -> None:
        """Send what the kernel takes now; answer each write it took whole."""
        sock = conn.sock
        assert sock is not None
        while conn.writes:
            head = conn.writes[0]
            try:
                sent = sock.send(head.view) if head.view else 0
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail_writes(conn, f"the server on port {conn.port} closed it ({exc})")
                break
            head.view = head.view[sent:]
            head.deadline = now + WRITE_SECONDS  # it took something: the server reads
            if head.view:
                continue
            conn.writes.popleft()
            if head.rid is None:
                self._opened(conn, now)
            else:
                self._answer(head.rid, {"written": head.total}, b"")
        if conn.shutter is not None and not conn.writes:
            rid, conn.shutter = conn.shutter, None
            self._shut(conn)
            self._answer(rid, {}, b"")
        if conn.opener is not None and not conn.writes and conn.shut:
            self._opened(conn, now)  # its first bytes could not all go: read what came

    def _fail_writes(self, conn: Conn, message: str) -> None:
        conn.shut = True
        while conn.writes:
            write = conn.writes.popleft()
            if write.rid is not None:
                self._fail(write.rid, "connection_closed", message)
        if conn.shutter is not None:
            rid, conn.shutter = conn.shutter, None
            self._answer(rid, {}, b"")

    def _shut(self, conn: Conn) -> None:
        conn.shut = True
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _readable(self, conn: Conn, now: float) -> None:
        """Take what the socket has for the waiting read (never more than it asked for)."""
        reader = conn.reader
        if reader is None:
            return
        sock = conn.sock
        while not conn.eof and sock is not None and len(conn.buffer) < reader.limit:
            try:
                data = sock.recv(min(RECV_BYTES, reader.limit - len(conn.buffer)))
            except BlockingIOError:
                break
            except OSError:  # reset: the stream ended
                data = b""
            if not data:
                conn.eof = True
                break
            conn.buffer += data
            if reader.first_at is None:
                reader.first_at = now
        self._answer_read(conn, now)
        self._interest(conn)

    def _answer_read(self, conn: Conn, now: float, *, force: bool = False) -> None:
        reader = conn.reader
        if reader is None:
            return
        has = bool(conn.buffer)
        done = (
            force
            or conn.eof
            or len(conn.buffer) >= reader.limit
            or now >= reader.deadline
            or (has and reader.first_at is not None and now >= reader.first_at + reader.linger)
        )
        if not done:
            return
        conn.reader = None
        data = bytes(conn.buffer)
        conn.buffer.clear()
        conn.used = now
        self._answer(reader.rid, {**reader.extra, "eof": conn.eof}, data)

    def _expire(self, now: float) -> None:
        for conn in list(self._conns.values()):
            if conn.connecting and now >= conn.connect_by:
                assert conn.sock is not None
                self._unregister(conn)
                conn.sock.close()
                conn.sock = None
                self._connect_failed(conn, errno.ETIMEDOUT)
                self._connect(conn, now)
                continue
            if conn.writes and now >= conn.writes[0].deadline:
                took = f"took nothing for {WRITE_SECONDS:g} s"
                self._fail_writes(conn, f"the server on port {conn.port} {took}")
                if conn.opener is not None:
                    self._opened(conn, now)
            if conn.reader is not None:
                self._answer_read(conn, now)
            if not conn.busy() and now >= conn.used + conn.idle:
                log(f"ports: connection {conn.cid} to port {conn.port} idle, closed")
                self._drop(conn, "idle")
                continue
            if conn.cid in self._conns:
                self._interest(conn)

    # ----------------------------------------------------------------------- bookkeeping

    def _interest(self, conn: Conn) -> None:
        """Register the connection for what it waits on now."""
        if conn.sock is None or conn.cid not in self._conns:
            return
        mask = 0
        if conn.connecting or conn.writes:
            mask |= selectors.EVENT_WRITE
        if conn.reader is not None and not conn.eof:
            mask |= selectors.EVENT_READ
        if mask == conn.mask:
            return
        if not mask:
            self._unregister(conn)
        elif conn.mask:
            self._selector.modify(conn.sock, mask, conn)
        else:
            self._selector.register(conn.sock, mask, conn)
        conn.mask = mask

    def _unregister(self, conn: Conn) -> None:
        if conn.mask and conn.sock is not None:
            self._selector.unregister(conn.sock)
        conn.mask = 0

    def _forget(self, conn: Conn) -> None:
        self._unregister(conn)
        if conn.sock is not None:
            conn.sock.close()
            conn.sock = None
        self._conns.pop(conn.cid, None)

    def _drop(self, conn: Conn, why: str) -> None:
        """Close the connection; what waits on it is answered (a read with what it has and
        ``eof``, writes with ``connection_closed``, an open with ``io_error``)."""
        self._fail_writes(conn, f"connection {conn.cid} was closed ({why})")
        if conn.reader is not None:
            conn.eof = True
            self._answer_read(conn, time.monotonic(), force=True)
        if conn.opener is not None:
            self._fail(conn.opener.rid, "io_error", f"connection to port {conn.port}: {why}")
            conn.opener = None
        self._forget(conn)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _port(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise AgentError("invalid_request", "'port' must be a port number from 1 to 65535")
    return value


def _conn_id(req: Header) -> int:
    value = req.get("conn")
    if not isinstance(value, int) or isinstance(value, bool):
        raise AgentError("invalid_request", "'conn' must be an integer")
    return value


def _limit(req: Header) -> int:
    value = req.get("max", DEFAULT_READ_BYTES)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_READ_BYTES:
        raise AgentError("invalid_request", f"'max' must be bytes from 1 to {MAX_READ_BYTES}")
    return value


def _number(req: Header, name: str, default: float, high: float, *, low: float = 0.0) -> float:
    value = req.get(name)
    if value is None:
        return default
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise AgentError(
            "invalid_request", f"'{name}' must be a number of seconds from {low:g} to {high:g}"
        )
    return float(value)
