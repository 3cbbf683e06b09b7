"""Sandbox chains started from a thread with a descriptor table of its own.

A spawn copies the spawning thread's descriptor table, even with `vfork`, and the child's
`exec` closes what it copied. The worker holds six descriptors per sandbox (its pipes, its
network namespace, its disk, its uid lock, its pidfd), so at 1,000 sandboxes every start
copied and closed ~6,000 of them: ~3 ms of a start that grew with the sandboxes held
(docs/benchmarks.md, "Session 16").

`Spawner` owns one thread that left the process's shared table and working directory
(`unshare(CLONE_FILES | CLONE_FS)`) and keeps nothing open but what it needs. A start hands
it the descriptors the child gets by number (the thread copies them from the worker's table
with `pidfd_getfd`, closes-on-exec), and the thread `posix_spawn`s the chain in its own new
session, in `/`, with an empty signal mask and SIGPIPE/SIGXFSZ at their defaults (as
`subprocess` does), then closes its copies.

The thread lives as long as the runtime that made it: a sandbox's bwrap dies with the thread
that started it (`--die-with-parent` is per thread), so it is never ended while sandboxes run
and never ends on an error. `SpawnedProcess` is the worker's side of one child: its pipes as
asyncio streams, its exit read through a pidfd (a child of any thread of the worker may be
waited for by any other), its kill through that pidfd (no pid reuse).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import itertools
import os
import queue
import signal
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final

from sandgate.worker import syscalls

_CLONE_FS: Final = 0x200
_CLONE_FILES: Final = 0x400
_SYS_PIDFD_GETFD: Final = 438  # the common syscall table
_THREAD_NAME: Final = "sandbox-spawner"
_ABOVE: Final = 100  # the thread's copies sit above every child number: no dup2 overwrites one
_DEFAULT_SIGNALS: Final = (signal.SIGPIPE, signal.SIGXFSZ)

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class _Job:
    number: int
    argv: Sequence[str]
    fds: Mapping[int, int]  # the child's number -> the worker's descriptor


class Spawner:
    """One thread that starts processes with only the descriptors they are given.

    The thread tells the event loop of each result through a pipe of the worker's: an
    asyncio wake-up from the thread itself would write to a descriptor number the thread
    does not have. The pipe is read by the loop of the latest `spawn`, which also looks for
    results once a second, whatever the pipe says.

    The thread keeps no descriptor open between jobs (0-2 aside): a finaliser the garbage
    collector happens to run on it closes a number in the thread's table, not the one the
    object held, and with nothing kept there it cannot close one of the thread's own."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[int, int | BaseException]] = queue.SimpleQueue()
        self._waiting: dict[int, asyncio.Future[int]] = {}
        self._numbers = itertools.count()
        self._notified, self._notify = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        ready: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=_THREAD_NAME, daemon=True
        )
        self._thread.start()
        try:
            ready.result()  # its set-up failed: raised here (OSError)
        except BaseException:
            self._thread.join()
            os.close(self._notified)
            os.close(self._notify)
            raise

    async def spawn(self, argv: Sequence[str], fds: Mapping[int, int]) -> int:
        """Start `argv` with `fds` (child number -> the worker's descriptor, left open for the
        caller to close); its pid."""
        if not self._thread.is_alive():
            raise OSError("the spawner is closed")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._unwatch()
            loop.add_reader(self._notified, self._collect)
            self._loop = loop
        number = next(self._numbers)
        done: asyncio.Future[int] = loop.create_future()
        self._waiting[number] = done
        self._jobs.put(_Job(number, tuple(argv), dict(fds)))
        try:
            while not done.done():
                await asyncio.wait({done}, timeout=1.0)
                self._collect()
            return done.result()
        finally:
            self._waiting.pop(number, None)

    def close(self) -> None:
        """End the thread: what it started and still runs is killed (--die-with-parent)."""
        if not self._thread.is_alive():
            return
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._unwatch()
        os.close(self._notified)
        os.close(self._notify)

    def _unwatch(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._notified)
        self._loop = None

    def _collect(self) -> None:
        """On the loop: the results the thread has sent."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._notified, 4096):
                pass
        while True:
            try:
                number, result = self._results.get_nowait()
            except queue.Empty:
                return
            done = self._waiting.get(number)
            if done is None or done.done():
                continue
            if isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)

    def _run(self, ready: Future[None]) -> None:
        try:
            if _libc.unshare(ctypes.c_int(_CLONE_FILES | _CLONE_FS)) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"unshare: {os.strerror(code)}")
            os.closerange(3, 1 << 30)  # this thread's copies only: the table is its own now
            os.chdir("/")  # what it starts must not hold the worker's directory
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        while True:  # until close: the sandboxes it started die with this thread
            job = self._jobs.get()
            if job is None:
                return
            result: int | BaseException
            try:
                leader = os.pidfd_open(os.getpid())  # the worker's table is its leader's
            except OSError as exc:
                self._results.put((job.number, exc))
                continue  # the loop finds it within a second
            try:
                try:
                    result = self._spawn(leader, job)
                except BaseException as exc:  # the job's failure, never the thread's
                    result = exc
                self._results.put((job.number, result))
                with contextlib.suppress(OSError):  # full: the loop is already told
                    notify = _copy_of(leader, self._notify)
                    try:
                        os.write(notify, b"\0")
                    finally:
                        os.close(notify)
            finally:
                os.close(leader)

    @staticmethod
    def _spawn(leader: int, job: _Job) -> int:
        """On the thread: the job's descriptors copied into its table (above every child
        number, so that no dup2 overwrites a source), the child spawned, the copies closed."""
        local: dict[int, int] = {}
        try:
            for number, fd in job.fds.items():
                if number >= _ABOVE:
                    raise ValueError(f"child descriptor {number} is not below {_ABOVE}")
                got = _copy_of(leader, fd)
                try:
                    local[number] = fcntl.fcntl(got, fcntl.F_DUPFD_CLOEXEC, _ABOVE)
                finally:
                    os.close(got)
            actions = [(os.POSIX_SPAWN_DUP2, fd, number) for number, fd in local.items()]
            return os.posix_spawn(
                job.argv[0],
                list(job.argv),
                {},
                file_actions=actions,
                setsid=True,
                setsigmask=(),
                setsigdef=_DEFAULT_SIGNALS,
            )
        finally:
            for fd in local.values():
                os.close(fd)


class SpawnedProcess:
    """The worker's side of a child `Spawner` started: what `asyncio.subprocess.Process`
    offers the worker (pid, returncode, stdin, stdout, wait, kill)."""

    def __init__(
        self,
        pid: int,
        stdin: asyncio.StreamWriter,
        stdout: asyncio.StreamReader,
    ) -> None:
        self.pid = pid
        self.stdin: asyncio.StreamWriter | None = stdin
        self.stdout: asyncio.StreamReader | None = stdout
        self._returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._pidfd = os.pidfd_open(pid)
        self._loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        try:
            found = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its code is lost
            found = None
            code = 255
        else:
            if found is None:
                return  # not yet (a spurious wake-up)
            code = -found.si_status if found.si_code != os.CLD_EXITED else found.si_status
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self._returncode = code
        if not self._exited.done():
            self._exited.set_result(code)

    @property
    def returncode(self) -> int | None:
        return self._returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, bytes]:
        """Write `input`, close stdin, read stdout to its end, wait (stderr is not a pipe:
        b"")."""
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
                await self.stdin.drain()
            self.stdin.close()
        out = await self.stdout.read() if self.stdout is not None else b""
        await self.wait()
        return out, b""

    def close_pipes(self) -> None:
        """Close both pipes, as the worker's end does: the agent reads its stdin's end."""
        for stream in (self.stdin, self.stdout):
            transport = getattr(stream, "transport", None) or getattr(stream, "_transport", None)
            if transport is not None:
                transport.close()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        if self._returncode is not None or self._pidfd < 0:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._pidfd, signum)


async def start(
    spawner: Spawner,
    argv: Sequence[str],
    *,
    stderr: int,
    pass_fds: Mapping[int, int],
    limit: int,
) -> SpawnedProcess:
    """Start `argv` through `spawner` with new pipes as its stdin and stdout, `stderr` as
    its stderr and `pass_fds` (child number -> the worker's descriptor) as well."""
    loop = asyncio.get_running_loop()
    child_in, to_child = os.pipe2(os.O_CLOEXEC)
    from_child, child_out = os.pipe2(os.O_CLOEXEC)
    spawning = asyncio.ensure_future(
        spawner.spawn(argv, {0: child_in, 1: child_out, 2: stderr, **pass_fds})
    )
    try:
        pid = await asyncio.shield(spawning)
    except BaseException as exc:
        os.close(to_child)
        os.close(from_child)
        if isinstance(exc, asyncio.CancelledError):  # it may be started all the same
            started = await asyncio.gather(spawning, return_exceptions=True)
            if isinstance(started[0], int):
                _kill_and_reap(loop, started[0])
        raise
    finally:  # the child has its own copies
        os.close(child_in)
        os.close(child_out)
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    read_protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    await loop.connect_read_pipe(lambda: read_protocol, os.fdopen(from_child, "rb", 0))
    write_transport, write_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(to_child, "wb", 0)
    )
    writer = asyncio.StreamWriter(write_transport, write_protocol, None, loop)
    return SpawnedProcess(pid, writer, reader)


def _kill_and_reap(loop: asyncio.AbstractEventLoop, pid: int) -> None:
    """A child nobody will hold (its start was cancelled): killed now, reaped once gone."""
    pidfd = os.pidfd_open(pid)
    signal.pidfd_send_signal(pidfd, signal.SIGKILL)

    def reap() -> None:
        if os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG) is not None:
            loop.remove_reader(pidfd)
            os.close(pidfd)

    loop.add_reader(pidfd, reap)


def _copy_of(leader: int, fd: int) -> int:
    """A close-on-exec copy, in the calling thread's table, of the worker's descriptor `fd`."""
    return syscalls.call(_SYS_PIDFD_GETFD, ctypes.c_int(leader), ctypes.c_int(fd), ctypes.c_uint(0))
