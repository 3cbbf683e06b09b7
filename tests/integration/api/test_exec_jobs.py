"""Exec jobs on one instance with a real worker: run, fail, time out, replay, scope, list."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from tests.integration.api.conftest import Deployment


def submit(
    client: httpx.Client, sandbox: str, body: dict[str, Any], key: str | None = None
) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(f"/api/v1/sandboxes/{sandbox}/exec-jobs", json=body, headers=headers)


def wait_done(client: httpx.Client, job_id: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        response = client.get(f"/api/v1/exec-jobs/{job_id}")
        assert response.status_code == 200, response.text
        job: dict[str, Any] = response.json()
        if job["state"] in ("succeeded", "failed"):
            return job
        assert time.monotonic() < deadline, f"exec job still {job['state']}"
        time.sleep(0.05)


def run(client: httpx.Client, sandbox: str, code: str) -> str:
    response = client.post(f"/api/v1/sandboxes/{sandbox}/execute", json={"code": code})
    assert response.status_code == 200, response.text
    out: str = response.json()["stdout"]
    return out


def test_runs_to_success(alpha: httpx.Client, sandbox: str) -> None:
    response = submit(alpha, sandbox, {"command": "echo hello; echo oops >&2", "timeout": 10})
    assert response.status_code == 202, response.text
    accepted = response.json()
    assert accepted["state"] in ("queued", "running", "succeeded")
    assert "Idempotent-Replayed" not in response.headers
    job = wait_done(alpha, accepted["id"])
    assert job["state"] == "succeeded"
    assert (job["exit_code"], job["stdout"], job["stderr"]) == (0, "hello\n", "oops\n")
    assert job["error"] is None and job["sandbox"] == sandbox
    assert job["created_at"] <= job["started_at"] <= job["finished_at"]
    assert not job["stdout_truncated"] and not job["stderr_truncated"]


def test_env_and_cwd(alpha: httpx.Client, sandbox: str) -> None:
    body = {"command": 'echo "$GREETING"; pwd', "env": {"GREETING": "hi"}, "cwd": "/tmp"}
    job = wait_done(alpha, submit(alpha, sandbox, body).json()["id"])
    assert job["stdout"] == "hi\n/tmp\n"


def test_non_zero_exit_fails_with_reason(alpha: httpx.Client, sandbox: str) -> None:
    job = wait_done(alpha, submit(alpha, sandbox, {"command": "echo no; exit 3"}).json()["id"])
    assert job["state"] == "failed"
    assert job["exit_code"] == 3 and job["stdout"] == "no\n"
    assert "code 3" in job["error"]


def test_timeout_fails_with_reason(alpha: httpx.Client, sandbox: str) -> None:
    started = time.monotonic()
    response = submit(alpha, sandbox, {"command": "echo before; sleep 20", "timeout": 1})
    assert response.status_code == 202
    job = wait_done(alpha, response.json()["id"])
    assert time.monotonic() - started < 10
    assert job["state"] == "failed"
    assert job["exit_code"] == 124 and job["stdout"] == "before\n"
    assert "timed out" in job["error"]


def test_replay_returns_the_same_job_and_runs_once(alpha: httpx.Client, sandbox: str) -> None:
    key = f"job-{uuid.uuid4().hex}"
    body = {"command": "echo run >> /workspace/count", "timeout": 10}
    first = submit(alpha, sandbox, body, key)
    assert first.status_code == 202, first.text
    job_id = first.json()["id"]
    for _ in range(3):
        again = submit(alpha, sandbox, body, key)
        assert again.status_code == 202, again.text
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json()["id"] == job_id
    assert wait_done(alpha, job_id)["state"] == "succeeded"
    after = submit(alpha, sandbox, body, key)  # after it finished, too
    assert after.json()["id"] == job_id and after.json()["state"] == "succeeded"
    assert run(alpha, sandbox, "wc -l < /workspace/count").strip() == "1"


def test_same_key_other_body_is_422(alpha: httpx.Client, sandbox: str) -> None:
    key = f"job-{uuid.uuid4().hex}"
    assert submit(alpha, sandbox, {"command": "true"}, key).status_code == 202
    other = submit(alpha, sandbox, {"command": "false"}, key)
    assert other.status_code == 422, other.text
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    longer = submit(alpha, sandbox, {"command": "true", "timeout": 99}, key)
    assert longer.status_code == 422


def test_other_tenant_gets_404_and_its_own_keys(
    alpha: httpx.Client, beta: httpx.Client, sandbox: str
) -> None:
    key = f"job-{uuid.uuid4().hex}"
    job_id = submit(alpha, sandbox, {"command": "echo mine"}, key).json()["id"]
    assert beta.get(f"/api/v1/exec-jobs/{job_id}").status_code == 404
    assert beta.get(f"/api/v1/sandboxes/{sandbox}/exec-jobs").status_code == 404
    assert submit(beta, sandbox, {"command": "echo theirs"}, key).status_code == 404
    created = beta.post("/api/v1/sandboxes", json={})
    assert created.status_code == 201, created.text
    theirs = created.json()["name"]
    try:
        response = submit(beta, theirs, {"command": "echo theirs"}, key)  # same key: independent
        assert response.status_code == 202, response.text
        assert "Idempotent-Replayed" not in response.headers
        assert response.json()["id"] != job_id
        assert wait_done(beta, response.json()["id"])["stdout"] == "theirs\n"
    finally:
        beta.delete(f"/api/v1/sandboxes/{theirs}")
    assert alpha.get("/api/v1/exec-jobs/no-such-job").status_code == 404


def test_list_newest_first(alpha: httpx.Client, sandbox: str) -> None:
    ids = [submit(alpha, sandbox, {"command": f"echo {i}"}).json()["id"] for i in range(3)]
    for job_id in ids:
        wait_done(alpha, job_id)
    listed = alpha.get(f"/api/v1/sandboxes/{sandbox}/exec-jobs")
    assert listed.status_code == 200, listed.text
    jobs = listed.json()["exec_jobs"]
    assert [j["id"] for j in jobs][:3] == list(reversed(ids))
    assert all("stdout" not in j for j in jobs)  # lists carry no output
    assert [wait_done(alpha, j)["stdout"] for j in reversed(ids)] == ["2\n", "1\n", "0\n"]
    limited = alpha.get(f"/api/v1/sandboxes/{sandbox}/exec-jobs", params={"limit": 1})
    assert [j["id"] for j in limited.json()["exec_jobs"]] == [ids[-1]]


def test_bad_requests(alpha: httpx.Client, sandbox: str, deployment: Deployment) -> None:
    assert submit(alpha, sandbox, {"command": ""}).status_code == 422
    assert submit(alpha, sandbox, {"command": "true", "bogus": 1}).status_code == 422
    too_long = submit(alpha, sandbox, {"command": "true", "timeout": 10_000})
    assert too_long.status_code == 400
    bad_key = submit(alpha, sandbox, {"command": "true"}, key="has space")
    assert bad_key.status_code == 400
    assert submit(alpha, "sb-nope", {"command": "true"}).status_code == 404


def test_lists_carry_no_output_and_page_by_cursor(alpha: httpx.Client, sandbox: str) -> None:
    ids = []
    for i in range(5):
        r = submit(
            alpha, sandbox, {"command": f"head -c 100000 /dev/zero | tr '\\\\0' x; echo {i}"}
        )
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    for job_id in ids:
        assert len(wait_done(alpha, job_id)["stdout"]) > 100_000  # the job has its output
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = alpha.get(f"/api/v1/sandboxes/{sandbox}/exec-jobs", params=params).json()
        assert all("stdout" not in j and "stderr" not in j for j in page["exec_jobs"])
        seen += [j["id"] for j in page["exec_jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert set(ids) <= set(seen) and len(seen) == len(set(seen))
    bad = alpha.get(f"/api/v1/sandboxes/{sandbox}/exec-jobs", params={"cursor": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_cursor"


def test_jobs_and_their_output_go_with_their_sandbox(alpha: httpx.Client) -> None:
    name = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
    job = submit(alpha, name, {"command": "echo kept until the sandbox goes"}).json()
    assert wait_done(alpha, job["id"])["state"] == "succeeded"
    assert alpha.delete(f"/api/v1/sandboxes/{name}").status_code == 204
    deadline = time.monotonic() + 30  # the next recovery tick (every 5 s) deletes it
    while alpha.get(f"/api/v1/exec-jobs/{job['id']}").status_code == 200:
        assert time.monotonic() < deadline, "the job outlived its sandbox"
        time.sleep(0.5)
    assert alpha.get(f"/api/v1/exec-jobs/{job['id']}").status_code == 404
