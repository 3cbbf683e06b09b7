"""One background process or terminal of the agent (procs.py has the requests on them).

An ``Entry`` is one child with its output buffer (output.py), its stdin pipe or terminal
master, its exit status and its timeout; the helpers here signal process groups and sessions
and fork a terminal's child.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterable
    from typing import Protocol

    from sandgate.agent.orphans import Reaper
    from sandgate.agent.output import Output
    from sandgate.agent.request import Header, at_pids_limit

    class Child(Protocol):
        """What the pump needs of a child: subprocess.Popen or a forked terminal (Forked)."""

        pid: int
        returncode: int | None

        def poll(self) -> int | None: ...
else:
    from output import Output
    from request import at_pids_limit

TIMEOUT_EXIT_CODE = 124
SPAWN_TIMEOUT = 10.0  # seconds a forked terminal child may take to exec


def popen(
    argv: list[str], make_room: Callable[[], bool] | None = None, **options: object
) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, start_new_session=True, **options)``; a fork refused (the
    sandbox's pids limit) is tried once more if ``make_room()`` freed a pid (the waiting
    shell's, warm.py), else it is that limit's error, not an io_error."""
    import subprocess

    try:
        return subprocess.Popen(argv, start_new_session=True, **options)  # type: ignore[call-overload, no-any-return]
    except BlockingIOError:
        if make_room is None or not make_room():
            raise at_pids_limit() from None
    try:
        return subprocess.Popen(argv, start_new_session=True, **options)  # type: ignore[call-overload, no-any-return]
    except BlockingIOError:
        raise at_pids_limit() from None


def on_pipes(
    start: Callable[[int, int, int], subprocess.Popen[bytes]],
) -> tuple[subprocess.Popen[bytes], int, int, int]:
    """``start(stdin, stdout, stderr)`` on three new pipes: what it started and the ends left
    to the agent (stdin's write end, stdout's and stderr's read ends). The child's ends are
    closed here, and every end if ``start`` raises."""
    pipes: list[int] = []
    try:
        for _ in range(3):
            pipes.extend(os.pipe())
        in_r, in_w, out_r, out_w, err_r, err_w = pipes
        child = start(in_r, out_w, err_w)
    except BaseException:
        for fd in pipes:
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return child, in_w, out_r, err_r


class Forked:
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


class Entry:
    """One background process or terminal."""

    __slots__ = (
        "argv",
        "child",
        "command",
        "cwd",
        "deadline",
        "env",
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
        "tag",
        "terminal",
        "timed_out",
        "wlock",
        "write_fd",
    )

    def __init__(
        self,
        child: Child,
        command: str,
        write_fd: int,
        *,
        terminal: bool,
        deadline: float | None = None,
        argv: list[str] | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        tag: str | None = None,
    ) -> None:
        self.child = child
        self.tag = tag  # unique among running processes: a second start with it is refused
        self.pid = child.pid
        self.command = command
        self.argv = argv or []  # what was run, as the request gave it
        self.cwd = cwd  # the working directory as the request named it (None: the default)
        self.env = env or {}  # the variables the request added (not the whole environment)
        self.terminal = terminal
        self.deadline = deadline  # monotonic time of the timeout, if any
        self.started_at = iso_now()
        self.output = Output()
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
            self.exited_at = iso_now()
            self.exited_mono = time.monotonic()
            return True

    def expire(self) -> None:
        """The timeout passed (called by the pump): kill the group; the exit code is 124."""
        with self.lock:
            self.timed_out = True
            killpg(self.pid, signal.SIGKILL)

    def wait(self) -> None:
        """Reap the command, however long it takes to die (after a SIGKILL)."""
        while not self.reap():
            time.sleep(0.01)

    def signal_group(self, signum: int) -> bool:
        """Send ``signum`` to the process's group; False if it had already ended (nothing
        was sent)."""
        with self.lock:
            if self.alive:
                killpg(self.pid, signum)
                return True
            return False

    def signal_session(self, signum: int) -> None:
        with self.lock:
            if self.alive:
                for pgid in session_groups({self.pid}) | {self.pid}:
                    killpg(pgid, signum)

    def describe(self) -> Header:
        return {
            "pid": self.pid,
            "command": self.command,
            "argv": self.argv,
            "cwd": self.cwd,
            "env": self.env,
            "tag": self.tag,
            "output_end": self.output.end,  # where output written from now on will start
            "state": "running" if self.exit_code is None else "exited",
            "exit_code": self.exit_code,
            "started_at": self.started_at,
            "exited_at": self.exited_at,
            "terminal": self.terminal,
        }


def iso_now() -> str:
    seconds, nanos = divmod(time.time_ns(), 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos // 1000:06d}Z"


def killpg(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the id was recycled by someone else's group
        return False
    return True


def close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def close_write_fd(entry: Entry) -> None:
    """Close the stdin pipe or terminal master (wlock held)."""
    fd, entry.write_fd = entry.write_fd, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def session_groups(sessions: set[int]) -> set[int]:
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


def _become(slave: int, argv: list[str], env: dict[str, str], cwd: str, error_w: int) -> None:
    """The forked child: no locks, nothing but these calls; it never returns."""
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


def fork_terminal(slave: int, argv: list[str], env: dict[str, str], cwd: str, guard: Reaper) -> int:
    """Fork a child that takes ``slave`` as its controlling terminal and execs ``argv``.

    subprocess cannot make a terminal the controlling one (preexec_fn is unsafe in a threaded
    process), so this forks and execs at once; the child does nothing else. Exec failures come
    back through a close-on-exec pipe, as with subprocess. ``guard`` is held from the fork
    until the child is recorded as the agent's (orphans.py), not while it starts.
    """
    import select

    error_r, error_w = os.pipe()
    try:
        with guard.spawning():  # the child never leaves this block: it execs or exits in _become
            pid = os.fork()
            if pid == 0:
                _become(slave, argv, env, cwd, error_w)
            guard.own(pid)
    except BaseException as exc:
        os.close(error_r)
        if isinstance(exc, BlockingIOError):  # the fork refused: the sandbox's pids limit
            raise at_pids_limit() from None
        raise
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
