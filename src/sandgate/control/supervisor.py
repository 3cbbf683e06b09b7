"""The supervisor of an instance's long-lived loops (the reaper, recovery).

The lifespan starts each loop by name in its one task group; `start` returns once the loop
reported that it started (`loop.started`). A loop is an iteration (`tick`) run every
`interval` s, each bounded by `tick_timeout`. An iteration that raises is logged with its
traceback (`loop.failed`) and the loop runs again after a backoff (`sandgate.core.loops`:
0.5 s doubling to 30 s, reset by a healthy iteration); one that overruns its timeout is
cancelled and counts as a failure too (`loop.tick_timeout`). What the supervisor knows of
each loop is kept in `ServerLocalState.loops`, which `/readyz` reads: a loop that keeps
failing makes the instance answer 503 with its name until an iteration succeeds
(`loop.recovered`). Nothing a loop raises is swallowed; cancellation ends the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from sandgate.core.clock import utcnow
from sandgate.core.loops import Backoff, LoopHealth

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loop:
    name: str  # shown in the log and in /readyz: "reaper", "recovery"
    tick: Callable[[], Awaitable[object]]  # one iteration; idempotent, trusts the store
    interval: float  # seconds between the end of a healthy iteration and the next
    tick_timeout: float  # an iteration running longer is cancelled and counts as failed


class Supervisor:
    def __init__(
        self,
        tasks: asyncio.TaskGroup,
        health: dict[str, LoopHealth],
        *,
        backoff: Backoff | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._tasks = tasks
        self._health = health  # ServerLocalState.loops
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._running: dict[str, asyncio.Task[None]] = {}

    async def start(self, loop: Loop) -> None:
        """Run `loop` in the task group until `cancel`; return once it has started."""
        if loop.name in self._running:
            raise ValueError(f"loop {loop.name!r} is already running")
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = self._tasks.create_task(self._run(loop, started), name=f"loop {loop.name}")
        self._running[loop.name] = task
        await started

    def cancel(self) -> None:
        """Stop every loop (the task group awaits them)."""
        for task in self._running.values():
            task.cancel()
        self._running.clear()

    async def _run(self, loop: Loop, started: asyncio.Future[None]) -> None:
        health = self._health.setdefault(loop.name, LoopHealth(loop.name))
        log.info(
            "loop.started",
            extra={"loop": loop.name, "interval": loop.interval, "tick_timeout": loop.tick_timeout},
        )
        started.set_result(None)
        while True:
            error = await self._iterate(loop)
            if error is None:
                if ended := health.succeeded(self._clock()):
                    log.info("loop.recovered", extra={"loop": loop.name, "failures": ended})
                await asyncio.sleep(loop.interval)
                continue
            health.failed(error, self._clock())
            delay = self._backoff.delay(health.failures)
            log.warning(
                "loop.restarting",
                extra={"loop": loop.name, "failures": health.failures, "retry_in": delay},
            )
            await asyncio.sleep(delay)

    async def _iterate(self, loop: Loop) -> str | None:
        """Run one iteration: None if it succeeded, else what went wrong (already logged)."""
        try:
            async with asyncio.timeout(loop.tick_timeout) as scope:
                await loop.tick()
        except TimeoutError as exc:
            if not scope.expired():  # a timeout of something the iteration awaited
                log.exception("loop.failed", extra={"loop": loop.name})
                return f"TimeoutError: {exc}"
            log.warning(
                "loop.tick_timeout", extra={"loop": loop.name, "tick_timeout": loop.tick_timeout}
            )
            return f"an iteration ran past its {loop.tick_timeout:g} s timeout"
        except Exception as exc:
            log.exception("loop.failed", extra={"loop": loop.name})
            return f"{type(exc).__name__}: {exc}"
        return None
