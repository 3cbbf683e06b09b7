"""The supervision of long-lived loops: the backoff and readiness policy (pure, fake clock),
and the supervisor running real iterations that fail."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import pytest

from sandgate.control.supervisor import Loop, Supervisor
from sandgate.core.loops import UNREADY_AFTER, UNREADY_AFTER_FAILURES, Backoff, LoopHealth

NOW = datetime(2026, 11, 30, 12, tzinfo=UTC)


def test_backoff_doubles_from_half_a_second_to_thirty() -> None:
    backoff = Backoff()
    assert [backoff.delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert backoff.delay(0) == 0.0
    assert backoff.delay(10_000) == 30.0  # no overflow however long it fails


def test_a_healthy_iteration_resets_the_backoff() -> None:
    health = LoopHealth("reaper")
    backoff = Backoff()
    for _ in range(5):
        health.failed("RuntimeError: boom", NOW)
    assert backoff.delay(health.failures) == 8
    assert health.succeeded(NOW) == 5
    health.failed("RuntimeError: again", NOW)
    assert backoff.delay(health.failures) == 0.5


def test_not_ready_after_enough_failures_in_a_row() -> None:
    health = LoopHealth("reaper")
    for n in range(1, UNREADY_AFTER_FAILURES):
        health.failed(f"RuntimeError: boom {n}", NOW)
        assert health.problem(NOW) is None
    health.failed("RuntimeError: the last one", NOW + timedelta(seconds=2))
    problem = health.problem(NOW + timedelta(seconds=2))
    assert problem == (
        "loop reaper: failing since 2026-11-30T12:00:00+00:00, 3 failures in a row "
        "(RuntimeError: the last one)"
    )


def test_not_ready_after_failing_long_enough_even_with_few_failures() -> None:
    health = LoopHealth("recovery")
    health.failed("StoreError: locked", NOW)
    assert health.problem(NOW + timedelta(seconds=UNREADY_AFTER - 1)) is None
    problem = health.problem(NOW + timedelta(seconds=UNREADY_AFTER))
    assert problem is not None and problem.startswith("loop recovery: failing since")


def test_ready_again_after_one_healthy_iteration() -> None:
    health = LoopHealth("reaper")
    for _ in range(10):
        health.failed("RuntimeError: boom", NOW)
    assert health.problem(NOW) is not None
    health.succeeded(NOW + timedelta(seconds=1))
    assert health.problem(NOW + timedelta(seconds=1)) is None
    assert health.failing_since is None and health.last_error == ""
    assert health.last_ok_at == NOW + timedelta(seconds=1)


def test_the_error_kept_is_bounded() -> None:
    health = LoopHealth("reaper")
    health.failed("x" * 10_000, NOW)
    assert len(health.last_error) == 300


class Flaky:
    """An iteration that fails its first `failures` runs (a real exception, raised here)."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.runs = 0
        self.healthy = asyncio.Event()

    async def tick(self) -> None:
        self.runs += 1
        if self.runs <= self.failures:
            raise RuntimeError(f"boom {self.runs}")
        self.healthy.set()


def test_the_supervisor_logs_restarts_with_backoff_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sandgate.control.supervisor")
    health: dict[str, LoopHealth] = {}
    asyncio.run(_flaky_loop(caplog, health))
    failed = [r for r in caplog.records if r.getMessage() == "loop.failed"]
    assert len(failed) == 3
    assert all(r.exc_info and r.exc_info[0] is RuntimeError for r in failed)  # the traceback
    restarts = [r for r in caplog.records if r.getMessage() == "loop.restarting"]
    assert [getattr(r, "retry_in", None) for r in restarts] == [0.01, 0.02, 0.04]
    recovered = [r for r in caplog.records if r.getMessage() == "loop.recovered"]
    assert [(getattr(r, "loop", None), getattr(r, "failures", None)) for r in recovered] == [
        ("flaky", 3)
    ]
    assert health["flaky"].failures == 0 and health["flaky"].last_ok_at is not None


async def _flaky_loop(caplog: pytest.LogCaptureFixture, health: dict[str, LoopHealth]) -> None:
    flaky = Flaky(failures=3)
    async with asyncio.TaskGroup() as tasks:
        supervisor = Supervisor(tasks, health, backoff=Backoff(first_delay=0.01, max_delay=0.04))
        await supervisor.start(Loop("flaky", flaky.tick, interval=60.0, tick_timeout=5.0))
        started = [r for r in caplog.records if r.getMessage() == "loop.started"]
        assert [getattr(r, "loop", None) for r in started] == ["flaky"]
        await asyncio.wait_for(flaky.healthy.wait(), 5)
        await asyncio.sleep(0)  # let it record the healthy iteration
        supervisor.cancel()


def test_an_iteration_past_its_timeout_is_cancelled_and_counts_as_a_failure() -> None:
    asyncio.run(_an_iteration_past_its_timeout_is_cancelled_and_counts_as_a_failure())


async def _an_iteration_past_its_timeout_is_cancelled_and_counts_as_a_failure() -> None:
    runs = 0
    fourth = asyncio.Event()  # set when the 4th run starts: 3 failures are recorded by then

    async def slow() -> None:
        nonlocal runs
        runs += 1
        if runs == 4:
            fourth.set()
        await asyncio.sleep(60)

    health: dict[str, LoopHealth] = {}
    async with asyncio.TaskGroup() as tasks:
        supervisor = Supervisor(tasks, health, backoff=Backoff(first_delay=0.01, max_delay=0.01))
        await supervisor.start(Loop("slow", slow, interval=60.0, tick_timeout=0.02))
        await asyncio.wait_for(fourth.wait(), 5)
        supervisor.cancel()
    assert health["slow"].failures == 3
    assert "ran past its 0.02 s timeout" in health["slow"].last_error


def test_cancellation_ends_a_loop_and_is_not_a_failure() -> None:
    asyncio.run(_cancellation_ends_a_loop_and_is_not_a_failure())


async def _cancellation_ends_a_loop_and_is_not_a_failure() -> None:
    entered = asyncio.Event()

    async def waits() -> None:
        entered.set()
        await asyncio.sleep(60)

    health: dict[str, LoopHealth] = {}
    async with asyncio.TaskGroup() as tasks:
        supervisor = Supervisor(tasks, health)
        await supervisor.start(Loop("waits", waits, interval=1.0, tick_timeout=120.0))
        await entered.wait()
        supervisor.cancel()
    assert health["waits"].failures == 0


def test_a_name_runs_once() -> None:
    asyncio.run(_a_name_runs_once())


async def _a_name_runs_once() -> None:
    async def tick() -> None:
        pass

    async with asyncio.TaskGroup() as tasks:
        supervisor = Supervisor(tasks, {})
        await supervisor.start(Loop("once", tick, interval=60.0, tick_timeout=1.0))
        with pytest.raises(ValueError, match="already running"):
            await supervisor.start(Loop("once", tick, interval=60.0, tick_timeout=1.0))
        supervisor.cancel()
