"""Exec jobs on two instances over one PostgreSQL: same-key retries spread over both run the
command exactly once; a job whose instance is killed ends failed and is never re-run.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
from collections import Counter
from typing import Any

from sandgate.store.base import ORPHANED_EXEC_JOB
from tests.e2e.conftest import RECOVERY_INTERVAL, Cluster, Instance

# Files are named relative to the command's cwd (the sandbox's workspace): the e2e worker's
# `process` runtime has no /workspace mount.
KEYS = 20
RETRIES = 5
# what the healthy instances' recovery waits before calling an instance dead (settings default)
ORPHAN_AFTER = 3 * RECOVERY_INTERVAL + 30.0


def running_sandbox(cluster: Cluster, inst: Instance) -> str:
    with cluster.client(inst) as c:
        response = c.post("/api/v1/sandboxes", json={"timeout": 900})
        assert response.status_code == 201, response.text
        name: str = response.json()["name"]
        return name


def shell(cluster: Cluster, inst: Instance, sandbox: str, code: str) -> str:
    with cluster.client(inst) as c:
        response = c.post(f"/api/v1/sandboxes/{sandbox}/execute", json={"code": code})
        assert response.status_code == 200, response.text
        out: str = response.json()["stdout"]
        return out


def job_of(cluster: Cluster, inst: Instance, job_id: str) -> dict[str, Any]:
    with cluster.client(inst) as c:
        response = c.get(f"/api/v1/exec-jobs/{job_id}")
        assert response.status_code == 200, response.text
        job: dict[str, Any] = response.json()
        return job


def wait_state(
    cluster: Cluster, inst: Instance, job_id: str, states: tuple[str, ...], timeout: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = job_of(cluster, inst, job_id)
        if job["state"] in states:
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']}"
        time.sleep(0.2)


def test_same_key_retries_on_both_instances_run_once(clean: Cluster) -> None:
    a, b = clean.instances["A"], clean.instances["B"]
    sandbox = running_sandbox(clean, a)
    clients = {"A": clean.client(a), "B": clean.client(b)}
    try:

        def attempt(n: int) -> tuple[str, str, int]:
            key = f"exec-key-{n // RETRIES:02d}"
            body = {"command": f"echo {key} >> count", "timeout": 30}
            client = clients["A" if n % 2 == 0 else "B"]
            response = client.post(
                f"/api/v1/sandboxes/{sandbox}/exec-jobs",
                json=body,
                headers={"Idempotency-Key": key},
            )
            assert response.status_code == 202, response.text
            return key, response.json()["id"], response.status_code

        with concurrent.futures.ThreadPoolExecutor(max_workers=KEYS * RETRIES) as pool:
            outcomes = list(pool.map(attempt, range(KEYS * RETRIES)))
    finally:
        for client in clients.values():
            client.close()

    ids: dict[str, set[str]] = {}
    for key, job_id, _ in outcomes:
        ids.setdefault(key, set()).add(job_id)
    assert len(ids) == KEYS
    assert all(len(found) == 1 for found in ids.values()), ids  # every retry: the same job
    for found in ids.values():
        job = wait_state(clean, b, next(iter(found)), ("succeeded", "failed"), 60)
        assert job["state"] == "succeeded", (job["error"], job["stderr"])
    lines = shell(clean, a, sandbox, "cat count").split()
    assert Counter(lines) == {f"exec-key-{k:02d}": 1 for k in range(KEYS)}  # each ran once
    rows = clean.sql("select count(*) as n from exec_jobs where sandbox_name = $1", sandbox)
    assert rows[0]["n"] == KEYS


def test_job_of_a_killed_instance_fails_and_is_not_rerun(clean: Cluster) -> None:
    a = clean.instances["A"]
    c = clean.start_instance("C")
    sandbox = running_sandbox(clean, a)
    body = {"command": "echo start >> marker; sleep 30", "timeout": 120}
    with clean.client(c) as client:
        response = client.post(
            f"/api/v1/sandboxes/{sandbox}/exec-jobs",
            json=body,
            headers={"Idempotency-Key": "killed-instance"},
        )
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
    wait_state(clean, a, job_id, ("running",), 30)
    deadline = time.monotonic() + 30
    while shell(clean, a, sandbox, "cat marker 2>/dev/null | wc -l").strip() != "1":
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.2)

    killed_at = time.monotonic()
    clean.stop_instance("C", signal.SIGKILL)
    job = wait_state(clean, a, job_id, ("succeeded", "failed"), ORPHAN_AFTER + 30)
    waited = time.monotonic() - killed_at
    assert job["state"] == "failed", job
    assert job["error"] == ORPHANED_EXEC_JOB
    assert job["finished_at"] is not None
    # failed only once C counted as dead, not before
    assert waited >= ORPHAN_AFTER - 5, waited

    # never re-run: a replay returns the failed job; the command started exactly once
    with clean.client(a) as client:
        replay = client.post(
            f"/api/v1/sandboxes/{sandbox}/exec-jobs",
            json=body,
            headers={"Idempotency-Key": "killed-instance"},
        )
        assert replay.status_code == 202 and replay.json()["id"] == job_id
        assert replay.json()["state"] == "failed"
    time.sleep(3 * RECOVERY_INTERVAL)  # a few more recovery ticks on A and B
    assert shell(clean, a, sandbox, "wc -l < marker").strip() == "1"
    assert job_of(clean, a, job_id)["state"] == "failed"
