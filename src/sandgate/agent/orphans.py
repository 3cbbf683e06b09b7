"""Orphans reaped by the agent when it is its sandbox's pid 1.

The bwrap runtime starts the agent as pid 1 of the sandbox's pid namespace (``--as-pid-1``):
no init of bwrap's runs beside it, one process fewer per sandbox, and one task fewer for the
kernel to walk at every sandbox start (``pivot_root`` visits every task on the host:
docs/benchmarks.md, "Session 17"). A process whose parent exits then becomes the agent's
child, and once it exits it stays a zombie, holding one of the sandbox's pids, until the agent
waits for it.

The agent's own children are waited for by whoever started them (``subprocess.Popen``, a
terminal's ``waitpid``), and a status taken from them would be lost (Popen reads a child it
can no longer wait for as exit code 0). So the reaper takes only zombies it knows are not the
agent's own: every spawn holds the `Reaper.spawning` guard (shared) from before its fork until
its child is recorded (`own`), and the reaper scans and reaps under the guard held alone. A
child is recorded with its start time, so a pid the kernel hands out again after its owner
waited for it is not mistaken for the agent's.

No thread waits for SIGCHLD (a thread is a task too, and would undo the one saved): its
handler's wake-up byte (``signal.set_wakeup_fd``) makes the agent's main loop, which polls its
request pipe and that byte together (main.py), hand one scan to a request thread, which waits
`SETTLE` seconds first, so a burst of exits costs one scan of /proc (the sandbox's own: a
handful of entries). Where the agent is not pid 1 (the process runtime, tests on the host)
nothing of this runs and nothing is recorded.
"""

from __future__ import annotations

import os
import signal
import threading
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType, TracebackType

    from sandgate.agent.log import log
else:
    from log import log

SETTLE = 0.05  # seconds after a SIGCHLD before the scan: one scan for a burst of exits
# the OOM score every process the agent starts begins with (the agent keeps the kernel's 0):
# when its sandbox's processes fill its memory limit, the kernel kills one of them, however
# small each is, never the agent first (a killed agent is a lost sandbox). Raised, not the
# agent's lowered: lowering needs CAP_SYS_RESOURCE, which a worker may not have.
USER_OOM_SCORE_ADJ = 500


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command's name (state first), or None when
    the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.rpartition(b")")[2].split()


def start_time(pid: int) -> bytes | None:
    """When the process started (clock ticks since boot, as /proc gives it), or None."""
    fields = _stat_fields(pid)
    return None if fields is None or len(fields) < 20 else fields[19]


