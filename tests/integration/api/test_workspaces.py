"""Persistent workspaces through the API, on a real server (SQLite) and a real bwrap worker:
mounts, sharing, history, restore, quota, the owner's binding, and surviving a restart of
everything."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sandgate.cli import launch
from tests.integration.api.conftest import Deployment, own_deployment

pytestmark = pytest.mark.bwrap


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with own_deployment(tmp_path_factory, "workspaces") as deployment:
        yield deployment


@pytest.fixture
def alpha(dep: Deployment) -> Iterator[httpx.Client]:
    with dep.client("alpha") as client:
        yield client


@pytest.fixture
def beta(dep: Deployment) -> Iterator[httpx.Client]:
    with dep.client("beta") as client:
        yield client


def run(client: httpx.Client, sandbox: str, code: str) -> dict[str, Any]:
    out = client.post(f"/api/v1/sandboxes/{sandbox}/execute", json={"code": code})
    assert out.status_code == 200, out.text
    body: dict[str, Any] = out.json()
    return body


def sandbox_with(client: httpx.Client, **body: Any) -> str:
    made = client.post("/api/v1/sandboxes", json=body)
    assert made.status_code == 201, made.text
    name: str = made.json()["name"]
    return name


def workspace(client: httpx.Client, name: str, quota_mb: int = 64) -> dict[str, Any]:
    made = client.post("/api/v1/workspaces", json={"name": name, "quota_mb": quota_mb})
    assert made.status_code == 201, made.text
    body: dict[str, Any] = made.json()
    return body


def test_files_outlive_the_sandbox_and_keep_a_history(alpha: httpx.Client) -> None:
    ws = workspace(alpha, "proj")
    assert ws["head"] and ws["quota_mb"] == 64 and ws["mounted_by"] == []
    assert alpha.post("/api/v1/workspaces", json={"name": "proj"}).status_code == 409

    first = sandbox_with(alpha, workspace="proj")
    assert alpha.get("/api/v1/workspaces/proj").json()["mounted_by"] == [first]
    out = run(alpha, first, "echo one > a.txt && mkdir -p d && echo x > d/b && id -u && pwd")
    assert out["exit_code"] == 0 and out["stdout"].split() == ["1000", "/workspace"], out
    commit = alpha.post("/api/v1/workspaces/proj/commits", json={"message": "first files"})
    assert commit.status_code == 201, commit.text
    one = commit.json()
    assert one["created"] is True and one["commit"]["message"].startswith("first files")
    again = alpha.post("/api/v1/workspaces/proj/commits", json={"message": "nothing new"}).json()
    assert again["created"] is False and again["commit"]["sha"] == one["commit"]["sha"]

    run(alpha, first, "echo two > a.txt && rm d/b")
    assert alpha.delete(f"/api/v1/sandboxes/{first}").status_code == 204
    # the delete committed what the sandbox left
    log = alpha.get("/api/v1/workspaces/proj/commits").json()
    subjects = [c["message"].splitlines()[0] for c in log["commits"]]
    assert subjects[:2] == [f"Sandbox {first} deleted", "first files"], subjects
    assert "Sandgate-Sandbox: " + first in log["commits"][0]["message"]
    assert log["commits"][0]["author"]["name"]

    shown = alpha.get(f"/api/v1/workspaces/proj/commits/{log['commits'][0]['sha']}").json()
    paths = {f["path"] for f in shown["files"]}
    assert paths == {"a.txt", "d/b"} and "+two" in shown["patch"] and "-one" in shown["patch"]

    # a new sandbox mounts it with its files, under another uid on the host
    second = sandbox_with(alpha, workspaces=[{"name": "proj", "path": "/mnt/proj"}])
    out = run(alpha, second, "cat /mnt/proj/a.txt && ls /mnt/proj/d | wc -l && touch /mnt/proj/n")
    assert out["stdout"].split() == ["two", "0"], out

    restored = alpha.post("/api/v1/workspaces/proj/restore", json={"commit": one["commit"]["sha"]})
    assert restored.status_code == 200, restored.text
    out = run(alpha, second, "cat /mnt/proj/a.txt /mnt/proj/d/b; ls /mnt/proj")
    assert out["stdout"].split() == ["one", "x", "a.txt", "d"], out
    alpha.delete(f"/api/v1/sandboxes/{second}")


def test_two_sandboxes_share_one(dep: Deployment, alpha: httpx.Client) -> None:
    workspace(alpha, "shared")
    a = sandbox_with(alpha, workspace="shared")
    b = sandbox_with(alpha, workspace="shared")
    run(alpha, a, "echo from-a > note && chmod 600 note")
    out = run(alpha, b, "cat note && echo from-b >> note && stat -c %u note")
    assert out["stdout"].split() == ["from-a", "1000"], out
    assert run(alpha, a, "cat note")["stdout"].split() == ["from-a", "from-b"]
    assert sorted(alpha.get("/api/v1/workspaces/shared").json()["mounted_by"]) == sorted([a, b])
    # a commit freezes the sandboxes using it: git sees one tree, nothing swapped meanwhile
    ws_id = alpha.get("/api/v1/workspaces/shared").json()["id"]
    assert alpha.post("/api/v1/workspaces/shared/commits", json={}).status_code == 201
    frozen = [r for r in dep.worker_records() if r.get("message") == "workspace.users_frozen"]
    assert any(r.get("workspace") == ws_id and r.get("frozen") == 2 for r in frozen), frozen
    assert run(alpha, a, "cat note")["exit_code"] == 0  # and thawed after
    busy = alpha.delete("/api/v1/workspaces/shared")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "workspace_in_use"
    for name in (a, b):
        alpha.delete(f"/api/v1/sandboxes/{name}")
    assert alpha.delete("/api/v1/workspaces/shared").status_code == 204
    assert alpha.get("/api/v1/workspaces/shared").status_code == 404


def test_an_expired_sandbox_commits_its_workspace(alpha: httpx.Client) -> None:
    workspace(alpha, "expiring")
    s = sandbox_with(alpha, workspace="expiring", timeout=2)
    run(alpha, s, "echo last > words")
    deadline = time.monotonic() + 30
    while True:
        log = alpha.get("/api/v1/workspaces/expiring/commits").json()["commits"]
        if log[0]["message"].startswith(f"Sandbox {s} expired"):
            break
        assert time.monotonic() < deadline, log
        time.sleep(0.3)
    shown = alpha.get(f"/api/v1/workspaces/expiring/commits/{log[0]['sha']}").json()
    assert [f["path"] for f in shown["files"]] == ["words"]


def test_a_diff_larger_than_a_frame_keeps_the_tunnel(alpha: httpx.Client) -> None:
    """300 KB of control characters is 1.8 MB as JSON: such a diff once closed the worker's
    tunnel, failing every tenant's calls on it."""
    workspace(alpha, "escapes")
    s = sandbox_with(alpha, workspace="escapes")
    code = "open('x', 'w').write((chr(1) * 99 + chr(10)) * 3000)"
    made = alpha.post(f"/api/v1/sandboxes/{s}/execute", json={"language": "python", "code": code})
    assert made.status_code == 200 and made.json()["exit_code"] == 0, made.text
    sha = alpha.post("/api/v1/workspaces/escapes/commits", json={}).json()["commit"]["sha"]
    shown = alpha.get(f"/api/v1/workspaces/escapes/commits/{sha}")
    assert shown.status_code == 200, shown.text
    assert shown.json()["files"][0]["path"] == "x" and "\x01" in shown.json()["patch"]
    assert run(alpha, s, "echo still")["stdout"] == "still\n"  # the tunnel stayed up
    alpha.delete(f"/api/v1/sandboxes/{s}")


