"""A worker never places more than its host can hold (issue 10): the control plane counts
the memory granted to each worker's sandboxes against the budget the worker reports, and a
sandbox larger than any worker's host can give is refused naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandgate.worker import budget
from tests.integration.api.conftest import start_deployment, tear_down

pytestmark = pytest.mark.bwrap

BUDGET_MB = 1100  # two sandboxes of 512 MiB fit, a third does not


def overcommit_for(target_mb: int) -> float:
    total = budget.mem_total_mb()
    reserve = max(budget.MEMORY_RESERVE_MIN_MB, int(total * budget.MEMORY_RESERVE_SHARE))
    return (target_mb + 0.5) / (total - reserve)


def test_the_control_plane_places_within_the_workers_budget(tmp_path: Path) -> None:
    dep = start_deployment(tmp_path, worker=False, server_args=("--queue-limit", "0"))
    try:
        dep.start_worker(
            args=(
                "--memory-overcommit",
                f"{overcommit_for(BUDGET_MB):.6f}",
                "--disk-overcommit",
                "1",  # not the suite's default of 8 (tests/conftest.py)
            )
        )
        with dep.admin() as admin:
            (worker,) = admin.get("/api/v1/workers").json()["workers"]
        enforces = worker["features"]["enforces"]
        assert enforces["budget"]["memory_mb"] == BUDGET_MB
        assert enforces["sandbox_max"]["memory_mb"] == BUDGET_MB
        assert enforces["budget"]["disk_mb"] > 0 and enforces["overcommit"]["disk"] == 1.0
        with dep.client() as alpha:
            big = alpha.post("/api/v1/sandboxes", json={"resources": {"memory_mb": 2048}})
            assert big.status_code == 422, big.text
            error = big.json()["error"]
            assert error["code"] == "resource_cap_exceeded"
            assert error["limit"] == "worker_max_memory_mb" and error["max"] == str(BUDGET_MB)
            names = []
            for _ in range(2):
                r = alpha.post("/api/v1/sandboxes", json={"resources": {"memory_mb": 512}})
                assert r.status_code == 201, r.text
                names.append(r.json()["name"])
            third = alpha.post("/api/v1/sandboxes", json={"resources": {"memory_mb": 512}})
            assert third.status_code == 503, third.text  # slots are free, memory is not
            assert third.json()["error"]["code"] == "no_capacity"
            small = alpha.post("/api/v1/sandboxes", json={"resources": {"memory_mb": 64}})
            assert small.status_code == 201, small.text  # what fits is still placed
            assert alpha.delete(f"/api/v1/sandboxes/{names[0]}").status_code in (200, 204)
            again = alpha.post("/api/v1/sandboxes", json={"resources": {"memory_mb": 512}})
            assert again.status_code == 201, again.text
            listed = alpha.get("/api/v1/sandboxes").json()["sandboxes"]
            assert len(listed) == 3
    finally:
        tear_down(dep)
