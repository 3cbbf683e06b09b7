"""A shell started before its command: ``exec`` of a short ``sh`` or ``bash`` command without
the spawn on its path.

Starting a process is most of what a short command costs: ``sh -c 'echo ok'`` takes ~1 ms to
spawn, run and reap on a virtual machine, of which the shell's own work is a few
microseconds. So after an ``exec`` of a shell command the agent starts the next shell at once,
after the reply has gone, with the same program, working directory and environment; it waits
on a pipe. The next ``exec`` with the same three gives that shell its command through the
pipe (it reads it, closes the pipe and ``eval``\\ s it) instead of spawning one, and reads its
output and exit status like any other (execute.py); a command that comes while that shell
is still being started waits for it, which is sooner than a spawn of its own. Anything else,
or a shell that is gone, spawns as before.

What the command sees is what ``sh -c`` gives it: the same ``$0``, no positional parameters,
the same environment, working directory, stdin (/dev/null), open descriptors, session,
process group, OOM score and limits, the same line numbers, bash's ``$_`` and
``BASH_EXECUTION_STRING``, and no variable of the reading loop (they are unset before it
runs). What differs, and is documented (docs/api.md): some of the shell's own error messages
name ``eval`` (dash: ``sh: 1: eval: foo: not found`` for ``sh: 1: foo: not found``; bash's
syntax errors: ``bash: eval: line 1:`` for ``bash: -c: line 1:``); the shell's command line
(``/proc/<pid>/cmdline``, ``ps``) shows the reading loop, not the command; and a sandbox that
ran a shell command in the last 10 s holds one idle shell (one pid, ~1 MiB).

The reading loop reads the command a byte at a time (the shell's ``read`` does on a pipe), so
only commands of up to `WARM_CODE_BYTES` go through it; past that a spawn costs less. The
working directory is checked by identity, not by path: the waiting shell's (`/proc/<pid>/cwd`)
must be the directory the path names now, so a directory removed or replaced since is never
run in. A shell waits while the sandbox is in use: once no request came for the agent's idle
time (threads.IDLE_SECONDS, 10 s) after the last shell command, it is ended. When a waiting
shell turns out to be of no use (the next command asked for another
directory or environment), it is killed and the next is not started until an ``exec`` spawns
again, so a caller that changes directory every time pays at most one unused spawn in two.
"""

from __future__ import annotations

import os
import signal
import threading
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    import subprocess


WARM_CODE_BYTES = 1024  # longer commands spawn: the loop reads ~4 bytes a microsecond
START_WAIT_SECONDS = 5.0  # a command waits this long at most for a shell being started
SHELLS = frozenset({"sh", "bash"})
# variables of the reading loop; an environment that sets any of them spawns instead
_PREFIX = "__sandgate_"
# The shell reads its command on its stdin (a pipe), then makes its stdin /dev/null (read and
# write, as a spawn's is) and evals it. The newline between lines comes from `n`: bash's
# `$'\n'` keeps its script on one line, so that $LINENO inside the eval is the command's own;
# dash has no `$'...'`, and counts lines inside an eval from the eval's start. bash also gets
# the command as its BASH_EXECUTION_STRING, and its `$_` as it was at the start (what `:`
# leaves as its last argument); dash has no `$_`.
_SH_LOOP = (
    '{p}c=; {p}n=; while IFS= read -r {p}l; do {p}c="${p}c${p}n${p}l"; {p}n="\n"; done; '
    '{p}c="${p}c${p}n${p}l"; exec 0<>/dev/null; unset {p}l {p}n; eval "unset {p}c; ${p}c"'
)
_BASH_LOOP = (
    'printf -v {p}q %q "$_"; '
    '{p}c=; {p}n=; while IFS= read -r {p}l; do {p}c="${p}c${p}n${p}l"; '
    "{p}n=$'\\n'; done; "
    '{p}c="${p}c${p}n${p}l"; exec 0<>/dev/null; unset {p}l {p}n; BASH_EXECUTION_STRING=${p}c; '
    'eval "unset {p}c {p}q; : ${p}q; ${p}c"'
)
# what a shell reads at its start from the environment, beyond the environment itself
_STARTUP_FILES = frozenset({"BASH_ENV", "ENV"})


