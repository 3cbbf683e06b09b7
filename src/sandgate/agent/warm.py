"""A shell started before its command: a short ``sh``/``bash`` command (``exec``, or a
background process started as a shell's ``-c``, as E2B's ``commands.run`` does) without the
spawn on its path.

Starting a process is most of what a short command costs: ``sh -c 'echo ok'`` takes ~1 ms to
spawn, run and reap on a virtual machine, of which the shell's own work is a few
microseconds. So after such a command the agent starts the next shell at once, after the
reply has gone, with the same program and options, working directory and environment; it
waits on a pipe that is its stdin. The next command with the same three is written to that
shell (it reads exactly the command's lines, then ``eval``\\ s it) instead of spawned, and
its output and exit status are read like any other's (execute.py, procs.py); a command that
comes while that shell is still being started waits for it, which is sooner than a spawn of
its own. Anything else, or a shell that is gone, spawns as before.

What the command sees is what ``sh -c`` gives it: the same ``$0``, no positional parameters,
the same environment, working directory, stdin (``exec``: /dev/null; a process: the pipe its
input is written to, or one at its end), open descriptors, session, process group, OOM score
and limits, the same line numbers, bash's ``$_`` and ``BASH_EXECUTION_STRING``, and no
variable of the reading loop (they are unset before it runs). What differs, and is documented
(docs/api.md): some of the shell's own error messages name ``eval`` (dash: ``sh: 1: eval: foo:
not found`` for ``sh: 1: foo: not found``; bash's syntax errors: ``bash: eval: line 1:`` for
``bash: -c: line 1:``); the shell's command line (``/proc/<pid>/cmdline``, ``ps``) shows the
reading loop, not the command; a command of one program runs as the shell's child, where a
spawned shell would have replaced itself with it; and a sandbox that ran a shell command in
the last 10 s holds one idle shell (one pid, ~1 MiB).

The reading loop reads the command a byte at a time (the shell's ``read`` does on a pipe, and
so never takes a byte of the input that follows it), so only commands of up to
`WARM_CODE_BYTES` go through it; past that a spawn costs less. The working directory is
checked by identity, not by path: the waiting shell's (`/proc/<pid>/cwd`) must be the
directory the path names now, so a directory removed or replaced since is never run in. A
login shell (``bash -l``) reads its profile when it starts: none is started ahead of a
process still running at its answer (what it installs is for the next shell to read), and
the files a profile commonly reads are looked at (`stat`) before a shell starts and again
when its command comes; any change spawns instead. At the sandbox's pids limit, a spawn
ends the waiting shell to take its pid.
A shell waits while the sandbox is in use: once no request came for the agent's idle time
(threads.IDLE_SECONDS, 10 s) after the last shell command, it is ended. When a waiting shell
turns out to be of no use (the next command asked for another program, directory or
environment), it is killed and the next is not started until a command spawns again, so a
caller that changes them every time pays at most one unused spawn in two. While the host's
CPUs are saturated (pressure.py), commands that come back to back (each within
`QUICK_SECONDS` of the previous answer) get no shell started ahead: with no CPU to spare
between them it is only more work, and they spawn as before. A command after a pause still
gets one, started during the pause.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import MappingProxyType

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    import subprocess

    from sandgate.agent.pressure import CpuPressure


WARM_CODE_BYTES = 1024  # longer commands spawn: the loop reads ~4 bytes a microsecond
START_WAIT_SECONDS = 5.0  # a command waits this long at most for a shell being started
# a command within this of the answer before it is one of a quick succession: while the CPUs
# are saturated, none gets a shell started ahead (Warm.due); one after a pause still does.
# A script's commands come milliseconds apart (tens with hundreds of clients on two CPUs), a
# person's or a language model's seconds apart
QUICK_SECONDS = 0.5
# the shells (by the name of the file a program resolves to: `sh` is dash on Debian, bash on
# Fedora) and how each may be asked to run a command: (options before "-c")
_LOGIN = frozenset({"-l", "--login"})  # bash's options that make it a login shell
SHELLS = MappingProxyType({"dash": ((),), "bash": ((), *((option,) for option in _LOGIN))})
# variables of the reading loop; an environment that sets any of them spawns instead
_PREFIX = "__sandgate_"
# The shell reads a first line, "<lines> <keep stdin: 1 or 0>", then exactly that many lines
# of command, then makes its stdin /dev/null unless told to keep it, and evals the command.
# The newline between lines comes from `s`: bash's `$'\n'` keeps its script on one line, so
# that $LINENO inside the eval is the command's own; dash has no `$'...'`, and counts lines
# inside an eval from the eval's start. bash also gets the command as its
# BASH_EXECUTION_STRING, and its `$_` as it was at the start (what `:` leaves as its last
# argument); dash has no `$_`.
_READ = (
    "read -r {p}n {p}k; {p}c=; {p}s=; "
    'while [ "${p}n" -gt 0 ] && IFS= read -r {p}l; do '
    '{p}c="${p}c${p}s${p}l"; {p}s={nl}; {p}n=$(({p}n - 1)); done; '
    '[ "${p}k" = 1 ] || exec 0<>/dev/null; unset {p}l {p}s {p}n {p}k; '
)
_SH_LOOP = _READ + 'eval "unset {p}c; ${p}c"'
_BASH_LOOP = (
    'printf -v {p}q %q "$_"; '
    + _READ
    + 'BASH_EXECUTION_STRING=${p}c; eval "unset {p}c {p}q; SECONDS=0; : ${p}q; ${p}c"'
)
# what a shell reads at its start from the environment, beyond the environment itself, or
# what would change how it runs the reading loop (a trace of it, a timeout of its read, a
# function named like a builtin it calls): an environment with any of them spawns instead
_STARTUP_VARIABLES = frozenset({"BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "TMOUT"})
_STARTUP_PREFIXES = (_PREFIX, "BASH_FUNC_")
# what a login shell (bash or dash) reads at its start: /etc/profile, which on Debian reads
# /etc/profile.d/*.sh (and /etc/bash.bashrc when interactive), then the first of ~/.bash_profile,
# ~/.bash_login, ~/.profile, which commonly reads ~/.bashrc
_PROFILE_FILES = ("/etc/profile", "/etc/bash.bashrc")
_PROFILE_DIRS = ("/etc/profile.d",)
# (and Debian's ~/.profile puts ~/bin and ~/.local/bin on PATH if they exist)
_HOME_FILES = (".bash_profile", ".bash_login", ".profile", ".bashrc", "bin", ".local/bin")

Key = tuple[tuple[str, ...], str, dict[str, str]]  # (program and options, cwd, environment)
Snapshot = tuple[tuple[str, tuple[int, int, int, int] | None], ...]


def _kind(program: str) -> str:
    """The shell a program is: the name of the file it resolves to."""
    return os.path.basename(os.path.realpath(program))


def script(program: str) -> str:
    """The waiting shell's ``-c`` script."""
    loop = _BASH_LOOP if _kind(program) == "bash" else _SH_LOOP
    return loop.format(p=_PREFIX, nl="$'\\n'" if loop is _BASH_LOOP else "'\n'")


