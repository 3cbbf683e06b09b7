"""Worker reconnects, loses sandboxes, and removes what the control plane forgot."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.api.conftest import RUNTIME, Deployment, start_deployment, wait_until


@pytest.fixture
def own(tmp_path: Path) -> Iterator[Deployment]:
    dep = start_deployment(tmp_path)
    try:
        yield dep
    finally:
        dep.stop()


def restart_server(dep: Deployment) -> None:
    assert dep.server is not None
    dep.server.send_signal(signal.SIGTERM)
    dep.server.wait(timeout=15)
    port = dep.url.rsplit(":", 1)[1]
    with open(dep.data_dir / "server.log", "ab") as log:
        dep.server = subprocess.Popen(
            [sys.executable, "-m", "sandgate", "server", "--db", dep.db, "--port", port],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_until(lambda: httpx.get(f"{dep.url}/healthz").status_code == 200, what="server back")


def test_worker_reconnects_and_keeps_its_sandboxes(own: Deployment) -> None:
    with own.client() as alpha:
        name = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
        alpha.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "echo kept > f"})
        restart_server(own)
        own.wait_worker("w1", connected=True)
        out = alpha.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "cat f"})
        assert out.status_code == 200, out.text
        assert out.json()["stdout"] == "kept\n"


def test_tunnel_down_answers_503_with_retry_after(own: Deployment) -> None:
    with own.client() as alpha:
        name = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
        own.stop_worker(signal.SIGKILL)
        own.wait_worker("w1", connected=False)
        out = alpha.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "true"})
        assert out.status_code in (409, 503), out.text
        create = alpha.post("/api/v1/sandboxes", json={})
        assert create.status_code == 503
        assert create.json()["error"]["code"] == "no_capacity"
        assert int(create.headers["Retry-After"]) >= 1


def test_lost_sandboxes_marked_error_after_worker_restart(own: Deployment) -> None:
    with own.client() as alpha:
        name = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
        own.stop_worker(signal.SIGKILL)  # the worker dies; its sandboxes die with it
        own.start_worker()
        wait_until(
            lambda: alpha.get(f"/api/v1/sandboxes/{name}").json()["state"] == "error",
            what="lost sandbox marked error",
        )
        assert "no longer runs" in alpha.get(f"/api/v1/sandboxes/{name}").json()["error"]
        # nothing of it is left on the host
        assert not (own.state_dir / "w1" / "sandboxes" / name).exists()
        if RUNTIME == "bwrap":
            found = subprocess.run(["find", "/sys/fs/cgroup", "-name", name], capture_output=True)
            assert found.stdout == b""


def test_worker_removes_sandboxes_the_control_plane_forgot(own: Deployment) -> None:
    with own.client() as alpha:
        name = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
        assert (own.state_dir / "w1" / "sandboxes" / name).exists()
        assert own.server is not None
        own.server.send_signal(signal.SIGTERM)
        own.server.wait(timeout=15)
        db = sqlite3.connect(own.db.removeprefix("sqlite:///"))
        db.execute("UPDATE sandboxes SET state = 'deleted' WHERE name = ?", (name,))
        db.commit()
        db.close()
        restart_server(own)
        own.wait_worker("w1", connected=True)
        wait_until(
            lambda: not (own.state_dir / "w1" / "sandboxes" / name).exists(),
            what="worker removes the forgotten sandbox",
        )
