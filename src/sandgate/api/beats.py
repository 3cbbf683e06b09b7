"""A stream's beat: what keeps a long, quiet stream (a code run waiting for output) from
looking dead to its client's read timeout and to idle proxies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar

Event = TypeVar("Event")


async def keep_alive(
    events: AsyncIterator[Event], every: float
) -> AsyncGenerator[Event | None, None]:
    """`events`, with None whenever `every` seconds pass without one (the wait for the
    event goes on: it is never cancelled for the beat)."""
    while True:
        waiting = asyncio.ensure_future(anext(events))
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=every)
                if not waiting.done():
                    yield None
            try:
                event = waiting.result()
            except StopAsyncIteration:
                return
        finally:
            if not waiting.done():
                waiting.cancel()
        yield event