def test_another_tenant_never_reaches_it(alpha: httpx.Client, beta: httpx.Client) -> None:
    workspace(alpha, "private")
    a = sandbox_with(alpha, workspace="private")
    run(alpha, a, "echo secret > s")
    alpha.post("/api/v1/workspaces/private/commits", json={"message": "s"})
    for method, path, body in (
        ("GET", "/api/v1/workspaces/private", None),
        ("GET", "/api/v1/workspaces/private/commits", None),
        ("POST", "/api/v1/workspaces/private/commits", {"message": "x"}),
        ("POST", "/api/v1/workspaces/private/restore", {"commit": "abcd"}),
        ("DELETE", "/api/v1/workspaces/private", None),
    ):
        got = beta.request(method, path, json=body)
        assert got.status_code == 404, (method, path, got.text)
    refused = beta.post("/api/v1/sandboxes", json={"workspace": "private"})
    assert refused.status_code == 404, refused.text
    assert [w["name"] for w in beta.get("/api/v1/workspaces").json()["workspaces"]] == []
    # beta's own workspace of the same name is another one
    workspace(beta, "private")
    b = sandbox_with(beta, workspace="private")
    assert run(beta, b, "ls -A | wc -l")["stdout"].strip() == "0"
    for client, name in ((alpha, a), (beta, b)):
        client.delete(f"/api/v1/sandboxes/{name}")


def test_quota_is_enforced_and_bad_requests_are_clear(alpha: httpx.Client) -> None:
    workspace(alpha, "small", quota_mb=16)
    s = sandbox_with(alpha, workspace="small")
    out = run(alpha, s, "dd if=/dev/zero of=big bs=1M count=40 2>&1; echo rc=$?")
    assert "No space left on device" in out["stdout"], out
    huge = alpha.post("/api/v1/workspaces", json={"name": "huge", "quota_mb": 10**7})
    assert huge.status_code == 422 and "at most" in huge.text, huge.text
    assert alpha.post("/api/v1/workspaces", json={"name": "Bad/Name"}).status_code == 400
    missing = alpha.post("/api/v1/sandboxes", json={"workspace": "nope"})
    assert missing.status_code == 404 and "workspace nope" in missing.text
    bad_path = alpha.post(
        "/api/v1/sandboxes", json={"workspaces": [{"name": "small", "path": "/etc/x"}]}
    )
    assert bad_path.status_code == 400 and "/etc/x" in bad_path.text, bad_path.text
    assert alpha.get("/api/v1/workspaces/small/commits/zzzz").status_code == 400
    assert alpha.get("/api/v1/workspaces/small/commits/" + "0" * 40).status_code == 404
    alpha.delete(f"/api/v1/sandboxes/{s}")


def test_survives_a_restart_of_everything(dep: Deployment, alpha: httpx.Client) -> None:
    workspace(alpha, "durable")
    s = sandbox_with(alpha, workspace="durable")
    run(alpha, s, "echo kept > k && mkdir deep && echo 2 > deep/x")
    # everything stops: the worker (its sandboxes with it) and the server
    dep.stop()
    log = dep.data_dir / "server.log"
    port = dep.url.rsplit(":", 1)[1]
    dep.server = launch.start(launch.server_argv("--db", dep.db, "--port", port), log=log)
    launch.wait_healthy(dep.url, dep.server, log=log, timeout=20, what="server up again")
    dep.start_worker()
    t = sandbox_with(alpha, workspace="durable")
    assert run(alpha, t, "cat k deep/x")["stdout"].split() == ["kept", "2"]
    alpha.delete(f"/api/v1/sandboxes/{t}")
    assert alpha.delete("/api/v1/workspaces/durable").status_code == 204
