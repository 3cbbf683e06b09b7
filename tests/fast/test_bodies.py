"""A stalled streamed upload is answered 408 and its partial file discarded, not a 500
(issue 10: the body deadline turned the stall into a disconnect nobody answered)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.fast.conftest import fast_deployment

pytestmark = pytest.mark.anyio


async def test_a_stalled_upload_is_answered_408_and_leaves_nothing(tmp_path: Path) -> None:
    async with fast_deployment(tmp_path, body_idle_timeout=0.5) as fast:
        name = (await fast.api.post("/api/v1/sandboxes", json={})).json()["name"]
        files = f"/api/v1/sandboxes/{name}/toolbox/files"

        async def stalls() -> AsyncIterator[bytes]:
            yield b"x" * 100_000
            await asyncio.sleep(5)  # silent for longer than the deadline
            yield b"never read"

        r = await fast.api.put(files, params={"path": "/workspace/slow.bin"}, content=stalls())
        assert r.status_code == 408, r.text
        assert r.json()["error"]["code"] == "request_timeout"
        listed = await fast.api.get(f"{files}/list", params={"path": "/workspace"})
        assert listed.json()["entries"] == []
