"""RpcChannel on an in-memory link: two real channels talking to each other."""

from __future__ import annotations

import asyncio

import pytest

from sandgate.agent.frames import Header, decode
from sandgate.errors import (
    NotFoundError,
    PayloadTooLargeError,
    SandboxTimeoutError,
    TunnelUnavailableError,
)
from sandgate.tunnel.rpc import RpcChannel


def link() -> tuple[asyncio.Queue[bytes | None], asyncio.Queue[bytes | None]]:
    return asyncio.Queue(), asyncio.Queue()


def reader(queue: asyncio.Queue[bytes | None]):  # type: ignore[no-untyped-def]
    async def frames() -> tuple[Header, bytes] | None:
        data = await queue.get()
        return None if data is None else decode(data)

    return frames


async def handler(header: Header, payload: bytes) -> tuple[Header, bytes]:
    if header["op"] == "echo":
        return {"n": header["n"]}, payload[::-1]
    if header["op"] == "slow":
        await asyncio.sleep(header["s"])
        return {}, b""
    raise NotFoundError("no such thing")


def test_calls_both_ways_concurrently_and_errors() -> None:
    async def main() -> None:
        a_to_b, b_to_a = link()
        events: list[Header] = []
        got_event = asyncio.Event()
        pending_reached_b = asyncio.Event()

        async def on_event(header: Header, payload: bytes) -> None:
            events.append(header)
            got_event.set()

        async def b_handler(header: Header, payload: bytes) -> tuple[Header, bytes]:
            if header.get("tag") == "pending":
                pending_reached_b.set()
            return await handler(header, payload)

        a = RpcChannel(a_to_b.put, handler=handler, name="a")
        b = RpcChannel(b_to_a.put, handler=b_handler, on_event=on_event, name="b")
        serve_a = asyncio.create_task(a.serve(reader(b_to_a)))
        serve_b = asyncio.create_task(b.serve(reader(a_to_b)))
        answers = await asyncio.gather(*(a.call("echo", bytes([i]) * 3, n=i) for i in range(50)))
        assert [h["n"] for h, _ in answers] == list(range(50))
        header, body = await b.call("echo", b"abc", n=1)
        assert header["n"] == 1
        assert body == b"cba"
        with pytest.raises(NotFoundError, match="no such thing"):
            await a.call("missing")
        with pytest.raises(SandboxTimeoutError):
            await a.call("slow", wait=0.05, s=1.0)
        await a.event("hello", name="x")
        await asyncio.wait_for(got_event.wait(), 5)
        assert events == [{"event": "hello", "name": "x"}]
        # the link ends: waiting calls fail, later calls fail at once
        pending = asyncio.create_task(a.call("slow", s=5, tag="pending"))
        await asyncio.wait_for(pending_reached_b.wait(), 5)  # the call is in flight
        await b_to_a.put(None)
        with pytest.raises(TunnelUnavailableError):
            await pending
        with pytest.raises(TunnelUnavailableError):
            await a.call("echo", n=1)
        await a_to_b.put(None)
        await asyncio.gather(serve_a, serve_b)

    asyncio.run(main())


def test_an_answer_too_large_to_frame_fails_that_call_not_the_link() -> None:
    """A handler's answer above the frame limit (a workspace's diff, JSON-escaped) once took
    the whole tunnel down, failing every tenant's calls on that worker."""

    async def big(header: Header, payload: bytes) -> tuple[Header, bytes]:
        if header["op"] == "big":
            return {"text": "\x01" * 300_000}, b""  # escaped, 1.8 MB of header
        return await handler(header, payload)

    async def main() -> None:
        a_to_b, b_to_a = link()
        a = RpcChannel(a_to_b.put, handler=handler, name="a")
        b = RpcChannel(b_to_a.put, handler=big, name="b")
        serve_a = asyncio.create_task(a.serve(reader(b_to_a)))
        serve_b = asyncio.create_task(b.serve(reader(a_to_b)))
        with pytest.raises(PayloadTooLargeError, match="too large"):
            await a.call("big")
        header, _ = await a.call("echo", b"", n=7)  # the link still serves
        assert header["n"] == 7 and not a.closed and not b.closed
        for q in (a_to_b, b_to_a):
            await q.put(None)
        await asyncio.gather(serve_a, serve_b, return_exceptions=True)

    asyncio.run(main())
