"""Background processes and terminals of the agent (docs/agent-protocol.md, last section).

Standard library only, deployed next to the agent (main.py) and imported by it on the first
``proc_*``/``pty_*`` request, so an agent that never starts one pays nothing for it. The agent
hands its helpers in (error class, environment and cwd builders, executable lookup) when it
creates the one ``Registry``; nothing here imports the agent.

Every process or terminal gets one daemon thread (its "pump") that reads its output into a
bounded buffer, reaps it, applies its timeout and closes its pipes; requests only look at that
buffer, so any number of followers can long-poll one process, each on its own thread.

Notes on behaviour the protocol leaves open:

* ``proc_signal`` sends to the process group (``os.killpg``), so children of the command that
  stayed in its group are signalled too; it still works after the command itself exited while
  something of its session remains. A terminal's group is its shell's; typing ``\\x03`` is the
  way to interrupt its foreground job.
* ``pty_close`` and the agent's exit reach every process group of the session (terminals run
  jobs in groups of their own), found by scanning ``/proc``.
* Output is kept in chunks of one stream; when a process alternates tiny writes on stdout and
  stderr the buffer may hold fewer than ``PROCESS_BUFFER_BYTES`` (at most ``MAX_CHUNKS``
  chunks), which keeps its bookkeeping bounded.
* ``proc_list`` lists terminals too, with ``terminal: true``.
* A write to stdin or a terminal fails with ``io_error`` once the process has read nothing for
  ``WRITE_STALL_SECONDS`` (the message says how many bytes went in).
* stdin (a write or a close) of a process that has exited, or whose pipe broke because it just
  exited, answers ``process_exited``; a write to a running process that closed its stdin
  answers ``conflict``. Both are the caller's conflict, not a failure of the agent.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

Header = dict[str, Any]

PROCESS_BUFFER_BYTES = 1 << 20  # output kept per process
MAX_ANSWER_BYTES = 1 << 20  # output sent in one proc_read/pty_read answer
MAX_PROCESSES = 256  # processes and terminals remembered per agent
MAX_CHUNKS = 4096  # chunks kept per process (see the module docstring)
MERGE_BYTES = 64 << 10  # output of one stream is appended to the last chunk up to this size
READ_CHUNK = 64 << 10
MAX_WAIT = 30.0  # seconds a read may wait for output
EXIT_GRACE = 0.1  # seconds of output still read after the process itself exited
TIMEOUT_EXIT_CODE = 124
PTY_KILL_DELAY = 1.0  # pty_close: seconds between SIGHUP and SIGKILL
WRITE_STALL_SECONDS = 30.0
BROKEN_PIPE_REAP_WAIT = 0.2  # seconds an EPIPE waits to learn whether the reader exited
SPAWN_TIMEOUT = 10.0  # seconds a forked terminal child may take to exec
PTY_DEFAULT_SIZE = (80, 24)  # cols, rows

STREAMS = ("stdout", "stderr")


class _Child(Protocol):
    """What the pump needs of a child: subprocess.Popen or a forked terminal (_Forked)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...


class _Forked:
    """A child made with os.fork (terminals): reaped with waitpid like Popen.poll does."""

    __slots__ = ("pid", "returncode")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: the status is lost
                self.returncode = 255
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class _Chunk:
    __slots__ = ("data", "start", "stream")

    def __init__(self, stream: str, start: int, data: bytes) -> None:
        self.stream = stream
        self.start = start  # offset of data[0] in everything the process wrote
        self.data = bytearray(data)