def shell_command(argv: list[str]) -> tuple[tuple[str, ...], str] | None:
    """``argv`` split into (program and options, command) when it is a shell's ``-c`` of a
    short command that a waiting shell can run: None otherwise."""
    if len(argv) < 3 or argv[-2] != "-c" or "/" not in argv[0]:
        return None
    forms = SHELLS.get(_kind(argv[0]))
    options = tuple(argv[1:-2])
    code = argv[-1]
    if (
        forms is None
        or options not in forms
        or len(code) > WARM_CODE_BYTES
        or len(code.encode()) > WARM_CODE_BYTES
        or "\x00" in code
    ):
        return None
    return (argv[0], *options, "-c"), code


def eligible_env(env: dict[str, str]) -> bool:
    return not any(key.startswith(_STARTUP_PREFIXES) or key in _STARTUP_VARIABLES for key in env)


def profile(program: tuple[str, ...], env: dict[str, str]) -> Snapshot:
    """What a login shell of ``program`` reads at its start, as ``stat`` finds it now;
    () for a shell that is not a login shell."""
    if _LOGIN.isdisjoint(program):
        return ()
    paths = list(_PROFILE_FILES)
    for directory in _PROFILE_DIRS:
        paths.append(directory)
        try:
            paths.extend(sorted(os.path.join(directory, n) for n in os.listdir(directory)))
        except OSError:
            pass
    home = env.get("HOME")
    if home:
        paths.extend(os.path.join(home, name) for name in _HOME_FILES)
    found: list[tuple[str, tuple[int, int, int, int] | None]] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            found.append((path, None))
        else:
            found.append((path, (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)))
    return tuple(found)


class Waiting:
    """One shell started ahead: its stdin's write end (``feed``), the read ends of its
    stdout and stderr, and what its profile was when it started."""

    __slots__ = ("err", "feed", "key", "out", "proc", "read_profile")

    def __init__(
        self,
        key: Key,
        proc: subprocess.Popen[bytes],
        feed: int,
        out: int,
        err: int,
        read_profile: Snapshot,
    ) -> None:
        self.key = key
        self.proc = proc
        self.feed = feed
        self.out = out
        self.err = err
        self.read_profile = read_profile


