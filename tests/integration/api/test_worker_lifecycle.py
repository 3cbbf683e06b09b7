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

from tests.integration.api.conftest import (
    RUNTIME,
    Deployment,
    start_deployment,
    tear_down,
    wait_until,
)


@pytest.fixture
def own(tmp_path: Path) -> Iterator[Deployment]:
    dep = start_deployment(tmp_path)
    try:
        yield dep
    finally:
        tear_down(dep)  # its worker state too (each test's own)


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
        # a worker started again under its name removes what the killed one left on the host
        # (its sandbox's cgroups), as a restarted worker does in production
        own.start_worker()
        own.wait_worker("w1", connected=True)
        if RUNTIME == "bwrap":
            found = subprocess.run(["find", "/sys/fs/cgroup", "-name", name], capture_output=True)
            assert found.stdout == b""


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


def test_second_server_on_one_sqlite_file_refuses(own: Deployment) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sandgate", "server", "--db", own.db, "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "SQLite serves one instance" in done.stderr


def test_worker_token_serves_one_worker_name(own: Deployment) -> None:
    import asyncio

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from sandgate.agent.frames import encode

    url = own.url.replace("http://", "ws://") + "/tunnel"

    async def hello_as(name: str) -> int | None:
        headers = {"Authorization": f"Bearer {own.worker_token}"}
        async with connect(url, additional_headers=headers) as ws:
            hello = {"event": "hello", "name": name, "capacity": 1, "features": {}, "sandboxes": []}
            await ws.send(encode(hello))
            try:
                await asyncio.wait_for(ws.recv(), 5)
                await asyncio.wait_for(ws.recv(), 5)
            except ConnectionClosed as closed:
                return closed.rcvd.code if closed.rcvd else None
            return None

    # the token was bound to "w1" when that worker connected: another name is refused
    assert asyncio.run(hello_as("impostor")) == 4403
    with own.client() as alpha:
        names = [w["name"] for w in alpha.get("/api/v1/workers").json()["workers"]]
        assert "impostor" not in names
        assert alpha.post("/api/v1/sandboxes", json={}).status_code == 201


def test_a_failed_keyed_create_can_be_retried_and_leaves_nothing(tmp_path: Path) -> None:
    dep = start_deployment(tmp_path, worker=False, server_args=("--start-timeout", "2"))
    try:
        with dep.client() as alpha:
            dep.start_worker(faults="hang-start")  # answers, but no start ever becomes ready
            first = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "k1"})
            assert first.status_code == 504, first.text  # a scheduling timeout
            assert "not ready within the start timeout" in first.json()["error"]["message"]
            failed = alpha.get("/api/v1/sandboxes", params={"state": "error"}).json()["sandboxes"]
            assert len(failed) == 1
            orphan = failed[0]["name"]
            dep.stop_worker()
            dep.start_worker()

            again = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "k1"})
            assert again.status_code == 201, again.text  # created anew, not a replay
            assert again.json()["name"] != orphan
            replay = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "k1"})
            assert replay.status_code == 200
            assert replay.json()["name"] == again.json()["name"]
            assert not (dep.state_dir / "w1" / "sandboxes" / orphan).exists()
    finally:
        tear_down(dep)  # its worker state too (each test's own)


def test_a_frozen_worker_is_tunnel_loss_and_its_keyed_create_lands_once_it_thaws(
    tmp_path: Path,
) -> None:
    """A worker that answers nothing (SIGSTOP) is unreachable, not slow to schedule: 503
    tunnel_unavailable, not counted by the breaker; the create is kept and delivered when
    the worker is back, and the same key then answers that sandbox."""
    dep = start_deployment(tmp_path, server_args=("--start-timeout", "2"))
    try:
        with dep.client() as alpha:
            assert dep.worker is not None
            dep.worker.send_signal(signal.SIGSTOP)
            try:
                first = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "k1"})
            finally:
                dep.worker.send_signal(signal.SIGCONT)
            assert first.status_code == 503, first.text
            assert first.json()["error"]["code"] == "tunnel_unavailable"
            with dep.admin() as admin:  # not counted for anyone: the fleet-wide view
                fleet = admin.get("/api/v1/admission").json()
            assert fleet["recent_timeouts"] == [], fleet
            assert fleet["breaker"]["counted_timeouts"] == 0, fleet
            dep.wait_worker("w1", connected=True)
            replay = alpha.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "k1"})
            assert replay.status_code == 200, replay.text
            assert replay.json()["state"] == "running"
            listed = alpha.get("/api/v1/sandboxes").json()["sandboxes"]
            assert [s["name"] for s in listed] == [replay.json()["name"]]
    finally:
        tear_down(dep)  # its worker state too (each test's own)
