"""Admission on the all-in-one default (one instance, SQLite, a real bwrap worker): the
answers a client sees for a rate limit, a quota, a full queue, and GET /api/v1/admission.
(Two instances on PostgreSQL: tests/e2e/test_admission_multi.py.)
"""

from __future__ import annotations

import concurrent.futures
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.api.conftest import (
    Deployment,
    sandgate,
    start_deployment,
    tear_down,
    wait_until,
)


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Deployment]:
    """A queue of 1 in front of a worker of capacity 1."""
    dep = start_deployment(tmp_path, worker=False, server_args=("--queue-limit", "1"))
    try:
        dep.start_worker(capacity=1)
        yield dep
    finally:
        tear_down(dep)


def tenant(dep: Deployment, name: str, *limits: str) -> httpx.Client:
    key = sandgate("keys", "create", "--db", dep.db, "--tenant", name)
    if limits:
        shown = sandgate("tenants", "limit", "--db", dep.db, name, *limits)
        assert shown.startswith(f"tenant {name}: ")
    return httpx.Client(base_url=dep.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_admission_status_shows_queue_breaker_and_own_limits(small: Deployment) -> None:
    with tenant(small, "plain") as plain, tenant(small, "capped", "--max-sandboxes", "4") as capped:
        status = plain.get("/api/v1/admission").json()
        assert status["view"] == "tenant" and status["enabled"] is True
        assert status["queue"] == {"your_queued": 0, "limit": 1, "timeout": 120.0}
        with small.admin() as admin:
            fleet = admin.get("/api/v1/admission").json()
        assert fleet["view"] == "fleet"
        assert fleet["queue"] == {"length": 0, "limit": 1, "timeout": 120.0}
        assert fleet["breaker"] == status["breaker"] and "tenant_limits" not in fleet
        breaker = status["breaker"]
        assert breaker["state"] == "closed" and breaker["reason"] is None
        assert (breaker["threshold"], breaker["window"], breaker["open_for"]) == (3, 600.0, 60.0)
        assert status["recent_timeouts"] == [] and status["tenant_limits"] is None
        limits = capped.get("/api/v1/admission").json()["tenant_limits"]
        assert limits == {"rps": None, "burst": None, "max_sandboxes": 4, "max_exec_jobs": None}


def test_rate_limit_answers_429_with_the_limit_and_retry_after(small: Deployment) -> None:
    with tenant(small, "chatty", "--rps", "0.5", "--burst", "2") as chatty:
        codes = [chatty.get("/api/v1/sandboxes").status_code for _ in range(4)]
        assert codes == [200, 200, 429, 429]
        refused = chatty.get("/api/v1/sandboxes")
        error = refused.json()["error"]
        assert error["code"] == "rate_limited" and error["limit"] == "rps"
        assert "0.5 requests per second (burst 2)" in error["message"]
        assert 1 <= int(refused.headers["Retry-After"]) <= 2
    with tenant(small, "other") as other:  # another tenant is not slowed down
        assert [other.get("/api/v1/sandboxes").status_code for _ in range(5)] == [200] * 5


def test_quota_of_live_sandboxes(small: Deployment) -> None:
    with tenant(small, "one", "--max-sandboxes", "1") as one:
        first = one.post("/api/v1/sandboxes", json={})
        assert first.status_code == 201, first.text
        refused = one.post("/api/v1/sandboxes", json={})
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "quota_exceeded" and error["limit"] == "max_sandboxes"
        assert "1 live sandboxes" in error["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        assert one.delete(f"/api/v1/sandboxes/{first.json()['name']}").status_code == 204
        again = one.post("/api/v1/sandboxes", json={})
        assert again.status_code == 201, again.text
        assert one.delete(f"/api/v1/sandboxes/{again.json()['name']}").status_code == 204


def test_a_full_worker_queues_creates_up_to_the_limit(small: Deployment) -> None:
    with (
        small.client() as alpha,
        small.admin() as admin,
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
    ):
        filler = alpha.post("/api/v1/sandboxes", json={})
        assert filler.status_code == 201, filler.text

        def create_queued() -> httpx.Response:
            with small.client() as client:
                return client.post("/api/v1/sandboxes", json={})

        queued = pool.submit(create_queued)
        wait_until(
            lambda: admin.get("/api/v1/admission").json()["queue"]["length"] == 1,
            what="one create queued",
        )
        over = alpha.post("/api/v1/sandboxes", json={})
        assert over.status_code == 429, over.text
        assert over.json()["error"] == {
            "code": "queue_full",
            "message": over.json()["error"]["message"],
            "limit": "queue_limit",
        }
        assert "1 creates already wait" in over.json()["error"]["message"]
        assert not queued.done()
        assert alpha.delete(f"/api/v1/sandboxes/{filler.json()['name']}").status_code == 204
        placed = queued.result(timeout=60)
        assert placed.status_code == 201, placed.text
        assert admin.get("/api/v1/admission").json()["queue"]["length"] == 0
        assert alpha.delete(f"/api/v1/sandboxes/{placed.json()['name']}").status_code == 204


def test_tenants_limit_refuses_nonsense(small: Deployment) -> None:
    for args, problem in ((("--burst", "3"), "--burst needs --rps"), (("--rps", "0"), "positive")):
        with pytest.raises(subprocess.CalledProcessError) as failed:
            sandgate("tenants", "limit", "--db", small.db, "x", *args)
        assert failed.value.returncode == 2
        assert problem in failed.value.stderr


def test_a_keyed_create_outlives_its_client_leaving_the_queue(small: Deployment) -> None:
    with small.client() as alpha, small.admin() as admin:
        filler = alpha.post("/api/v1/sandboxes", json={})
        assert filler.status_code == 201, filler.text
        with (
            small.client(timeout=1.0) as impatient,
            pytest.raises(httpx.ReadTimeout),
        ):
            impatient.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "stay"})
        kept = 'sandgate_queue_clients_left_total{outcome="kept"} 1.0'
        wait_until(
            lambda: kept in admin.get("/metrics").text.splitlines(),
            what="the server saw the client go and kept its keyed create",
        )  # a create without a key would have left the queue at that point
        assert admin.get("/api/v1/admission").json()["queue"]["length"] == 1
        assert alpha.delete(f"/api/v1/sandboxes/{filler.json()['name']}").status_code == 204

        def placed() -> bool:
            running = alpha.get("/api/v1/sandboxes", params={"state": "running"}).json()
            return len(running["sandboxes"]) == 1

        wait_until(placed, timeout=30, what="the queued create placed")
        retry = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "stay"})
        assert retry.status_code == 200, retry.text  # the retry finds the create it left
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert alpha.delete(f"/api/v1/sandboxes/{retry.json()['name']}").status_code == 204


def test_deleting_a_sandbox_whose_start_hangs_answers_its_create_409(tmp_path: Path) -> None:
    dep = start_deployment(tmp_path, worker=False, server_args=("--start-timeout", "60"))
    try:
        dep.start_worker(faults="hang-start")
        with dep.client() as alpha, concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:

            def create() -> httpx.Response:
                with dep.client() as client:
                    return client.post("/api/v1/sandboxes", json={})

            started = pool.submit(create)
            pending: list[str] = []

            def appears() -> bool:
                found = alpha.get("/api/v1/sandboxes", params={"state": "pending"}).json()
                pending[:] = [s["name"] for s in found["sandboxes"]]
                return bool(pending)

            wait_until(appears, what="the create pending on the hanging worker")
            assert alpha.delete(f"/api/v1/sandboxes/{pending[0]}").status_code == 204
            answer = started.result(timeout=20)  # the hung start is abandoned, not waited for
            assert answer.status_code == 409, answer.text
            assert "deleted while it started" in answer.json()["error"]["message"]
            state = alpha.get(f"/api/v1/sandboxes/{pending[0]}")
            assert state.status_code == 404  # deleted, and it stays so
    finally:
        tear_down(dep)
