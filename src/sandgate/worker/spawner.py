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
import gc
import itertools
import logging
import os
import queue
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
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
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    number: int
    argv: Sequence[str]
    fds: Mapping[int, int]  # the child's number -> the job's own copy in the worker's table


class Spawner:
    """One thread that starts processes with only the descriptors they are given.

    The thread tells the event loop of each result through a pipe of the worker's: an
    asyncio wake-up from the thread itself would write to a descriptor number the thread
    does not have. The pipe is read by the loop of the latest `spawn`, which also looks for
    results once a second, whatever the pipe says.

    A job owns copies of its descriptors from the moment it is queued until its result is
    collected, so the caller may close its own at once, and a cancelled `spawn` leaves the
    job to `_collect`, which kills and reaps what it started. The thread blocks every signal
    (Python's handler would write the loop's wake-up byte into the thread's own table), runs
    each job with the garbage collector off (a finaliser would close a number in the
    thread's table, not the one its object held) and keeps no descriptor between jobs.

    Its job and result queues, like `_waiting` and `_owned`, hold one entry per start in
    progress at most (the worker's starts are bounded by its capacity)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[int, int | BaseException]] = queue.SimpleQueue()
        self._waiting: dict[int, asyncio.Future[int]] = {}
        self._owned: dict[int, Mapping[int, int]] = {}  # job -> its copies, until collected
        self._numbers = itertools.count()
        self._closed = False
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
        """Start `argv` with `fds` (child number -> a descriptor of the caller's, copied:
        the caller may close its own once this is called); its pid. Cancelled, the job still
        runs and what it started is killed and reaped."""
        if self._closed or not self._thread.is_alive():
            raise OSError("the spawner is closed")
        for number in fds:
            if not 0 <= number < _ABOVE:
                raise ValueError(f"child descriptor {number} is not in [0, {_ABOVE})")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._unwatch()
            loop.add_reader(self._notified, self._collect)
            self._loop = loop
        number = next(self._numbers)
        owned: dict[int, int] = {}
        try:
            for child, fd in fds.items():
                owned[child] = os.dup(fd)  # close-on-exec
        except BaseException:
            for fd in owned.values():
                os.close(fd)
            raise
        done: asyncio.Future[int] = loop.create_future()
        self._waiting[number] = done
        self._owned[number] = owned
        self._jobs.put(_Job(number, tuple(argv), owned))
        try:
            while not done.done():
                await asyncio.wait({done}, timeout=1.0)
                self._collect()
        except BaseException:  # cancelled: what the job starts is nobody's
            if done.done() and not done.cancelled() and done.exception() is None:
                _kill_and_reap(loop, done.result())
            done.cancel()  # _collect kills and reaps it when it comes
            raise
        return done.result()

    def close(self) -> None:
        """End the thread: what it started and still runs is killed (--die-with-parent)."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=5)
        self._collect()
        for done in self._waiting.values():
            if not done.done():
                done.set_exception(OSError("the spawner is closed"))
        self._waiting.clear()
        if self._thread.is_alive():  # still in a spawn: it may yet use the pipe
            log.error("spawner.close: the thread did not end within 5 s")
            return
        self._unwatch()
        for fds in self._owned.values():
            for fd in fds.values():
                os.close(fd)
        self._owned.clear()
        os.close(self._notified)
        os.close(self._notify)
        self._notified = self._notify = -1

    def _unwatch(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._notified)
        self._loop = None

    def _collect(self) -> None:
        """On the loop: the results the thread has sent. A job's copies are closed; the child
        of a job whose caller is gone is killed and reaped."""
        if self._notify < 0:
            return
        with contextlib.suppress(BlockingIOError):
            while os.read(self._notified, 4096):
                pass
        while True:
            try:
                number, result = self._results.get_nowait()
            except queue.Empty:
                return
            for fd in self._owned.pop(number, {}).values():
                os.close(fd)
            done = self._waiting.pop(number, None)
            if done is None or done.done():  # cancelled, or the loop gone: nobody holds it
                if isinstance(result, int):
                    _kill_and_reap(self._loop, result)
                continue
            if isinstance(result, BaseException):
                done.set_exception(result)
            else:
                done.set_result(result)

    def _run(self, ready: Future[None]) -> None:
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
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
            collecting = gc.isenabled()
            gc.disable()
            try:
                self._serve(job)
            except BaseException:  # nothing may end this thread but close
                continue
            finally:
                if collecting:
                    gc.enable()

    def _serve(self, job: _Job) -> None:
        """On the thread: the job's result queued, then the loop woken (a full pipe means it
        is awake; without the wake-up the loop finds the result within a second)."""
        try:
            leader = os.pidfd_open(os.getpid())  # the worker's table is its leader's
        except OSError as exc:
            self._results.put((job.number, exc))
            return
        try:
            result: int | BaseException
            try:
                result = self._spawn(leader, job)
            except BaseException as exc:  # the job's failure, never the thread's
                result = exc
            self._results.put((job.number, result))
            with contextlib.suppress(OSError):
                notify = _copy_of(leader, self._notify)
                try:
                    os.write(notify, b"\0")
                finally:
                    os.close(notify)
        finally:
            with contextlib.suppress(OSError):
                os.close(leader)

    @staticmethod
    def _spawn(leader: int, job: _Job) -> int:
        """On the thread: the job's descriptors copied into its table (above every child
        number, so that no dup2 overwrites a source), the child spawned, the copies closed."""
        local: dict[int, int] = {}
        try:
            for number, fd in job.fds.items():
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
                with contextlib.suppress(OSError):
                    os.close(fd)