def script(shell: str) -> str:
    """The waiting shell's ``-c`` script; ``shell``: "sh" or "bash"."""
    return (_BASH_LOOP if shell == "bash" else _SH_LOOP).format(p=_PREFIX)


class Waiting:
    """One shell started ahead, waiting on ``feed`` for its command."""

    __slots__ = ("cwd", "env", "feed", "proc", "shell")

    def __init__(
        self, shell: str, cwd: str, env: dict[str, str], proc: subprocess.Popen[bytes], feed: int
    ) -> None:
        self.shell = shell
        self.cwd = cwd
        self.env = env
        self.proc = proc
        self.feed = feed


class Warm:
    """The sandbox's waiting shell (at most one) and whether to start the next."""

    __slots__ = ("_lock", "_starting", "_used", "_waiting", "_wanted")

    def __init__(self) -> None:
        self._lock = threading.Condition(threading.Lock())  # notified when a start ends
        self._waiting: Waiting | None = None
        # what the next waiting shell is to be (shell, cwd, env), set by an exec that
        # spawned, cleared by one that found a shell of no use; None: start none
        self._wanted: tuple[str, str, dict[str, str]] | None = None
        self._starting = False  # a thread is starting the next shell
        self._used = time.monotonic()  # when the last shell command came

    @staticmethod
    def eligible(language: str, code: str, env: dict[str, str]) -> bool:
        return (
            language in SHELLS
            and len(code) <= WARM_CODE_BYTES
            and len(code.encode()) <= WARM_CODE_BYTES
            and not any(key.startswith(_PREFIX) or key in _STARTUP_FILES for key in env)
        )

    def take(
        self, shell: str, code: str, cwd: str, env: dict[str, str]
    ) -> subprocess.Popen[bytes] | None:
        """The waiting shell, given ``code`` to run, if it is one for these; else None (the
        caller spawns), and a waiting shell of no use is killed. The next to start is one
        for these, unless the waiting one was for others (the caller changes them: start none
        until a spawn finds no shell waiting)."""
        wanted = (shell, cwd, env)
        with self._lock:
            self._used = time.monotonic()
            if self._waiting is None and self._starting and self._wanted == wanted:
                # the shell for these is being started (after the last command's answer):
                # it is ready sooner than a spawn of this command's own would be
                self._lock.wait_for(lambda: not self._starting, START_WAIT_SECONDS)
            waiting, self._waiting = self._waiting, None
            fits = waiting is None or (
                waiting.shell == shell and waiting.cwd == cwd and waiting.env == env
            )
            self._wanted = wanted if fits else None
        if waiting is None:
            return None
        if fits and _same_directory(waiting.proc.pid, cwd) and _feed(waiting, code):
            return waiting.proc
        discard(waiting)
        return None

    def due(self) -> tuple[str, str, dict[str, str]] | None:
        """What to start now (the caller then calls `started`), or None."""
        with self._lock:
            if self._waiting is not None or self._starting or self._wanted is None:
                return None
            self._starting = True
            return self._wanted

    def started(self, waiting: Waiting | None) -> None:
        """The shell `due` asked for; None: it could not be started, and none is tried
        again until an exec spawns. One that is no longer wanted (an exec for others came
        while it started) is ended, and `due` then names the one wanted now."""
        with self._lock:
            self._starting = False
            self._lock.notify_all()
            if waiting is None:
                self._wanted = None
                return
            if self._wanted == (waiting.shell, waiting.cwd, waiting.env):
                self._waiting = waiting
                return
        discard(waiting)

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


def _feed(waiting: Waiting, code: str) -> bool:
    """Write the whole command and close the pipe; False if the shell is gone (nothing of
    the command ran: it runs only once the pipe is closed, at the end of its text)."""
    data = code.encode()
    fd, waiting.feed = waiting.feed, -1
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # EPIPE: the shell was killed while it waited
        return False
    finally:
        os.close(fd)
    return True


def discard(waiting: Waiting) -> None:
    """End a waiting shell that will not be used, and wait for it."""
    if waiting.feed >= 0:
        os.close(waiting.feed)
    try:
        os.killpg(waiting.proc.pid, signal.SIGKILL)
    except OSError:
        pass
    waiting.proc.wait()
    for pipe in (waiting.proc.stdout, waiting.proc.stderr):
        if pipe is not None:
            pipe.close()
