"""The operator, not the tenant, bounds what one sandbox may hold (issue 10, point 1)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.api.conftest import start_deployment, tear_down

pytestmark = pytest.mark.bwrap


@pytest.mark.parametrize(
    ("resources", "cap", "value"),
    [
        ({"memory_mb": 65536}, "max_memory_mb", "4096"),
        ({"cpus": 64}, "max_cpus", "4"),
        ({"pids": 100_000}, "max_pids", "1024"),
        ({"disk_mb": 20_000}, "max_disk_mb", "10240"),
    ],
)
def test_a_request_above_a_default_cap_is_refused_naming_it(
    alpha: httpx.Client, resources: dict[str, float], cap: str, value: str
) -> None:
    before = alpha.get("/api/v1/sandboxes").json()["sandboxes"]
    r = alpha.post("/api/v1/sandboxes", json={"resources": resources})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "resource_cap_exceeded"
    assert error["limit"] == cap and error["max"] == value
    assert f"at most {value}" in error["message"]
    assert alpha.get("/api/v1/sandboxes").json()["sandboxes"] == before  # nothing half-made


def test_defaults_fill_what_was_not_asked_and_a_retry_naming_them_is_the_same(
    alpha: httpx.Client,
) -> None:
    r = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "caps-defaults"})
    assert r.status_code == 201, r.text
    granted = {"memory_mb": 512, "cpus": 1.0, "pids": 256, "disk_mb": 1024}
    assert r.json()["resources"] == granted
    explicit = {"resources": granted}
    again = alpha.post(
        "/api/v1/sandboxes", json=explicit, headers={"Idempotency-Key": "caps-defaults"}
    )
    assert again.status_code == 200, again.text
    assert again.json()["name"] == r.json()["name"]
    alpha.delete(f"/api/v1/sandboxes/{r.json()['name']}")


def test_the_operator_sets_caps_and_defaults(tmp_path: Path) -> None:
    args = ("--max-memory-mb", "256", "--default-memory-mb", "128", "--max-pids", "64")
    dep = start_deployment(tmp_path, server_args=(*args, "--default-pids", "32"))
    try:
        with dep.client() as alpha:
            r = alpha.post("/api/v1/sandboxes", json={})
            assert r.status_code == 201, r.text
            assert r.json()["resources"]["memory_mb"] == 128
            assert r.json()["resources"]["pids"] == 32
            name = r.json()["name"]
            # what the kernel enforces is the granted value, not a tenant's wish
            limits = [
                p.read_text().strip()
                for p in Path("/sys/fs/cgroup").glob(f"*/sandgate/*/{name}/pids.max")
            ]
            assert limits and set(limits) == {"32"}, limits
            r = alpha.post("/api/v1/sandboxes", json={"resources": {"memory_mb": 512}})
            assert r.status_code == 422, r.text
            assert r.json()["error"]["max"] == "256"
    finally:
        tear_down(dep)


def test_a_default_above_its_cap_refuses_to_start(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'sandgate.db'}"
    run = subprocess.run(
        [sys.executable, "-m", "sandgate", "server", "--db", db, "--default-pids", "4096"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "default pids (4096) is above its cap (1024)" in run.stderr
    shutil.rmtree(tmp_path, ignore_errors=True)
