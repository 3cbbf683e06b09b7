"""Files through the API count their agent calls: a file of at most one chunk is one call each
way (`open_write` with `commit`, `open_read` with `first`), a larger one streams in chunks,
and an agent that predates the one-call forms (it ignores `commit` and `first`) still gets
every file right by the long way. The real app, worker service and agent (see conftest); the
relay is wrapped only to count, delay or fail the calls and, for the old agent, to drop the
new fields.

Where the agent takes offsets, the chunk calls of a larger file are under way several at a
time (`control/transfers.py`): the tests below check that they are, that their order on the
way does not matter, that an old agent still gets them one at a time, and that a failure
leaves nothing behind, no temp file and no call still running."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from sandgate.config import ServerSettings
from sandgate.control.transfers import WINDOW
from sandgate.errors import StorageFullError
from tests.fast.conftest import Fast, until

pytestmark = pytest.mark.anyio

CHUNK = ServerSettings.model_fields["file_chunk_bytes"].default  # the fast deployment's


@contextmanager
def agent_ops(fast: Fast, *, old_agent: bool = False) -> Iterator[list[str]]:
    """The agent ops the server relays while inside; with `old_agent`, without the fields an
    agent before one-call transfers did not know."""
    workers = fast.services.workers
    real = workers.request
    seen: list[str] = []

    async def relay(worker: Any, op: str, fields: dict[str, Any], *a: Any, **kw: Any) -> Any:
        if op != "agent":
            return await real(worker, op, fields, *a, **kw)
        call = dict(fields["call"])
        seen.append(call["op"])
        if not old_agent:
            return await real(worker, op, fields, *a, **kw)
        call.pop("commit", None) if call["op"] == "open_write" else None
        call.pop("first", None)  # what an agent that ignores them acts on
        call.pop("offset", None)
        reply, payload = await real(worker, op, {**fields, "call": call}, *a, **kw)
        reply = {k: v for k, v in reply.items() if k != "offsets"}  # it never says it takes them
        return reply, payload

    workers.request = relay  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        workers.request = real  # type: ignore[method-assign]


async def new_sandbox(fast: Fast) -> str:
    made = await fast.api.post("/api/v1/sandboxes", json={})
    assert made.status_code == 201, made.text
    return str(made.json()["name"])


@pytest.mark.parametrize("old_agent", [False, True])
async def test_small_files_take_one_call_and_large_ones_stream(fast: Fast, old_agent: bool) -> None:
    name = await new_sandbox(fast)
    files = f"/api/v1/sandboxes/{name}/toolbox/files"
    for size in (0, 5, CHUNK, CHUNK + 1, 2 * CHUNK + 3):
        data = os.urandom(size)
        with agent_ops(fast, old_agent=old_agent) as ops:
            put = await fast.api.put(files, params={"path": f"f{size}.bin"}, content=data)
        assert put.status_code in (200, 201), put.text
        assert put.json()["size"] == size
        if old_agent:
            assert ops[0] == "open_write" and ops[-1] == "close_write", ops
        elif size <= CHUNK:
            assert ops == ["open_write"], (size, ops)
        else:
            writes = -(-size // CHUNK)
            assert ops == ["open_write", *["write"] * writes, "close_write"], (size, ops)
        with agent_ops(fast, old_agent=old_agent) as ops:
            got = await fast.api.get(files, params={"path": f"f{size}.bin"})
        assert got.status_code == 200 and got.content == data, size
        assert got.headers["content-length"] == str(size)
        if old_agent:
            assert ops[0] == "open_read" and ops[-1] == "close_read", ops
        elif size <= CHUNK:
            assert ops == ["open_read"], (size, ops)
        else:
            reads = -(-(size - CHUNK) // CHUNK)
            assert ops == ["open_read", *["read"] * reads, "close_read"], (size, ops)


async def test_one_call_errors_are_the_long_ways(fast: Fast) -> None:
    name = await new_sandbox(fast)
    files = f"/api/v1/sandboxes/{name}/toolbox/files"
    refused = await fast.api.put(files, params={"path": "/workspace"}, content=b"x")
    assert refused.status_code == 409 and "directory" in refused.text, refused.text
    missing = await fast.api.get(files, params={"path": "nothing-here"})
    assert missing.status_code == 404, missing.text
    listed = await fast.api.get(f"{files}/list", params={"path": "/workspace"})
    assert listed.json()["entries"] == []  # no temp file left by the refused write


@contextmanager
def chunk_calls(
    fast: Fast, *, delay_first: float = 0.0, fail: int | None = None, slow: float = 0.0
) -> Iterator[dict[str, int]]:
    """Count the `write` and `read` calls under way at once (`most`) and still under way
    (`now`); hold the first of them back `delay_first` s so the next ones overtake it;
    fail the `fail`-th (from 1) with the error a full disk gives, after `slow` more s
    for every other."""
    workers = fast.services.workers
    real = workers.request
    counts = {"now": 0, "most": 0, "seen": 0}

    async def relay(worker: Any, op: str, fields: dict[str, Any], *a: Any, **kw: Any) -> Any:
        if op != "agent" or fields["call"]["op"] not in ("write", "read"):
            return await real(worker, op, fields, *a, **kw)
        counts["seen"] += 1
        nth = counts["seen"]
        counts["now"] += 1
        counts["most"] = max(counts["most"], counts["now"])
        try:
            if nth == 1 and delay_first:
                await asyncio.sleep(delay_first)
            if nth == fail:
                await asyncio.sleep(0.05)  # the others are under way meanwhile
                raise StorageFullError("no space left on the sandbox's disk")
            await asyncio.sleep(slow)
            return await real(worker, op, fields, *a, **kw)
        finally:
            counts["now"] -= 1

    workers.request = relay  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        workers.request = real  # type: ignore[method-assign]


@pytest.mark.parametrize("old_agent", [False, True])
async def test_a_large_files_chunks_are_under_way_together_in_any_order(
    fast: Fast, old_agent: bool
) -> None:
    name = await new_sandbox(fast)
    files = f"/api/v1/sandboxes/{name}/toolbox/files"
    data = os.urandom(6 * CHUNK + 7)
    with agent_ops(fast, old_agent=old_agent), chunk_calls(fast, delay_first=0.2) as counts:
        put = await fast.api.put(files, params={"path": "big.bin"}, content=data)
    assert put.status_code == 200 and put.json()["size"] == len(data), put.text
    # the first write arrived last: only a write at its own offset puts it in its place
    assert counts["most"] == (1 if old_agent else WINDOW), counts
    with agent_ops(fast, old_agent=old_agent), chunk_calls(fast, delay_first=0.2) as counts:
        got = await fast.api.get(files, params={"path": "big.bin"})
    assert got.status_code == 200 and got.content == data  # the first read answered last
    assert counts["most"] == (1 if old_agent else WINDOW), counts


async def test_a_failed_chunk_fails_the_upload_and_leaves_nothing_running(fast: Fast) -> None:
    name = await new_sandbox(fast)
    files = f"/api/v1/sandboxes/{name}/toolbox/files"
    with chunk_calls(fast, fail=1, slow=2.0) as counts:
        put = await fast.api.put(files, params={"path": "big.bin"}, content=os.urandom(6 * CHUNK))
        # the writes behind the failed one were cancelled and had ended before the answer
        assert counts["now"] == 0, counts
    assert put.status_code == 507, put.text
    assert counts["most"] == counts["seen"] == WINDOW, counts  # none started after it
    listed = await fast.api.get(f"{files}/list", params={"path": "/workspace"})
    assert listed.json()["entries"] == []  # neither the file nor its temp file


async def test_a_failed_read_ends_the_download_and_leaves_nothing_running(fast: Fast) -> None:
    name = await new_sandbox(fast)
    files = f"/api/v1/sandboxes/{name}/toolbox/files"
    put = await fast.api.put(files, params={"path": "big.bin"}, content=os.urandom(6 * CHUNK))
    assert put.status_code == 200, put.text
    with chunk_calls(fast, fail=1, slow=2.0) as counts:
        # the body breaks off after its headers: the ASGI transport raises the app's error
        # (a server cuts the connection)
        with pytest.raises(StorageFullError):
            await fast.api.get(files, params={"path": "big.bin"})
        # the reads behind the failed one were cancelled and had ended when the body broke off
        assert counts["now"] == 0, counts
    assert counts["most"] == counts["seen"] == WINDOW, counts


async def test_a_failed_write_fails_the_upload_while_the_client_is_silent(fast: Fast) -> None:
    """The failure waited for the client's next piece of body: a client that paused got its
    507 only when it sent more (or a 408 when the body's idle time ran out)."""
    name = await new_sandbox(fast)
    tenant = await fast.services.sandboxes.owner(name)
    assert tenant is not None

    async def body() -> AsyncIterator[bytes]:
        for _ in range(3):
            yield os.urandom(CHUNK // 2 + 1)  # a chunk and a half, then the client pauses
        await asyncio.sleep(30)
        yield b"x"

    with chunk_calls(fast, fail=1):
        upload = fast.services.toolbox.upload(
            tenant, name, "/workspace/up.bin", body(), chunk_bytes=CHUNK, max_bytes=1 << 30
        )
        with pytest.raises(StorageFullError):
            await asyncio.wait_for(upload, 10)  # not the client's 30 s


@pytest.mark.parametrize("cancels", [1, 2])
async def test_an_upload_cancelled_twice_still_discards_its_file(fast: Fast, cancels: int) -> None:
    """The partial file was discarded after the writes under way had ended, in a second
    shielded step: a second cancel, while the first step ran, skipped the discard and left
    the temp file on the sandbox's disk."""
    name = await new_sandbox(fast)
    tenant = await fast.services.sandboxes.owner(name)
    assert tenant is not None

    async def body() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield os.urandom(CHUNK)
        await asyncio.sleep(30)

    with agent_ops(fast) as ops, chunk_calls(fast, slow=0.2):
        upload = asyncio.create_task(
            fast.services.toolbox.upload(
                tenant, name, "/workspace/up.bin", body(), chunk_bytes=CHUNK, max_bytes=1 << 30
            )
        )
        await asyncio.sleep(0.1)  # writes under way
        for _ in range(cancels):
            upload.cancel()
            for _ in range(3):
                await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await upload

        async def discarded() -> bool:
            return "close_write" in ops

        await until(discarded)
    files = f"/api/v1/sandboxes/{name}/toolbox/files"
    listed = await fast.api.get(f"{files}/list", params={"path": "/workspace"})
    assert listed.json()["entries"] == []  # neither the file nor its temp file
