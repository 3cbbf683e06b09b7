"""Tenant-scoped views: `GET /api/v1/workers` and `GET /api/v1/admission` show a tenant key
only its own numbers; the fleet-wide view takes an admin key (`sandgate keys create --admin`),
which in turn is refused (403) on a tenant's routes. One instance on SQLite, a real worker."""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.api.conftest import Deployment, sandgate, start_deployment, wait_until


@pytest.fixture
def dep(tmp_path: Path) -> Iterator[Deployment]:
    d = start_deployment(
        tmp_path, worker=False, server_args=("--queue-limit", "5", "--start-timeout", "5")
    )
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(d.state_dir, ignore_errors=True)


def get(client: httpx.Client, path: str) -> dict[str, Any]:
    response = client.get(path)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def w1(view: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(w for w in view["workers"] if w["name"] == "w1")
    return found


def test_keys_create_admin_against_sqlite(dep: Deployment) -> None:
    key = sandgate("keys", "create", "--db", dep.db, "--admin")
    assert key.startswith("sga_") and key != dep.admin_key
    assert dep.admin_key.startswith("sga_")
    for args in (("--admin", "--worker"), ("--admin", "--tenant", "x")):
        with pytest.raises(subprocess.CalledProcessError) as refused:
            sandgate("keys", "create", "--db", dep.db, *args)
        assert refused.value.returncode == 2
        assert "exactly one of --tenant NAME, --worker or --admin" in refused.value.stderr
    with httpx.Client(base_url=dep.url, headers={"Authorization": f"Bearer {key}"}) as fresh:
        assert get(fresh, "/api/v1/admission")["view"] == "fleet"


def test_a_tenant_sees_only_its_own_numbers_and_an_admin_the_fleet(dep: Deployment) -> None:
    with (
        dep.client("alpha") as alpha,
        dep.client("beta") as beta,
        dep.admin() as admin,
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
    ):
        # beta's create times out on a worker whose starts hang: a scheduling timeout of beta's
        dep.start_worker(faults="hang-start")
        hung = beta.post("/api/v1/sandboxes", json={})
        assert hung.status_code == 504, hung.text
        errored = get(beta, "/api/v1/sandboxes?state=error")["sandboxes"]
        assert len(errored) == 1
        timed_out = errored[0]["name"]
        dep.stop_worker()

        # beta fills the only slot and queues one more create
        dep.start_worker(capacity=1)
        filler = beta.post("/api/v1/sandboxes", json={})
        assert filler.status_code == 201, filler.text
        held = filler.json()["name"]

        def queued_create() -> httpx.Response:
            with dep.client("beta") as client:
                return client.post("/api/v1/sandboxes", json={})

        queued = pool.submit(queued_create)
        wait_until(
            lambda: get(admin, "/api/v1/admission")["queue"]["length"] == 1,
            what="beta's create queued",
        )

        # the admin key: the fleet-wide numbers, every tenant's
        fleet_workers = get(admin, "/api/v1/workers")
        assert fleet_workers["view"] == "fleet"
        assert w1(fleet_workers)["live_sandboxes"] == 1
        assert "your_live_sandboxes" not in w1(fleet_workers)
        fleet = get(admin, "/api/v1/admission")
        assert fleet["view"] == "fleet" and fleet["queue"]["length"] == 1
        assert [t["sandbox"] for t in fleet["recent_timeouts"]] == [timed_out]
        assert fleet["recent_timeouts"][0]["tenant_id"]  # whose: the operator may know
        assert fleet["breaker"]["counted_timeouts"] == 1

        # tenant alpha: the workers and what they enforce, none of beta's counts or names
        mine = get(alpha, "/api/v1/workers")
        assert mine["view"] == "tenant"
        worker = w1(mine)
        assert worker["your_live_sandboxes"] == 0 and "live_sandboxes" not in worker
        assert worker["connected"] is True and worker["capacity"] == 1
        assert worker["features"] == w1(fleet_workers)["features"]
        status = get(alpha, "/api/v1/admission")
        assert status["view"] == "tenant"
        assert status["queue"] == {"your_queued": 0, "limit": 5, "timeout": 120.0}
        assert status["recent_timeouts"] == []
        # the breaker answers everyone's creates: its state is shown as is
        assert status["breaker"] == fleet["breaker"]
        for view in (mine, status):
            text = str(view)
            assert held not in text and timed_out not in text

        # tenant beta: its own numbers, named
        theirs = w1(get(beta, "/api/v1/workers"))
        assert theirs["your_live_sandboxes"] == 1 and "live_sandboxes" not in theirs
        own = get(beta, "/api/v1/admission")
        assert own["queue"]["your_queued"] == 1 and "length" not in own["queue"]
        assert [t["sandbox"] for t in own["recent_timeouts"]] == [timed_out]

        # an admin key is no tenant: refused on a tenant's routes, nothing is created
        for method, path in (
            ("GET", "/api/v1/sandboxes"),
            ("POST", "/api/v1/sandboxes"),
            ("GET", f"/api/v1/sandboxes/{held}"),
            ("DELETE", f"/api/v1/sandboxes/{held}"),
        ):
            refused = admin.request(method, path, json={} if method == "POST" else None)
            assert refused.status_code == 403, (method, path, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "forbidden"
            assert "admin key" in error["message"] and "--tenant" in error["message"]
        assert get(admin, "/api/v1/admission")["queue"]["length"] == 1
        assert get(beta, f"/api/v1/sandboxes/{held}")["state"] == "running"

        # a worker token reads no view at all
        with httpx.Client(
            base_url=dep.url, headers={"Authorization": f"Bearer {dep.worker_token}"}
        ) as worker_client:
            assert worker_client.get("/api/v1/workers").status_code == 401
            assert worker_client.get("/api/v1/admission").status_code == 401

        assert beta.delete(f"/api/v1/sandboxes/{held}").status_code == 204
        placed = queued.result(timeout=60)
        assert placed.status_code == 201, placed.text
        assert beta.delete(f"/api/v1/sandboxes/{placed.json()['name']}").status_code == 204
