"""The code-run stream's beat (api/beats.keep_alive): None while an event is slow,
and the slow event itself is never lost to the beat."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from sandgate.api.beats import keep_alive


async def slow_events(delays: list[float], log: list[str]) -> AsyncIterator[dict[str, Any]]:
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield {"n": i}
    except asyncio.CancelledError:
        log.append("cancelled")
        raise


def test_beats_while_an_event_is_slow_and_keeps_every_event() -> None:
    async def main() -> list[Any]:
        log: list[str] = []
        got = [e async for e in keep_alive(slow_events([0.0, 0.35, 0.0], log), 0.1)]
        assert log == []  # the wait for the slow event was never cancelled by a beat
        return got

    got = asyncio.run(main())
    assert [e for e in got if e is not None] == [{"n": 0}, {"n": 1}, {"n": 2}]
    beats = got.index({"n": 1}) - got.index({"n": 0}) - 1
    assert 2 <= beats <= 4, got  # about 0.35 s / 0.1 s
    assert got[-1] == {"n": 2} and got[-2] == {"n": 1}  # no beat where none was due


def test_a_consumer_that_leaves_stops_the_run() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        beats = keep_alive(slow_events([10.0], log), 0.05)
        assert await anext(beats) is None
        await beats.aclose()  # the client went away mid-wait
        await asyncio.sleep(0)
        return log

    assert asyncio.run(main()) == ["cancelled"]