class Warm:
    """The sandbox's waiting shell (at most one) and whether to start the next."""

    __slots__ = (
        "_answered",
        "_cpu",
        "_lock",
        "_quick",
        "_starting",
        "_used",
        "_waiting",
        "_wanted",
    )

    def __init__(self, cpu: CpuPressure) -> None:
        self._lock = threading.Condition(threading.Lock())  # notified when a start ends
        # no shell is started ahead while the host's CPUs are saturated and the commands come
        # in quick succession (`due`)
        self._cpu = cpu
        self._answered = 0.0  # when the last command's answer went (`due` is called then)
        self._quick = False  # the last shell command came within QUICK_SECONDS of it
        self._waiting: Waiting | None = None
        # what the next waiting shell is to be, set by a command that spawned, cleared by
        # one that found a shell of no use; None: start none
        self._wanted: Key | None = None
        self._starting = False  # a thread is starting the next shell
        self._used = time.monotonic()  # when the last shell command came

    def take(self, key: Key, code: str, keep_stdin: bool) -> Waiting | None:
        """The waiting shell, given ``code`` to run, if it is one for ``key``; else None
        (the caller spawns), and a waiting shell of no use is killed. ``keep_stdin``: the
        pipe stays the command's stdin and ``feed`` stays open for its input; otherwise
        ``feed`` is closed (/dev/null or end-of-file is what it reads). The next shell to
        start is one for ``key``, unless the waiting one was for another (the caller changes
        them: start none until a spawn finds no shell waiting)."""
        with self._lock:
            self._used = time.monotonic()
            self._quick = self._used - self._answered < QUICK_SECONDS
            self._settle(key)
            waiting, self._waiting = self._waiting, None
            fits = waiting is None or waiting.key == key
            self._wanted = key if fits else None
        if waiting is None:
            return None
        if (
            fits
            and _same_directory(waiting.proc.pid, key[1])
            and profile(key[0], key[2]) == waiting.read_profile
            and _feed(waiting, code, keep_stdin)
        ):
            return waiting
        discard(waiting)
        return None

    def settle(self, key: Key) -> None:
        """Wait until the shell being started for ``key``, if any, is ready: a caller that
        takes it under a lock of its own waits here first, not holding that lock."""
        with self._lock:
            self._settle(key)

    def _settle(self, key: Key) -> None:
        if self._waiting is None and self._starting and self._wanted == key:
            # the shell for these is being started (after the last command's answer): it is
            # ready sooner than a spawn of this command's own would be
            self._lock.wait_for(lambda: not self._starting, START_WAIT_SECONDS)

    def due(self) -> Key | None:
        """What to start now, after a command's answer (the caller then calls `started`), or
        None. None too while the host's CPUs are saturated (pressure.py) if this command
        came within QUICK_SECONDS of the answer before it: with no CPU to spare, a shell
        started ahead of commands that come back to back is only more work; the next command
        spawns, and the shell after it is started once the CPUs are free again or after a
        command that came after a pause (its shell starts in the pause)."""
        with self._lock:
            self._answered = time.monotonic()
            if self._waiting is not None or self._starting or self._wanted is None:
                return None
            if self._quick and self._cpu.check(self._answered):
                return None
            self._starting = True
            return self._wanted

    def started(self, waiting: Waiting | None) -> None:
        """The shell `due` asked for; None: it could not be started, and none is tried
        again until a command spawns. One that is no longer wanted (a command for others
        came while it started) is ended, and `due` then names the one wanted now."""
        with self._lock:
            self._starting = False
            self._lock.notify_all()
            if waiting is None:
                self._wanted = None
                return
            if self._wanted == waiting.key:
                self._waiting = waiting
                return
        discard(waiting)

    def unwant(self, key: Key) -> None:
        """Start no shell for ``key`` after this command: it is still running (a background
        process), and a login shell started now would read a profile it may yet change
        (a tool installed into ~/.local/bin, say). The next such command spawns."""
        with self._lock:
            if self._wanted == key:
                self._wanted = None

    def make_room(self) -> bool:
        """End the waiting shell, if any, so that a spawn at the sandbox's pids limit gets its
        pid (children.popen): True if one was ended."""
        with self._lock:
            waiting, self._waiting = self._waiting, None
        if waiting is None:
            return False
        discard(waiting)
        return True

    def expire(self, idle_seconds: float) -> None:
        """End the waiting shell if no shell command came for ``idle_seconds``: a sandbox
        that went quiet holds no shell (a task each other sandbox's start walks, ~1 MiB);
        its next command spawns, and the shell after it is started again."""
        with self._lock:
            waiting = self._waiting
            if waiting is None or time.monotonic() - self._used < idle_seconds:
                return
            self._waiting = None
        discard(waiting)


def _same_directory(pid: int, cwd: str) -> bool:
    try:
        held, named = os.stat(f"/proc/{pid}/cwd"), os.stat(cwd)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


def _feed(waiting: Waiting, code: str, keep_stdin: bool) -> bool:
    """Write the command's lines behind their count; close the pipe unless kept. False if
    the shell is gone (nothing of the command ran: it runs once its last line is read)."""
    lines = code.split("\n")
    data = f"{len(lines)} {int(keep_stdin)}\n{code}\n".encode()
    try:
        while data:
            data = data[os.write(waiting.feed, data) :]
    except OSError:  # EPIPE: the shell was killed while it waited
        return False
    if not keep_stdin:
        os.close(waiting.feed)
        waiting.feed = -1
    return True


def discard(waiting: Waiting) -> None:
    """End a waiting shell that will not be used, and wait for it."""
    try:
        os.killpg(waiting.proc.pid, signal.SIGKILL)
    except OSError:
        pass
    waiting.proc.wait()
    for fd in (waiting.feed, waiting.out, waiting.err):
        if fd >= 0:
            os.close(fd)