class SpawnedProcess:
    """The worker's side of a child `Spawner` started: what `asyncio.subprocess.Process`
    offers the worker (pid, returncode, stdin, stdout, wait, kill)."""

    def __init__(
        self,
        pid: int,
        stdin: asyncio.StreamWriter,
        stdout: asyncio.StreamReader,
        transports: Sequence[asyncio.BaseTransport],
    ) -> None:
        self.pid = pid
        self.stdin: asyncio.StreamWriter | None = stdin
        self.stdout: asyncio.StreamReader | None = stdout
        self._transports = tuple(transports)
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(pid)
        _watch_exit(loop, self._pidfd, self._exited.set_result)

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

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
        for transport in self._transports:
            transport.close()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        if self._exited.done():  # its pidfd is closed: the pid may be another's by now
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
    try:  # the job copies the descriptors before its first wait: ours may close at once
        pid = await spawner.spawn(argv, {0: child_in, 1: child_out, 2: stderr, **pass_fds})
    except BaseException:
        os.close(to_child)
        os.close(from_child)
        raise
    finally:
        os.close(child_in)
        os.close(child_out)
    read_file = os.fdopen(from_child, "rb", 0)
    write_file = os.fdopen(to_child, "wb", 0)
    transports: list[asyncio.BaseTransport] = []
    try:
        reader = asyncio.StreamReader(limit=limit, loop=loop)
        read_protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        read_transport, _ = await loop.connect_read_pipe(lambda: read_protocol, read_file)
        transports.append(read_transport)
        write_transport, write_protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, write_file
        )
        transports.append(write_transport)
        writer = asyncio.StreamWriter(write_transport, write_protocol, None, loop)
        return SpawnedProcess(pid, writer, reader, transports)
    except BaseException:  # cancelled or failed once started: nobody will hold the child
        for transport in transports:
            transport.close()  # and its pipe
        for pipe in (read_file, write_file)[len(transports) :]:
            pipe.close()
        _kill_and_reap(loop, pid)
        raise


def _kill_and_reap(loop: asyncio.AbstractEventLoop | None, pid: int) -> None:
    """A child nobody will hold (its start was cancelled): killed now, reaped once gone
    (at once, blocking briefly, where no loop runs any more)."""
    if loop is None or loop.is_closed():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        _reap_blocking(pid)
        return
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # no descriptor to spare: by pid, still ours to reap (no reuse before)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        loop.run_in_executor(None, _reap_blocking, pid)
        return
    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    _watch_exit(loop, pidfd, lambda _code: None)


def _watch_exit(loop: asyncio.AbstractEventLoop, pidfd: int, then: Callable[[int], object]) -> None:
    """Once the child of `pidfd` exits: reap it, close `pidfd`, call `then` with its code
    (as `subprocess` gives it: minus the signal that killed it)."""

    def reap() -> None:
        try:
            found = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its code is lost
            code = 255
        else:
            if found is None:
                return  # not yet (a spurious wake-up)
            code = -found.si_status if found.si_code != os.CLD_EXITED else found.si_status
        loop.remove_reader(pidfd)
        os.close(pidfd)
        then(code)

    loop.add_reader(pidfd, reap)


def _copy_of(leader: int, fd: int) -> int:
    """A close-on-exec copy, in the calling thread's table, of the worker's descriptor `fd`."""
    return syscalls.call(_SYS_PIDFD_GETFD, ctypes.c_int(leader), ctypes.c_int(fd), ctypes.c_uint(0))


def _reap_blocking(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
