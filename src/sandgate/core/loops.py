"""The supervision policy of long-lived loops: how long a failed loop waits before it runs
again, and when a loop that keeps failing makes its instance not ready.

A loop is a named iteration run again and again (the reaper's sweep, a recovery tick, the
renewal of a tunnel owner on each heartbeat). After a failed iteration the next one waits
`Backoff.delay(failures)`: 0.5 s, doubling to 30 s; one healthy iteration resets the count.
A loop whose last `UNREADY_AFTER_FAILURES` iterations failed, or that has been failing for
`UNREADY_AFTER` s, is a problem of its instance (`/readyz` answers 503 naming it) until an
iteration succeeds again.

Pure: no IO, no asyncio; the clock is passed in (aware UTC).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

UNREADY_AFTER_FAILURES = 3  # failed iterations in a row that make the instance not ready...
UNREADY_AFTER = 30.0  # ...or seconds of failing, whichever comes first
ERROR_CHARS = 300  # the last error is kept (and shown) at most this long


@dataclass(frozen=True)
class Backoff:
    first_delay: float = 0.5  # seconds before the run after a first failure
    max_delay: float = 30.0
    factor: float = 2.0

    def delay(self, failures: int) -> float:
        """Seconds to wait before the next run after `failures` failed iterations in a row."""
        if failures < 1:
            return 0.0
        return min(self.max_delay, self.first_delay * self.factor ** min(failures - 1, 64))


@dataclass
class LoopHealth:
    """What is known of one named loop: its streak of failures, if it is failing."""

    name: str
    failures: int = 0  # failed iterations in a row (0: the last one succeeded)
    failing_since: datetime | None = None  # when the first failure of this streak happened
    last_error: str = ""
    last_ok_at: datetime | None = None

    def failed(self, error: str, now: datetime) -> None:
        if self.failures == 0:
            self.failing_since = now
        self.failures += 1
        self.last_error = error[:ERROR_CHARS]

    def succeeded(self, now: datetime) -> int:
        """Record a healthy iteration; returns how many failures in a row it ends (0: none)."""
        ended = self.failures
        self.failures = 0
        self.failing_since = None
        self.last_error = ""
        self.last_ok_at = now
        return ended

    def problem(
        self,
        now: datetime,
        *,
        after_failures: int = UNREADY_AFTER_FAILURES,
        after: float = UNREADY_AFTER,
    ) -> str | None:
        """Why this loop makes its instance not ready, or None while it does not."""
        if self.failures == 0 or self.failing_since is None:
            return None
        if self.failures < after_failures and (now - self.failing_since).total_seconds() < after:
            return None
        since = self.failing_since.isoformat(timespec="seconds")
        return (
            f"loop {self.name}: failing since {since}, {self.failures} failures in a row "
            f"({self.last_error})"
        )
