"""The create pipeline, the seam and admission through the real app and a real worker
service, in one process (see conftest): what the subprocess suite checks, in seconds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sandgate.core.clock import utcnow
from sandgate.store.base import TenantLimits
from tests.fast.conftest import Fast, fast_deployment, until

pytestmark = pytest.mark.anyio


async def test_create_execute_files_and_delete(fast: Fast) -> None:
    created = await fast.api.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "k1"})
    assert created.status_code == 201, created.text
    name = created.json()["name"]
    assert created.json()["worker"] == "fast-worker" and created.json()["state"] == "running"
    again = await fast.api.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "k1"})
    assert again.status_code == 200 and again.json()["name"] == name
    assert again.headers["idempotent-replayed"] == "true"

    ran = await fast.api.post(
        f"/api/v1/sandboxes/{name}/execute", json={"code": "echo out; echo err >&2; exit 3"}
    )
    assert ran.status_code == 200, ran.text
    assert (ran.json()["stdout"], ran.json()["stderr"], ran.json()["exit_code"]) == (
        "out\n",
        "err\n",
        3,
    )

    files = f"/api/v1/sandboxes/{name}/toolbox/files"
    put = await fast.api.put(files, params={"path": "/workspace/a.txt"}, content=b"x" * 300_000)
    assert put.status_code == 200 and put.json()["size"] == 300_000, put.text
    got = await fast.api.get(files, params={"path": "/workspace/a.txt"})
    assert got.content == b"x" * 300_000
    listed = await fast.api.get(f"{files}/list", params={"path": "/workspace"})
    assert [e["name"] for e in listed.json()["entries"]] == ["a.txt"]
    missing = await fast.api.get(f"{files}/stat", params={"path": "/workspace/nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

    assert (await fast.api.delete(f"/api/v1/sandboxes/{name}")).status_code == 204
    gone = await fast.api.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "true"})
    assert gone.status_code == 404, gone.text
    assert name not in fast.worker.state.sandboxes


async def test_another_tenant_sees_nothing(fast: Fast) -> None:
    name = (await fast.api.post("/api/v1/sandboxes", json={})).json()["name"]
    for path in (f"/api/v1/sandboxes/{name}", f"/api/v1/sandboxes/{name}/toolbox/files/list"):
        assert (await fast.beta.get(path)).status_code == 404
    ran = await fast.beta.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "id"})
    assert ran.status_code == 404
    assert (await fast.beta.get("/api/v1/sandboxes")).json()["sandboxes"] == []


async def test_a_sandbox_the_worker_lost_answers_409_by_code(fast: Fast) -> None:
    """The worker answers `not_running` itself (a code, not a message the control plane
    matches) when asked about a sandbox it no longer runs."""
    name = (await fast.api.post("/api/v1/sandboxes", json={})).json()["name"]
    await fast.worker.destroy(name)  # behind the control plane's back
    ran = await fast.api.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "true"})
    assert ran.status_code == 409, ran.text
    assert ran.json()["error"]["code"] == "not_running"


async def test_processes_stream_through_the_seam(fast: Fast) -> None:
    name = (await fast.api.post("/api/v1/sandboxes", json={})).json()["name"]
    base = f"/api/v1/sandboxes/{name}/toolbox/processes"
    started = await fast.api.post(base, json={"command": "printf 'a\\nb\\n'; exit 4"})
    assert started.status_code == 201, started.text
    pid = started.json()["pid"]
    async with fast.api.stream("GET", f"{base}/{pid}/stream") as events:
        body = b"".join([chunk async for chunk in events.aiter_bytes()]).decode()
    assert "event: stdout" in body and '"exit_code": 4' in body, body
    listed = (await fast.api.get(base)).json()["processes"]
    assert [p["pid"] for p in listed] == [pid]


async def test_the_queue_takes_a_create_when_capacity_frees(tmp_path: Path) -> None:
    async with fast_deployment(tmp_path, capacity=1) as fast:
        first = (await fast.api.post("/api/v1/sandboxes", json={})).json()["name"]
        queued = asyncio.ensure_future(fast.beta.post("/api/v1/sandboxes", json={}))

        async def waiting() -> bool:
            return (await fast.services.store.admission_snapshot(utcnow())).queued >= 1

        await until(waiting)
        assert not queued.done()
        assert (await fast.api.delete(f"/api/v1/sandboxes/{first}")).status_code == 204
        placed = await asyncio.wait_for(queued, 20)
        assert placed.status_code == 201, placed.text


async def test_a_tenant_at_its_quota_gets_429_and_the_other_does_not(fast: Fast) -> None:
    store = fast.services.store
    alpha = (await store.ensure_tenant("alpha")).id
    await store.set_tenant_limits(TenantLimits(alpha, max_sandboxes=1), utcnow())
    fast.services.state.limits_cache.clear()  # the limits configuration is cached for 5 s
    assert (await fast.api.post("/api/v1/sandboxes", json={})).status_code == 201
    refused = await fast.api.post("/api/v1/sandboxes", json={})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "quota_exceeded"
    assert (await fast.beta.post("/api/v1/sandboxes", json={})).status_code == 201


async def test_an_exec_job_runs_once_and_is_fetched_by_id(fast: Fast) -> None:
    name = (await fast.api.post("/api/v1/sandboxes", json={})).json()["name"]
    body = {"command": "echo job-$((6*7))"}
    headers = {"Idempotency-Key": "job-1"}
    submitted = await fast.api.post(
        f"/api/v1/sandboxes/{name}/exec-jobs", json=body, headers=headers
    )
    assert submitted.status_code in (201, 202), submitted.text
    job = submitted.json()["id"]
    again = await fast.api.post(f"/api/v1/sandboxes/{name}/exec-jobs", json=body, headers=headers)
    assert again.json()["id"] == job

    async def finished() -> bool:
        got = await fast.api.get(f"/api/v1/exec-jobs/{job}")
        return bool(got.json()["state"] in ("succeeded", "failed"))

    await until(finished)
    done = (await fast.api.get(f"/api/v1/exec-jobs/{job}")).json()
    assert (done["state"], done["stdout"]) == ("succeeded", "job-42\n")
    assert (await fast.beta.get(f"/api/v1/exec-jobs/{job}")).status_code == 404