class _Output:
    """The most recent output of one process, and the followers waiting for more."""

    __slots__ = ("chunks", "cond", "done", "end", "size")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.chunks: deque[_Chunk] = deque()
        self.end = 0  # offset just past the last byte ever written
        self.size = 0  # bytes buffered: they are [end - size, end)
        self.done = False  # the process exited and its output was read to the end

    def append(self, stream: str, data: bytes) -> None:
        with self.cond:
            last = self.chunks[-1] if self.chunks else None
            if last is not None and last.stream == stream and len(last.data) < MERGE_BYTES:
                last.data += data
            else:
                self.chunks.append(_Chunk(stream, self.end, data))
            self.end += len(data)
            self.size += len(data)
            self._trim()
            self.cond.notify_all()

    def _trim(self) -> None:
        excess = self.size - PROCESS_BUFFER_BYTES
        while excess > 0 or len(self.chunks) > MAX_CHUNKS:
            head = self.chunks[0]
            if len(head.data) <= excess or len(self.chunks) > MAX_CHUNKS:
                self.chunks.popleft()
                self.size -= len(head.data)
                excess -= len(head.data)
            else:
                del head.data[:excess]
                head.start += excess
                self.size -= excess
                excess = 0

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def read(self, offset: int, wait: float) -> tuple[list[list[Any]], bytes, int, int, bool]:
        """(chunks, payload, next_offset, first_offset, everything read) from ``offset``.

        Blocks up to ``wait`` seconds for output past ``offset`` or the end of the process.
        """
        deadline = time.monotonic() + wait
        with self.cond:
            while True:
                first = self.end - self.size
                start = max(offset, first)
                if start < self.end:
                    chunks, payload, end = self._collect(start)
                    return chunks, payload, end, first, self.done and end == self.end
                if self.done:
                    return [], b"", self.end, first, True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return [], b"", self.end, first, False
                self.cond.wait(remaining)

    def _collect(self, start: int) -> tuple[list[list[Any]], bytes, int]:
        chunks: list[list[Any]] = []
        parts: list[bytes] = []
        position = start
        room = MAX_ANSWER_BYTES
        for chunk in self.chunks:
            skip = position - chunk.start
            if skip >= len(chunk.data):
                continue
            part = bytes(chunk.data[skip : skip + room])
            if chunks and chunks[-1][0] == chunk.stream:
                chunks[-1][1] += len(part)
            else:
                chunks.append([chunk.stream, len(part)])
            parts.append(part)
            position += len(part)
            room -= len(part)
            if not room:
                break
        return chunks, b"".join(parts), position


class _Entry:
    """One background process or terminal."""

    __slots__ = (
        "child",
        "command",
        "deadline",
        "exit_code",
        "exited_at",
        "exited_mono",
        "finished",
        "lingering",
        "lock",
        "output",
        "pid",
        "started_at",
        "stdin_closed",
        "terminal",
        "timed_out",
        "wlock",
        "write_fd",
    )

    def __init__(
        self,
        child: _Child,
        command: str,
        write_fd: int,
        *,
        terminal: bool,
        deadline: float | None = None,
    ) -> None:
        self.child = child
        self.pid = child.pid
        self.command = command
        self.terminal = terminal
        self.deadline = deadline  # monotonic time of the timeout, if any
        self.started_at = _iso_now()
        self.output = _Output()
        self.lock = threading.Lock()  # reaping, signals
        self.wlock = threading.Lock()  # write_fd: writes, resizes, closing
        self.write_fd: int | None = write_fd  # stdin pipe or terminal master
        self.stdin_closed = False  # closed by proc_stdin
        self.timed_out = False
        self.exit_code: int | None = None
        self.exited_at: str | None = None
        self.exited_mono = 0.0
        self.finished = False  # the pump is done: no more output, write_fd closing
        # Whether something of the session may still run after the command exited: until the
        # pump has looked (after reaping), assume so. Signals are sent only while it is
        # running or lingering, so that a recycled pid is never signalled.
        self.lingering = True

    @property
    def alive(self) -> bool:
        return self.child.returncode is None or self.lingering

    def reap(self) -> bool:
        """Collect the exit status if the command exited; True once it has."""
        with self.lock:
            if self.exit_code is not None:
                return True
            returncode = self.child.poll()
            if returncode is None:
                return False
            if self.timed_out:
                self.exit_code = TIMEOUT_EXIT_CODE
            elif returncode < 0:  # killed by a signal: report it the way a shell does
                self.exit_code = 128 - returncode
            else:
                self.exit_code = returncode
            self.exited_at = _iso_now()
            self.exited_mono = time.monotonic()
            return True

    def wait(self) -> None:
        """Reap the command, however long it takes to die (after a SIGKILL)."""
        while not self.reap():
            time.sleep(0.01)

    def signal_group(self, signum: int) -> None:
        with self.lock:
            if self.alive:
                _killpg(self.pid, signum)

    def signal_session(self, signum: int) -> None:
        with self.lock:
            if self.alive:
                for pgid in _session_groups({self.pid}) | {self.pid}:
                    _killpg(pgid, signum)

    def describe(self) -> Header:
        return {
            "pid": self.pid,
            "command": self.command,
            "state": "running" if self.exit_code is None else "exited",
            "exit_code": self.exit_code,
            "started_at": self.started_at,
            "exited_at": self.exited_at,
            "terminal": self.terminal,
        }


