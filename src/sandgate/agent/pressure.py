"""Whether the host's CPUs are saturated: the kernel's pressure stall information for the CPU
(PSI, ``/proc/pressure/cpu``), the share of time in which some runnable task waited for one.

Work done ahead of demand, the shell warm.py starts after a command for the next one, pays
off while a CPU is free to do it between requests. Once every CPU is taken, for commands that
come back to back it is only more work, and every request waits longer for it (warm.py still
starts one after a command that came after a pause). Measured on a 2-CPU VM (docs/benchmarks.md,
"Session 23"), clients each sending `execute` back to back to a sandbox of its own: with 1
and 2 clients the shells started ahead gave 25 and 5 % more requests per second, with 4 and
8 clients 10 and 7 % fewer. The share of time with a task waiting for a CPU was 38, 67, 89
and 96 % with 1, 2, 4 and 8 clients when shells were started ahead, 3, 46, 78 and 92 % when
none was. So the CPUs count as saturated from `BUSY_FROM` of the time, and as free again
below `FREE_BELOW`; between the two, as they were, so that the load the shells add, gone
once none is started, does not flip the answer back and forth.

The share is measured over the time since the last measure, at least `WINDOW_SECONDS`: the
kernel's running total of stalled microseconds, read twice. PSI is host-wide (the sandbox's
own /proc shows the host's), which is the point: the CPUs are shared. Without PSI (a kernel
without it, or booted with psi=0), the CPUs never count as saturated.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from collections.abc import Callable

PSI_CPU = "/proc/pressure/cpu"
BUSY_FROM = 0.85  # the share of time with a task waiting for a CPU from which it is saturated
FREE_BELOW = 0.60  # ... and below which it no longer is
WINDOW_SECONDS = 0.25  # the shortest time a share is measured over


def read_stalled_us(path: str) -> int | None:
    """The kernel's running total of microseconds in which some task waited for a CPU (the
    ``total=`` of the file's ``some`` line); None if there is none to read."""
    try:
        with open(path, "rb", buffering=0) as psi:
            line = psi.read(256).split(b"\n", 1)[0]
    except OSError:  # no such file (a kernel without PSI, or booted with psi=0)
        return None
    _, found, total = line.rpartition(b" total=")
    if not found or not line.startswith(b"some ") or not total.isdigit():
        return None
    return int(total)


_UNREAD = -1  # CpuPressure._stalled before its first read


class CpuPressure:
    """Whether the host's CPUs are saturated, as last measured. Not thread-safe: its caller
    holds a lock (warm.Warm's)."""

    __slots__ = ("_at", "_read", "_stalled", "saturated")

    def __init__(self, read: Callable[[], int | None], now: float) -> None:
        self._read = read  # read_stalled_us of a path, or `never`
        self._at = now
        # the total at `_at`; _UNREAD until the first check (no read at the agent's start,
        # which is on a create's path); None: there is no PSI, the CPUs never count as saturated
        self._stalled: int | None = _UNREAD
        self.saturated = False

    def check(self, now: float) -> bool:
        """Whether the CPUs are saturated: measured again if the last measure is at least
        `WINDOW_SECONDS` old, else as last measured."""
        if self._stalled is None:
            return False
        if self._stalled == _UNREAD:
            self._at, self._stalled = now, self._read()  # the first: the start of a measure
            return False
        if now - self._at < WINDOW_SECONDS:
            return self.saturated
        stalled = self._read()
        if stalled is None:  # a read that failed (out of descriptors, say): tried again next
            self.saturated = False
            return False
        share = (stalled - self._stalled) / 1e6 / (now - self._at)
        self._at, self._stalled = now, stalled
        self.saturated = share >= (FREE_BELOW if self.saturated else BUSY_FROM)
        return self.saturated


def never() -> int | None:
    """A source of no stall information: the CPUs never count as saturated."""
    return None
