"""A worker stops on SIGTERM even when its one cancellation is swallowed (Python 3.11's
wait_for can lose one, gh-86296: a CI worker kept running for minutes after SIGTERM), and
once its teardown runs, no further stop request cuts it short."""

from __future__ import annotations

import asyncio

import pytest

from sandgate.worker import main as worker_main


def test_a_swallowed_cancellation_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_main, "STOP_RECANCEL", 0.1)

    async def scenario() -> int:
        swallowed = 0

        async def work() -> None:
            nonlocal swallowed
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed += 1  # lost, as wait_for's race loses one
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]

        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        await asyncio.wait_for(worker_main.run_until_stopped(work(), stop, lambda: False), 5)
        return swallowed

    assert asyncio.run(scenario()) == 1


def test_a_teardown_in_progress_is_not_cancelled_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_main, "STOP_RECANCEL", 0.1)

    async def scenario() -> list[str]:
        seen: list[str] = []
        tearing_down = False

        async def work() -> None:
            nonlocal tearing_down
            try:
                await asyncio.sleep(10)
            finally:
                tearing_down = True
                try:
                    await asyncio.sleep(0.4)  # longer than STOP_RECANCEL: re-asked if wrong
                    seen.append("teardown finished")
                except asyncio.CancelledError:
                    seen.append("teardown cut short")
                    raise

        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        await worker_main.run_until_stopped(work(), stop, lambda: tearing_down)
        return seen

    assert asyncio.run(scenario()) == ["teardown finished"]


def test_work_that_fails_on_its_own_raises() -> None:
    async def scenario() -> None:
        async def work() -> None:
            raise RuntimeError("the tunnel client broke")

        await worker_main.run_until_stopped(work(), asyncio.Event(), lambda: False)

    try:
        asyncio.run(scenario())
    except RuntimeError as exc:
        assert "broke" in str(exc)
    else:
        raise AssertionError("the failure was lost")
