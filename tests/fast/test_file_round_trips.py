"""Files through the API count their agent calls: a file of at most one chunk is one call each
way (`open_write` with `commit`, `open_read` with `first`), a larger one streams in chunks,
and an agent that predates the one-call forms (it ignores `commit` and `first`) still gets
every file right by the long way. The real app, worker service and agent (see conftest); the
relay is wrapped only to count the calls and, for the old agent, to drop the new fields."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from sandgate.config import ServerSettings
from tests.fast.conftest import Fast

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
        if op == "agent":
            call = dict(fields["call"])
            seen.append(call["op"])
            if old_agent:
                call.pop("commit", None) if call["op"] == "open_write" else None
                call.pop("first", None)  # what an agent that ignores them acts on
                fields = {**fields, "call": call}
        return await real(worker, op, fields, *a, **kw)

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
