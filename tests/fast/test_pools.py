"""Warm pools (worker/pool.py): sandboxes started before any create, handed out on create.

The real app and a real worker service (process runtime) in one process; the worker keeps
`--pool` sandboxes started and the control plane places by the capacity it reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fast.conftest import Fast, fast_deployment, until

pytestmark = pytest.mark.anyio


async def pooled(fast: Fast, template: str, count: int) -> None:
    await until(lambda: _ready(fast, template, count), within=60)


async def _ready(fast: Fast, template: str, count: int) -> bool:
    return len(fast.worker.state.pool.get(template, [])) >= count


def started_as(fast: Fast, name: str) -> str:
    """The name the sandbox was started under: a pool's own, or the create's."""
    return fast.worker.state.sandboxes[name].running.spec.name


async def create(fast: Fast, **body: Any) -> str:
    answer = await (body.pop("client", None) or fast.api).post("/api/v1/sandboxes", json=body)
    assert answer.status_code == 201, answer.text
    name: str = answer.json()["name"]
    return name


async def execute(fast: Fast, name: str, code: str) -> str:
    ran = await fast.api.post(f"/api/v1/sandboxes/{name}/execute", json={"code": code})
    assert ran.status_code == 200, ran.text
    stdout: str = ran.json()["stdout"]
    return stdout


async def test_a_create_takes_a_pooled_sandbox_and_the_pool_refills(tmp_path: Path) -> None:
    async with fast_deployment(tmp_path, capacity=5, pools={"default": 2}) as fast:
        await pooled(fast, "default", 2)
        workers = (await fast.api.get("/api/v1/workers")).json()["workers"]
        assert [w["capacity"] for w in workers] == [3], "it reports what the pool leaves"
        name = await create(fast, env={"GREETING": "from the create"})
        assert started_as(fast, name).startswith("pool-")
        assert await execute(fast, name, "echo $GREETING") == "from the create\n"
        await pooled(fast, "default", 2)  # refilled
        # asked not to, or for other resources, or for a network: a cold start
        cold = await create(fast, pool=False)
        assert started_as(fast, cold) == cold
        other = await create(fast, resources={"memory_mb": 256})
        assert started_as(fast, other) == other
        assert len(fast.worker.state.pool["default"]) == 2


async def test_nothing_of_an_earlier_tenant_is_in_a_pooled_sandbox(tmp_path: Path) -> None:
    async with fast_deployment(tmp_path, capacity=4, pools={"default": 1}) as fast:
        await pooled(fast, "default", 1)
        first = await create(fast)
        first_pooled = started_as(fast, first)
        assert first_pooled.startswith("pool-")
        await execute(fast, first, "echo secret > left.txt; export LEFT=1")
        assert (await fast.api.delete(f"/api/v1/sandboxes/{first}")).status_code == 204
        await pooled(fast, "default", 1)
        theirs = await create(fast, client=fast.beta)
        assert started_as(fast, theirs).startswith("pool-")
        assert started_as(fast, theirs) != first_pooled, "a deleted sandbox never goes back"
        ran = await fast.beta.post(
            f"/api/v1/sandboxes/{theirs}/execute",
            json={"code": "ls; echo ${LEFT:-none}"},
        )
        assert ran.json()["stdout"] == "none\n", "a pooled sandbox is handed out once, fresh"


async def test_a_code_interpreter_pool_hands_out_a_ready_kernel(tmp_path: Path) -> None:
    async with fast_deployment(tmp_path, capacity=3, pools={"code-interpreter": 1}) as fast:
        await pooled(fast, "code-interpreter", 1)
        name = await create(fast, template="code-interpreter", env={"K": "handed"})
        assert started_as(fast, name).startswith("pool-")
        contexts = (await fast.api.get(f"/api/v1/sandboxes/{name}/contexts")).json()
        assert [c["id"] for c in contexts] == ["default"]
        ran = await fast.api.post(
            f"/api/v1/sandboxes/{name}/run-code",
            json={"code": "import os; os.environ['K']"},
        )
        results = [
            json.loads(line[len("data: ") :])
            for line in ran.text.splitlines()
            if line.startswith("data: ")
        ]
        assert any(r.get("text") == "'handed'" for r in results), ran.text
        # a cold code-interpreter sandbox boots its kernel too
        cold = await create(fast, template="code-interpreter", pool=False)
        assert started_as(fast, cold) == cold
        ran = await fast.api.post(f"/api/v1/sandboxes/{cold}/run-code", json={"code": "6*7"})
        assert '"text": "42"' in ran.text
