"""Background processes and terminals of the agent (docs/agent-protocol.md, last section).

Standard library only, deployed next to the agent (main.py) and imported by it, with
children.py (one process or terminal) and output.py (its output buffer), on the first
``proc_*``/``pty_*`` request, so an agent that never starts one pays nothing for it. The agent
hands its helpers in (environment and cwd builders, executable lookup: exec's, execute.py)
when it creates the one ``Registry``, kept in its ``AgentState``.

Every process or terminal gets one daemon thread that runs the agent's one output pump
(pump.py) into a bounded buffer, reaps it, applies its timeout and closes its pipes; requests
only look at that buffer, so any number of followers can long-poll one process, each on its
own thread.

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

import math
import os
import signal
import sys
import threading
import time
from functools import partial

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable
    from typing import Any

    from sandgate.agent import pump, warm
    from sandgate.agent.children import (
        Entry,
        Forked,
        close_all,
        close_write_fd,
        fork_terminal,
        group_exists,
        killpg,
        on_pipes,
        popen,
        session_groups,
    )
    from sandgate.agent.log import log
    from sandgate.agent.orphans import Reaper
    from sandgate.agent.request import AgentError, Header, start_thread
else:
    import pump
    import warm
    from children import (
        Entry,
        Forked,
        close_all,
        close_write_fd,
        fork_terminal,
        group_exists,
        killpg,
        on_pipes,
        popen,
        session_groups,
    )
    from log import log
    from orphans import Reaper
    from request import AgentError, start_thread

MAX_PROCESSES = 256  # processes and terminals remembered per agent
MAX_WAIT = 30.0  # seconds a read may wait for output
MAX_LINGER = 1.0  # seconds a read with output may wait more for the process to end
# programs deployed beside the agent (sandgate.agent.PROGRAMS) that proc_start may run by name,
# with the agent's own Python (without -S: the program may use the sandbox's packages)
PROGRAMS = ("kernel_bridge",)
PTY_KILL_DELAY = 1.0  # pty_close: seconds between SIGHUP and SIGKILL
WRITE_STALL_SECONDS = 30.0
BROKEN_PIPE_REAP_WAIT = 0.2  # seconds an EPIPE waits to learn whether the reader exited
PTY_DEFAULT_SIZE = (80, 24)  # cols, rows


class Registry:
    """The processes and terminals of one agent, and the requests on them."""

    def __init__(
        self,
        *,
        env: Callable[[Header], dict[str, str]],
        cwd: Callable[[Header], str],
        which: Callable[[str], str],
        python: tuple[str, ...] = (),
        reaper: Reaper | None = None,
        shells: warm.Warm | None = None,
    ) -> None:
        """``env``/``cwd`` build a command's environment and real working directory from a
        request (as exec does); ``which`` finds an executable or raises ``AgentError``;
        ``python`` runs the programs deployed beside the agent (default: its own Python);
        ``reaper`` is the agent's spawn guard (orphans.py; default: one of this registry's);
        ``shells``: the agent's shell started ahead of the next command (warm.py), which a
        short shell command takes instead of a spawn (None: always spawn)."""
        self._reaper = reaper if reaper is not None else Reaper(os.getpid())
        self._shells = shells
        self._env = env
        self._cwd = cwd
        self._which = which
        self._python = python or (sys.executable,)
        self._lock = threading.RLock()  # re-entered when a signal arrives during shutdown
        self._entries: dict[int, Entry] = {}
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
            raise AgentError("invalid_request", f"unknown op {op!r}")
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
        for pgid in session_groups(sessions) | running | orphans:
            killpg(pgid, signal.SIGKILL)

    # ----------------------------------------------------------------------- fields

    def _invalid(self, message: str) -> Exception:
        return AgentError("invalid_request", message)

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

    def _wait(self, req: Header, name: str = "wait", most: float = MAX_WAIT) -> float:
        value = req.get(name)
        if value is None:
            return 0.0
        if not _is_number(value) or not 0 <= value <= most:
            raise self._invalid(f"{name!r} must be a number of seconds from 0 to {most:g}")
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

    def _argv(self, req: Header) -> list[str] | None:
        """``argv``: a program and its arguments, run as given (instead of ``command``)."""
        value = req.get("argv")
        if value is None:
            return None
        if (
            not isinstance(value, list)
            or not value
            or len(value) > 4096
            or not all(isinstance(arg, str) and "\x00" not in arg for arg in value)
            or not value[0]
        ):
            raise self._invalid("'argv' must be a non-empty list of strings without NUL bytes")
        return value

    def _tag(self, req: Header) -> str | None:
        value = req.get("tag")
        if value is None:
            return None
        if not isinstance(value, str) or not 0 < len(value) <= 128 or "\x00" in value:
            raise self._invalid("'tag' must be a string of 1 to 128 characters")
        return value

    def _refuse_tag_in_use(self, tag: str | None) -> None:
        """At most one running process has a tag (lock held): what names it is unique."""
        if tag is None:
            return
        for entry in self._entries.values():
            if entry.tag == tag and entry.exit_code is None and not entry.reap():
                raise AgentError("exists", f"process {entry.pid} is running with tag {tag!r}")

    def _program(self, name: str) -> str:
        """A program named by path is run as it is; a bare name is looked up on PATH."""
        return name if "/" in name else self._which(name)

    def _asked(self, req: Header, argv: list[str] | None) -> dict[str, Any]:
        """What the request asked to run, as ``proc_list`` shows it back."""
        env = req.get("env")
        cwd = req.get("cwd")
        return {
            "argv": argv,
            "cwd": cwd if isinstance(cwd, str) else None,
            "env": dict(env) if isinstance(env, dict) else None,
        }

    def _shell(self) -> str:
        try:
            return self._which("bash")
        except AgentError:
            return self._which("sh")

    def _entry(self, req: Header, *, terminal: bool | None) -> Entry:
        """The entry of the request's pid; ``terminal``: whether it must be one (None: any)."""
        pid = req.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise self._invalid("'pid' must be an integer")
        with self._lock:
            entry = self._entries.get(pid)
        if entry is None:
            raise AgentError("not_found", f"no process or terminal with pid {pid}")
        if terminal is not None and entry.terminal != terminal:
            if entry.terminal:
                raise self._invalid(f"{pid} is a terminal: use the pty_* operations")
            raise self._invalid(f"{pid} is not a terminal: use the proc_* operations")
        return entry

    # ----------------------------------------------------------------------- registry

    def _admit(self) -> None:
        """Make room for one more (lock held): forget the oldest exited ones, or refuse."""
        if self._closing:
            raise AgentError("io_error", "the agent is shutting down")
        for pgid in list(self._orphans):
            if not group_exists(pgid):
                self._orphans.discard(pgid)
        if len(self._entries) < MAX_PROCESSES:
            return
        exited = [entry for entry in self._entries.values() if entry.exit_code is not None]
        if not exited:
            raise AgentError(
                "io_error", f"too many processes: {MAX_PROCESSES} are running (the limit)"
            )
        exited.sort(key=lambda entry: entry.exited_mono)
        for entry in exited[: len(self._entries) - MAX_PROCESSES + 1]:
            del self._entries[entry.pid]
            if entry.lingering:  # still killed at exit
                self._orphans.add(entry.pid)

    def _launch(self, entry: Entry, read_fds: dict[int, str]) -> None:
        """Remember a started child and start its pump (lock held)."""
        self._entries.pop(entry.pid, None)  # a recycled pid: the new process takes it over
        self._entries[entry.pid] = entry
        try:
            start_thread(
                threading.Thread(
                    target=self._pump, args=(entry, read_fds), name=f"pump-{entry.pid}", daemon=True
                )
            )
        except BaseException:
            del self._entries[entry.pid]
            killpg(entry.pid, signal.SIGKILL)
            close_all(fd for fd in read_fds if fd != entry.write_fd)
            with entry.wlock:
                close_write_fd(entry)
            entry.wait()
            raise

    # ----------------------------------------------------------------------- processes

    def _proc_start(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        given = self._argv(req)
        program = req.get("program")
        if program is not None:
            if program not in PROGRAMS:
                raise self._invalid(f"'program' must be one of {', '.join(PROGRAMS)}")
            here = os.path.dirname(os.path.abspath(__file__))
            given = [*self._python, "-I", os.path.join(here, f"{program}.py"), *(given or [])]
        if given is None:
            command = self._command(req, required=True)
            assert command is not None
            argv = [self._shell(), "-c", command]
        else:
            command = " ".join(given)
            argv = [self._program(given[0]), *given[1:]]
        stdin = req.get("stdin", True)
        if not isinstance(stdin, bool):
            raise self._invalid("'stdin' must be a boolean")
        timeout = self._timeout(req)
        wait, linger = self._wait(req), self._wait(req, "linger", MAX_LINGER)
        tag = self._tag(req)
        env = self._environment(req, {"PYTHONUNBUFFERED": "1"})
        cwd = self._cwd(req)
        shell = None if program is not None else warm.shell_command(argv)
        key = None
        if shell is not None and self._shells is not None and warm.eligible_env(env):
            key = (shell[0], cwd, env)
            self._shells.settle(key)  # a shell being started for it: not under our lock
        with self._lock:
            self._admit()
            self._refuse_tag_in_use(tag)
            started = time.monotonic()
            taken = None
            if key is not None and shell is not None and self._shells is not None:
                taken = self._shells.take(key, shell[1], keep_stdin=True)
            if taken is not None:  # its stdin is the pipe the command reads from
                child, in_w, out_r, err_r = taken.proc, taken.feed, taken.out, taken.err
            else:
                child, in_w, out_r, err_r = self._spawn(argv, cwd, env)
            os.set_blocking(in_w, False)
            deadline = None if timeout is None else started + timeout
            entry = Entry(
                child,
                command,
                in_w,
                terminal=False,
                deadline=deadline,
                tag=tag,
                **self._asked(req, given),
            )
            if not stdin:  # the command reads end-of-file at once
                close_write_fd(entry)
                entry.stdin_closed = True
            self._launch(entry, {out_r: "stdout", err_r: "stderr"})
        answer: Header = {"pid": entry.pid, "started_at": entry.started_at}
        header: Header | None = None
        output = b""
        if wait:  # the first output (and, for a short command, its exit) in the same answer
            header, output = self._page(entry, 0, wait, linger)
        if key is not None and self._shells is not None and not (header and header["exited"]):
            self._shells.unwant(key)  # still running: the next shell starts after a later one
        if header is None:
            return answer, b""
        return {**answer, "output": header}, output

    def _spawn(
        self, argv: list[str], cwd: str, env: dict[str, str]
    ) -> tuple[subprocess.Popen[bytes], int, int, int]:
        """Start ``argv`` on three pipes (children.on_pipes)."""
        make_room = None if self._shells is None else self._shells.make_room

        def start(stdin: int, stdout: int, stderr: int) -> subprocess.Popen[bytes]:
            with self._reaper.spawning():  # never waited for by the reaper (orphans.py)
                child = popen(
                    argv, make_room, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, env=env
                )
                self._reaper.own(child.pid)
            return child

        return on_pipes(start)

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
        return self._page(entry, offset, wait, self._wait(req, "linger", MAX_LINGER))

    def _page(self, entry: Entry, offset: int, wait: float, linger: float) -> tuple[Header, bytes]:
        chunks, payload, next_offset, first_offset, exited = entry.output.read(offset, wait, linger)
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
        entry = self._tagged(req) if "tag" in req else self._entry(req, terminal=False)
        close = req.get("close", False)
        if not isinstance(close, bool):
            raise self._invalid("'close' must be a boolean")
        with entry.wlock:
            if entry.stdin_closed:
                raise self._invalid(f"the stdin of process {entry.pid} was closed")
            if entry.reap():  # its stdin went with it, even while the pump still reads
                raise self._exited(entry, "process", 0, len(payload))
            # what it answers to this input is written past here (a reader starts there)
            output_end = entry.output.end
            self._write_locked(entry, payload, "process")
            if close:
                close_write_fd(entry)
                entry.stdin_closed = True
        return {"written": len(payload), "pid": entry.pid, "output_end": output_end}, b""

    def _tagged(self, req: Header) -> Entry:
        """The running process with the request's tag (instead of a pid)."""
        tag = self._tag(req)
        with self._lock:
            for entry in self._entries.values():
                if entry.tag == tag and entry.exit_code is None and not entry.terminal:
                    return entry
        raise AgentError("not_found", f"no running process is tagged {tag!r}")

    def _proc_signal(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        entry = self._entry(req, terminal=None)
        return {"running": entry.signal_group(self._signal_number(req.get("signal")))}, b""

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

    def _write_locked(self, entry: Entry, data: bytes, what: str) -> None:
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
                raise AgentError(
                    "io_error",
                    f"{what} {entry.pid} read nothing for {WRITE_STALL_SECONDS:.0f} s: "
                    f"{done} of {len(data)} bytes were written",
                )
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            poller.poll(100)

    def _exited(self, entry: Entry, what: str, done: int, size: int) -> Exception:
        """``process_exited``: the caller's conflict (the process is gone), not an IO failure."""
        code = "" if entry.exit_code is None else f" (exit code {entry.exit_code})"
        went_in = f"; {done} of {size} bytes were written" if done else ""
        return AgentError(
            "process_exited",
            f"{what} {entry.pid} has exited{code}: it reads no more input{went_in}; "
            "start a new one to send it input",
        )

    def _broken(self, entry: Entry, what: str, done: int, size: int) -> Exception:
        """The write end of a pipe nobody reads (EPIPE): the process exited, or closed it."""
        # the kernel closes an exiting process's files before its parent can reap it
        deadline = time.monotonic() + BROKEN_PIPE_REAP_WAIT
        while not entry.reap() and time.monotonic() < deadline:
            time.sleep(0.005)
        if entry.exit_code is not None:
            return self._exited(entry, what, done, size)
        went_in = f" ({done} of {size} bytes were written)" if done else ""
        return AgentError(
            "conflict",
            f"{what} {entry.pid} closed its stdin and still runs: it reads no more "
            f"input{went_in}; signal it or start a new process",
        )

    # ----------------------------------------------------------------------- terminals

    def _pty_open(self, req: Header, payload: bytes) -> tuple[Header, bytes]:
        import fcntl
        import struct
        import termios

        given = self._argv(req)
        command = None if given is not None else self._command(req, required=False)
        cols = self._int(req, "cols", 1, 0xFFFF, PTY_DEFAULT_SIZE[0])
        rows = self._int(req, "rows", 1, 0xFFFF, PTY_DEFAULT_SIZE[1])
        env = self._environment(req, {"PYTHONUNBUFFERED": "1", "TERM": "xterm-256color"})
        cwd = self._cwd(req)
        if given is not None:
            argv = [self._program(given[0]), *given[1:]]
            command = " ".join(given)
        elif command is not None:
            argv = [self._shell(), "-c", command]
        else:
            try:
                argv = [self._which("bash"), "-l"]
                command = "bash -l"
            except AgentError:
                argv = [self._which("sh")]
                command = "sh"
        with self._lock:
            self._admit()
            master, slave = os.openpty()
            try:
                fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                pid = fork_terminal(slave, argv, env, cwd, self._reaper)
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            os.set_blocking(master, False)
            entry = Entry(Forked(pid), command, master, terminal=True, **self._asked(req, given))
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
            try:
                timer.start()
            except RuntimeError:  # no thread to wait with (the pids limit): no grace either
                entry.signal_session(signal.SIGKILL)
        # the pump closes the master once the shell has exited (and its grace period passed)
        return {}, b""

    # ----------------------------------------------------------------------- output

    def _pump(self, entry: Entry, read_fds: dict[int, str]) -> None:
        """Read the output until the process exited (plus a grace period), then reap it."""
        append = entry.output.append
        sinks = {fd: partial(append, stream) for fd, stream in read_fds.items()}
        try:
            pump.pump(
                entry.pid, sinks, exited=entry.reap, deadline=entry.deadline, expire=entry.expire
            )
        except BaseException as exc:  # never leave followers waiting forever
            log(f"process {entry.pid}: reading its output failed: {exc!r}")
        finally:
            close_all(fd for fd in read_fds if fd != entry.write_fd)
            if not entry.reap():
                killpg(entry.pid, signal.SIGKILL)
                entry.wait()
            entry.finished = True
            with entry.wlock:  # writers give up within 100 ms once finished is set
                close_write_fd(entry)
            entry.output.finish()
            lingering = bool(session_groups({entry.pid}))
            with entry.lock:
                entry.lingering = lingering


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
