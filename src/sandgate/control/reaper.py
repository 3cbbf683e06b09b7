"""The reaper: stops and removes sandboxes past `expires_at`. Idempotent; trusts the store.

It runs as the loop "reaper" of the instance's supervisor (`control/supervisor.py`), which
repeats `tick` every `interval` s, bounded by `tick_timeout`, and restarts it with backoff
when it fails.
"""

from __future__ import annotations

import logging

from sandgate.control.sandboxes import SandboxService

log = logging.getLogger(__name__)

FAULT_FAILURES = 4  # iterations the `fail-reaper` fault point fails (sandgate.faults)


class Reaper:
    def __init__(
        self,
        sandboxes: SandboxService,
        *,
        interval: float,
        tick_timeout: float = 60.0,
        faults: frozenset[str] = frozenset(),
    ) -> None:
        self.sandboxes = sandboxes
        self.interval = interval
        self.tick_timeout = tick_timeout
        self._failures_left = FAULT_FAILURES if "fail-reaper" in faults else 0

    async def tick(self) -> int:
        """Stop the sandboxes past their `expires_at`; returns how many."""
        if self._failures_left > 0:
            self._failures_left -= 1
            raise RuntimeError(f"fault fail-reaper: {self._failures_left} more failures to come")
        return await self.sandboxes.expire_due()