class Registry:
    """The processes and terminals of one agent, and the requests on them."""

    def __init__(
        self,
        *,
        error: type[Exception],
        env: Callable[[Header], dict[str, str]],
        cwd: Callable[[Header], str],
        which: Callable[[str], str],
    ) -> None:
        """``error(code, message)`` is raised for protocol errors; ``env``/``cwd`` build a
        command's environment and real working directory from a request (as exec does);
        ``which`` finds an executable or raises ``error``."""
        self._error = error
        self._env = env
        self._cwd = cwd
        self._which = which
        self._lock = threading.RLock()  # re-entered when a signal arrives during shutdown
        self._entries: dict[int, _Entry] = {}
        # process groups of forgotten entries whose children outlived them
        self._orphans: set[int] = set()
        self._closing = False
        self._handlers: dict[str, Callable[[Header, bytes], tuple[Header, bytes]]] = {
            "proc_start": self._proc_start,
            "proc_list": self._proc_list,
            "proc_read": self._proc_read,
            "proc_stdin": self._proc_stdin,
            "proc_signal": self._proc_signal,
            "pty_open": self._pty_open,
            "pty_read": self._pty_read,
            "pty_write": self._pty_write,
            "pty_resize": self._pty_resize,
            "pty_close": self._pty_close,
        }

    def handle(self, op: str, req: Header, payload: bytes) -> tuple[Header, bytes]:
        handler = self._handlers.get(op)
        if handler is None:
            raise self._error("invalid_request", f"unknown op {op!r}")
        return handler(req, payload)

    def shutdown(self) -> None:
        """Kill every process group of every session started here (the agent is exiting)."""
        got = self._lock.acquire(timeout=2.0)  # never hang the exit on a stuck start
        try:
            self._closing = True
            entries = list(self._entries.values())
            orphans = set(self._orphans)
        finally:
            if got:
                self._lock.release()
        running = {entry.pid for entry in entries if entry.child.returncode is None}
        sessions = {entry.pid for entry in entries if entry.alive} | orphans
        for pgid in _session_groups(sessions) | running | orphans:
            _killpg(pgid, signal.SIGKILL)

    # ----------------------------------------------------------------------- fields

    def _invalid(self, message: str) -> Exception:
        return self._error("invalid_request", message)

    def _int(self, req: Header, name: str, low: int, high: int, default: int | None = None) -> int:
        value = req.get(name)
        if value is None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise self._invalid(f"{name!r} must be an integer from {low} to {high}")
        return value

    def _timeout(self, req: Header) -> float | None:
        value = req.get("timeout")
        if value is None:
            return None
        if not _is_number(value) or not 0 < value < math.inf:
            raise self._invalid("'timeout' must be a positive number of seconds or null")
        return float(value)

    def _wait(self, req: Header) -> float:
        value = req.get("wait")
        if value is None:
            return 0.0
        if not _is_number(value) or not 0 <= value <= MAX_WAIT:
            raise self._invalid(f"'wait' must be a number of seconds from 0 to {MAX_WAIT:g}")
        return float(value)

    def _command(self, req: Header, *, required: bool) -> str | None:
        value = req.get("command")
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self._invalid("'command' must be a non-empty string")
        if "\x00" in value:
            raise self._invalid("'command' contains a NUL byte")
        return value

    def _environment(self, req: Header, extra: dict[str, str]) -> dict[str, str]:
        env = self._env(req)
        requested = req.get("env") or {}
        for name, value in extra.items():
            if name not in requested:
                env[name] = value
        return env

    def _shell(self) -> str:
        try:
            return self._which("bash")
        except self._error:
            return self._which("sh")

    def _entry(self, req: Header, *, terminal: bool | None) -> _Entry:
        """The entry of the request's pid; ``terminal``: whether it must be one (None: any)."""
        pid = req.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise self._invalid("'pid' must be an integer")
        with self._lock:
            entry = self._entries.get(pid)
        if entry is None:
            raise self._error("not_found", f"no process or terminal with pid {pid}")
        if terminal is not None and entry.terminal != terminal:
            if entry.terminal:
                raise self._invalid(f"{pid} is a terminal: use the pty_* operations")
            raise self._invalid(f"{pid} is not a terminal: use the proc_* operations")
        return entry

    # ----------------------------------------------------------------------- registry

    def _admit(self) -> None:
        """Make room for one more (lock held): forget the oldest exited ones, or refuse."""
        if self._closing:
            raise self._error("io_error", "the agent is shutting down")
        for pgid in list(self._orphans):
            if not _group_exists(pgid):
                self._orphans.discard(pgid)
        if len(self._entries) < MAX_PROCESSES:
            return
        exited = [entry for entry in self._entries.values() if entry.exit_code is not None]
        if not exited:
            raise self._error(
                "io_error", f"too many processes: {MAX_PROCESSES} are running (the limit)"
            )
        exited.sort(key=lambda entry: entry.exited_mono)
        for entry in exited[: len(self._entries) - MAX_PROCESSES + 1]:
            del self._entries[entry.pid]
            if entry.lingering:  # still killed at exit
                self._orphans.add(entry.pid)

    def _launch(self, entry: _Entry, read_fds: dict[int, str]) -> None:
        """Remember a started child and start its pump (lock held)."""
        self._entries.pop(entry.pid, None)  # a recycled pid: the new process takes it over
        self._entries[entry.pid] = entry
        try:
            threading.Thread(
                target=self._pump, args=(entry, read_fds), name=f"pump-{entry.pid}", daemon=True
            ).start()
        except BaseException:
            del self._entries[entry.pid]
            _killpg(entry.pid, signal.SIGKILL)
            _close_all(fd for fd in read_fds if fd != entry.write_fd)
            with entry.wlock:
                _close_write_fd(entry)
            entry.wait()
            raise

    # ----------------------------------------------------------------------- processes

    def _proc_start(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        import subprocess

        command = self._command(req, required=True)
        assert command is not None
        timeout = self._timeout(req)
        env = self._environment(req, {"PYTHONUNBUFFERED": "1"})
        cwd = self._cwd(req)
        argv = [self._shell(), "-c", command]
        with self._lock:
            self._admit()
            pipes: list[int] = []
            try:
                for _ in range(3):
                    pipes.extend(os.pipe())
                in_r, in_w, out_r, out_w, err_r, err_w = pipes
                started = time.monotonic()
                child = subprocess.Popen(
                    argv,
                    stdin=in_r,
                    stdout=out_w,
                    stderr=err_w,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                )
            except BaseException:
                for fd in pipes:
                    os.close(fd)
                raise
            for fd in (in_r, out_w, err_w):
                os.close(fd)
            os.set_blocking(in_w, False)
            deadline = None if timeout is None else started + timeout
            entry = _Entry(child, command, in_w, terminal=False, deadline=deadline)
            self._launch(entry, {out_r: "stdout", err_r: "stderr"})
        return {"pid": entry.pid, "started_at": entry.started_at}, b""

    def _proc_list(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        with self._lock:
            entries = list(self._entries.values())
        return {"processes": [entry.describe() for entry in entries]}, b""

    def _read(self, req: Header, *, terminal: bool) -> tuple[Header, bytes]:
        entry = self._entry(req, terminal=terminal)
        offset = self._int(req, "offset", 0, 1 << 62)
        wait = self._wait(req)
        if offset > entry.output.end:  # end only grows: a later look cannot make it valid
            raise self._invalid(f"'offset' {offset} is past the end of the output")
        chunks, payload, next_offset, first_offset, exited = entry.output.read(offset, wait)
        header = {
            "chunks": chunks,
            "next_offset": next_offset,
            "first_offset": first_offset,
            "exited": exited,
            "exit_code": entry.exit_code if exited else None,
        }
        return header, payload

    def _proc_read(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        return self._read(req, terminal=False)

    def _proc_stdin(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        entry = self._entry(req, terminal=False)
        close = req.get("close", False)
        if not isinstance(close, bool):
            raise self._invalid("'close' must be a boolean")
        with entry.wlock:
            if entry.stdin_closed:
                raise self._invalid(f"the stdin of process {entry.pid} was closed")
            if entry.reap():  # its stdin went with it, even while the pump still reads
                raise self._exited(entry, "process", 0, len(payload))
            self._write_locked(entry, payload, "process")
            if close:
                _close_write_fd(entry)
                entry.stdin_closed = True
        return {"written": len(payload)}, b""

    def _proc_signal(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        entry = self._entry(req, terminal=None)
        entry.signal_group(self._signal_number(req.get("signal")))
        return {}, b""

    def _signal_number(self, value: Any) -> int:
        if isinstance(value, str):
            name = value.strip().upper()
            if not name.startswith("SIG"):
                name = "SIG" + name
            try:
                return int(signal.Signals[name])
            except KeyError:
                raise self._invalid(f"unknown signal {value!r}") from None
        if isinstance(value, int) and not isinstance(value, bool):
            if value in signal.valid_signals():
                return value
            raise self._invalid(f"unknown signal number {value}")
        raise self._invalid("'signal' must be a signal name (SIGTERM or TERM) or a number")

    def _write_locked(self, entry: _Entry, data: bytes, what: str) -> None:
        """Write all of ``data`` to the entry's stdin or terminal (wlock held)."""
        import select

        view = memoryview(data)
        progress = time.monotonic()
        while True:
            fd = entry.write_fd
            if fd is None:
                raise self._exited(entry, what, len(data) - len(view), len(data))
            if not view:
                return
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                written = 0
            except BrokenPipeError:  # nobody reads the pipe any more
                raise self._broken(entry, what, len(data) - len(view), len(data)) from None
            if written:
                view = view[written:]
                progress = time.monotonic()
                continue
            if entry.finished:
                raise self._exited(entry, what, len(data) - len(view), len(data))
            if time.monotonic() - progress > WRITE_STALL_SECONDS:
                done = len(data) - len(view)
                raise self._error(
                    "io_error",
                    f"{what} {entry.pid} read nothing for {WRITE_STALL_SECONDS:.0f} s: "
                    f"{done} of {len(data)} bytes were written",
                )
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            poller.poll(100)

    def _exited(self, entry: _Entry, what: str, done: int, size: int) -> Exception:
        """``process_exited``: the caller's conflict (the process is gone), not an IO failure."""
        code = "" if entry.exit_code is None else f" (exit code {entry.exit_code})"
        went_in = f"; {done} of {size} bytes were written" if done else ""
        return self._error(
            "process_exited",
            f"{what} {entry.pid} has exited{code}: it reads no more input{went_in}; "
            "start a new one to send it input",
        )

    def _broken(self, entry: _Entry, what: str, done: int, size: int) -> Exception:
        """The write end of a pipe nobody reads (EPIPE): the process exited, or closed it."""
        # the kernel closes an exiting process's files before its parent can reap it
        deadline = time.monotonic() + BROKEN_PIPE_REAP_WAIT
        while not entry.reap() and time.monotonic() < deadline:
            time.sleep(0.005)
        if entry.exit_code is not None:
            return self._exited(entry, what, done, size)
        went_in = f" ({done} of {size} bytes were written)" if done else ""
        return self._error(
            "conflict",
            f"{what} {entry.pid} closed its stdin and still runs: it reads no more "
            f"input{went_in}; signal it or start a new process",
        )

    # ----------------------------------------------------------------------- terminals

    def _pty_open(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        import fcntl
        import struct
        import termios

        command = self._command(req, required=False)
        cols = self._int(req, "cols", 1, 0xFFFF, PTY_DEFAULT_SIZE[0])
        rows = self._int(req, "rows", 1, 0xFFFF, PTY_DEFAULT_SIZE[1])
        env = self._environment(req, {"PYTHONUNBUFFERED": "1", "TERM": "xterm-256color"})
        cwd = self._cwd(req)
        if command is not None:
            argv = [self._shell(), "-c", command]
        else:
            try:
                argv = [self._which("bash"), "-l"]
                command = "bash -l"
            except self._error:
                argv = [self._which("sh")]
                command = "sh"
        with self._lock:
            self._admit()
            master, slave = os.openpty()
            try:
                fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                pid = _fork_terminal(slave, argv, env, cwd)
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            os.set_blocking(master, False)
            entry = _Entry(_Forked(pid), command, master, terminal=True)
            self._launch(entry, {master: "pty"})
        return {"pid": entry.pid, "started_at": entry.started_at}, b""

    def _pty_read(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        return self._read(req, terminal=True)

    def _pty_write(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        entry = self._entry(req, terminal=True)
        with entry.wlock:
            self._write_locked(entry, payload, "terminal")
        return {"written": len(payload)}, b""

    def _pty_resize(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        import fcntl
        import struct
        import termios

        entry = self._entry(req, terminal=True)
        cols = self._int(req, "cols", 1, 0xFFFF)
        rows = self._int(req, "rows", 1, 0xFFFF)
        with entry.wlock:
            if entry.write_fd is None:
                raise self._exited(entry, "terminal", 0, 0)
            # the kernel sends SIGWINCH to the terminal's foreground process group
            size = struct.pack("HHHH", rows, cols, 0, 0)
            fcntl.ioctl(entry.write_fd, termios.TIOCSWINSZ, size)
        return {}, b""

    def _pty_close(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        entry = self._entry(req, terminal=True)
        if entry.alive:
            entry.signal_session(signal.SIGHUP)
            entry.signal_session(signal.SIGCONT)  # stopped jobs get the hangup too
            timer = threading.Timer(PTY_KILL_DELAY, entry.signal_session, (signal.SIGKILL,))
            timer.daemon = True
            timer.start()
        # the pump closes the master once the shell has exited (and its grace period passed)
        return {}, b""

    # ----------------------------------------------------------------------- the pump

    def _pump(self, entry: _Entry, read_fds: dict[int, str]) -> None:
        """Read the output until the process exited (plus a grace period), then reap it."""
        try:
            self._pump_output(entry, read_fds)
        except BaseException as exc:  # never leave followers waiting forever
            _log(f"process {entry.pid}: reading its output failed: {exc!r}")
        finally:
            _close_all(fd for fd in read_fds if fd != entry.write_fd)
            if not entry.reap():
                _killpg(entry.pid, signal.SIGKILL)
                entry.wait()
            entry.finished = True
            with entry.wlock:  # writers give up within 100 ms once finished is set
                _close_write_fd(entry)
            entry.output.finish()
            lingering = bool(_session_groups({entry.pid}))
            with entry.lock:
                entry.lingering = lingering

    def _pump_output(self, entry: _Entry, read_fds: dict[int, str]) -> None:
        import selectors

        selector = selectors.DefaultSelector()
        for fd in read_fds:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        pidfd = _pidfd_open(entry.pid)
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ)
        open_fds = len(read_fds)
        exited_at: float | None = None
        try:
            while True:
                now = time.monotonic()
                if exited_at is None and entry.reap():
                    exited_at = now
                wait: float | None
                if exited_at is not None:
                    if not open_fds or now >= exited_at + EXIT_GRACE:
                        return
                    wait = exited_at + EXIT_GRACE - now
                elif entry.timed_out:
                    wait = 0.05
                elif entry.deadline is not None and now >= entry.deadline:
                    with entry.lock:
                        entry.timed_out = True
                        _killpg(entry.pid, signal.SIGKILL)
                    wait = 0.05
                elif entry.deadline is not None:
                    wait = entry.deadline - now
                else:
                    wait = None
                if pidfd is None:
                    wait = 0.05 if wait is None else min(wait, 0.05)
                for key, _events in selector.select(wait):
                    fd = key.fd
                    if fd == pidfd:
                        selector.unregister(fd)
                        os.close(fd)
                        pidfd = None  # exited: reap() above picks up the status
                        continue
                    try:
                        data = os.read(fd, READ_CHUNK)
                    except BlockingIOError:
                        continue
                    except OSError as exc:
                        if exc.errno != errno.EIO:  # EIO: a terminal's last slave fd closed
                            raise
                        data = b""
                    if data:
                        entry.output.append(read_fds[fd], data)
                    else:
                        selector.unregister(fd)
                        open_fds -= 1
        finally:
            selector.close()
            if pidfd is not None:
                os.close(pidfd)


# --------------------------------------------------------------------------- helpers


def _log(message: str) -> None:
    import sys

    try:
        sys.stderr.write(f"sandgate-agent[{os.getpid()}]: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _iso_now() -> str:
    seconds, nanos = divmod(time.time_ns(), 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos // 1000:06d}Z"


def _killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the id was recycled by someone else's group
        return False
    return True


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _close_write_fd(entry: _Entry) -> None:
    """Close the stdin pipe or terminal master (wlock held)."""
    fd, entry.write_fd = entry.write_fd, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _session_groups(sessions: set[int]) -> set[int]:
    """The process groups of every process in these sessions (by scanning /proc)."""
    groups: set[int] = set()
    if not sessions:
        return groups
    try:
        names = os.listdir("/proc")
    except OSError:
        return groups
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            if os.getsid(pid) in sessions:
                groups.add(os.getpgid(pid))
        except OSError:  # gone meanwhile
            continue
    return groups


def _pidfd_open(pid: int) -> int | None:
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd: int = pidfd_open(pid)
    except OSError:
        return None
    return fd


def _fork_terminal(slave: int, argv: list[str], env: dict[str, str], cwd: str) -> int:
    """Fork a child that takes ``slave`` as its controlling terminal and execs ``argv``.

    subprocess cannot make a terminal the controlling one (preexec_fn is unsafe in a threaded
    process), so this forks and execs at once; the child does nothing else. Exec failures come
    back through a close-on-exec pipe, as with subprocess.
    """
    import select

    error_r, error_w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the child: no locks, nothing but the calls below
            try:
                for signum in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT):
                    signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, ())
                os.login_tty(slave)  # setsid, TIOCSCTTY, stdin/stdout/stderr
                os.chdir(cwd)
                os.execve(argv[0], argv, env)
            except BaseException as exc:
                code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EINVAL
                try:
                    os.write(error_w, str(code).encode())
                finally:
                    os._exit(127)
            os._exit(127)  # not reached
    finally:
        os.close(error_w)
    try:
        poller = select.poll()
        poller.register(error_r, select.POLLIN)
        if not poller.poll(SPAWN_TIMEOUT * 1000):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise OSError(errno.ETIMEDOUT, "the terminal's command did not start")
        report = os.read(error_r, 32)
    finally:
        os.close(error_r)
    if report:  # the exec failed: the child exited
        os.waitpid(pid, 0)
        code = int(report)
        raise OSError(code, f"cannot start the terminal's command: {os.strerror(code)}")
    return pid