class Reaper:
    """The spawn guard and, for a pid 1, the reaper of orphaned zombies (module docstring).
    While a spawn holds the guard, the agent's OOM score is `USER_OOM_SCORE_ADJ`, which its
    child inherits; the agent's own comes back once no spawn is under way."""

    __slots__ = (
        "_cond",
        "_oom",
        "_owned",
        "_pid",
        "_reaping",
        "_scan_due",
        "_spawning",
        "owed",
        "wake_fd",
    )

    def __init__(self, pid: int) -> None:
        self._pid = pid  # whose orphans: the agent's own pid (1 in its sandbox)
        self._cond = threading.Condition()
        self._spawning = 0  # spawns between their guard's entry and exit
        self._reaping = False  # a scan holds the guard alone (new spawns wait)
        # the agent's own children: pid -> start time, recorded under the guard; a pid is
        # forgotten by the first scan that no longer finds it in /proc
        self._owned: dict[int, bytes | None] = {}
        self._scan_due = False  # a scan is handed to a thread and has not begun
        # a scan no thread could take (the sandbox's pids limit, which its zombies hold):
        # the reading thread owes it (`reap_if_free`)
        self.owed = False
        self.wake_fd = -1  # readable when a SIGCHLD came (`start`); -1: not reaping
        self._oom = OomScore.own()  # lifted by the first spawn under way, put back by the last

    # ------------------------------------------------------------------ the guard

    def spawning(self) -> Reaper:
        """``with reaper.spawning(): child = Popen(...); reaper.own(child.pid)``"""
        return self

    def __enter__(self) -> Reaper:
        with self._cond:
            while self._reaping:
                self._cond.wait()
            if not self._spawning:
                self._oom.lift()
            self._spawning += 1
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        with self._cond:
            self._spawning -= 1
            if not self._spawning:
                self._oom.put_back()
                self._cond.notify_all()

    def own(self, pid: int) -> None:
        """Record a child the agent just started (inside `spawning`): never reaped here. A
        start time that cannot be read (no descriptor left) records the pid as ours anyway."""
        if self.wake_fd >= 0:
            self._owned[pid] = start_time(pid)

    # ------------------------------------------------------------------ the reaper

    def reap(self) -> None:
        """Wait for every zombie child of ours that the agent did not start."""
        with self._cond:
            self._reaping = True
            while self._spawning:
                self._cond.wait()
        try:
            self._reap_alone()
        finally:
            with self._cond:
                self._reaping = False
                self._cond.notify_all()

    def _reap_alone(self) -> None:
        present = set()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            present.add(pid)
            fields = _stat_fields(pid)
            if fields is None or len(fields) < 20 or fields[0] != b"Z":
                continue
            if int(fields[1]) != self._pid:
                continue  # someone else's child
            if pid in self._owned and self._owned[pid] in (None, fields[19]):
                continue  # the agent's own: whoever started it waits for it
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        for pid in [p for p in self._owned if p not in present]:
            del self._owned[pid]

    def start(self) -> bool:
        """Reap orphans from now on, if this process is pid 1 (from the main thread, before
        any spawn): True when it does, and `wake_fd` then turns readable on SIGCHLD."""
        if self._pid != 1:
            return False
        woken, wake = os.pipe()
        os.set_blocking(wake, False)
        os.set_blocking(woken, False)
        signal.signal(signal.SIGCHLD, _on_child)
        signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
        self.wake_fd = woken
        return True

    def woken(self, run: Callable[[Callable[[], None]], bool]) -> None:
        """`wake_fd` is readable: empty it and hand a scan to `run` (a thread of the
        agent's), unless one is due already; a signal after the scan begins asks for another.
        When `run` could start no thread, the scan is `owed`."""
        try:
            while os.read(self.wake_fd, 512):
                pass
        except BlockingIOError:
            pass
        with self._cond:
            if self._scan_due:
                return
            self._scan_due = True
        if not run(self._scan_later):
            self.owed = True

    def reap_if_free(self) -> bool:
        """The owed scan, now, unless a spawn is under way (never waits: for the reading
        thread, which a spawn's request may wait on); False when it is still owed."""
        with self._cond:
            if self._spawning or self._reaping:
                return False
            self._reaping = True
            self._scan_due = self.owed = False  # a signal from now on asks for another
        try:
            self._reap_alone()
        except Exception as exc:  # never the agent's end: the next SIGCHLD tries again
            log(f"reaper: {exc!r}")
        finally:
            with self._cond:
                self._reaping = False
                self._cond.notify_all()
        return True

    def _scan_later(self) -> None:
        time.sleep(SETTLE)
        with self._cond:
            self._scan_due = False
        try:
            self.reap()
        except Exception as exc:  # never the agent's end: the next SIGCHLD tries again
            log(f"reaper: {exc!r}")


class OomScore:
    """This process's `oom_score_adj`: kept, or lifted to `USER_OOM_SCORE_ADJ` for what it
    starts meanwhile. Best effort: where /proc has none or refuses a write, it is left as
    it is (and logged once)."""

    __slots__ = ("_fd", "_kept", "_lifted")

    def __init__(self, fd: int, kept: bytes) -> None:
        self._fd = fd  # -1: not adjusted
        self._kept = kept
        self._lifted = str(USER_OOM_SCORE_ADJ).encode()

    @classmethod
    def own(cls) -> OomScore:
        try:
            fd = os.open("/proc/self/oom_score_adj", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return cls(-1, b"")
        kept = os.pread(fd, 16, 0).strip()
        if not kept.lstrip(b"-").isdigit() or int(kept) >= USER_OOM_SCORE_ADJ:
            os.close(fd)  # already as high: its children are as likely to go as before
            return cls(-1, b"")
        return cls(fd, kept)

    def lift(self) -> None:
        self._write(self._lifted)

    def put_back(self) -> None:
        self._write(self._kept)

    def _write(self, value: bytes) -> None:
        if self._fd < 0:
            return
        try:
            os.pwrite(self._fd, value, 0)
        except OSError as exc:
            log(f"oom_score_adj left as it is: {exc!r}")
            os.close(self._fd)
            self._fd = -1


def _on_child(signum: int, frame: FrameType | None) -> None:
    """SIGCHLD's handler: nothing to do here; its wake-up byte wakes the reaper."""
