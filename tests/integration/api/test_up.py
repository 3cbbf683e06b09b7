"""`sandgate up`, the all-in-one default, driven as a user would."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from sandgate.worker.main import runtime_scope
from tests.integration.api.conftest import RUNTIME, free_port


def start_up(data_dir: Path, state_dir: Path, port: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandgate",
            "up",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--state-dir",
            str(state_dir),
            "--runtime",
            RUNTIME,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    banner = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        banner.append(line)
        if line.startswith("Ctrl-C"):
            break
    text = "".join(banner)
    assert f"http://127.0.0.1:{port}" in text, text
    assert "curl" in text
    key = next(line.split()[2] for line in banner if line.startswith("API key:"))
    return proc, key


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root to set up")
def test_up_serves_and_cleans_up_on_ctrl_c(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    state_dir = Path("/var/lib/sandgate-test") / uuid.uuid4().hex[:10]
    port = free_port()
    proc, key = start_up(data_dir, state_dir, port)
    try:
        key_file = data_dir / "api-key"
        assert key_file.read_text().strip() == key
        assert (key_file.stat().st_mode & 0o777) == 0o600
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as c:
            deadline = time.monotonic() + 30
            while not any(w["connected"] for w in c.get("/api/v1/workers").json()["workers"]):
                assert time.monotonic() < deadline, "local worker never connected"
                time.sleep(0.1)
            first = c.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "up-1"})
            again = c.post("/api/v1/sandboxes", json={}, headers={"Idempotency-Key": "up-1"})
            assert first.status_code == 201 and again.status_code == 200
            assert again.headers["Idempotent-Replayed"] == "true"
            name = first.json()["name"]
            assert again.json()["name"] == name
            out = c.post(
                f"/api/v1/sandboxes/{name}/execute", json={"language": "bash", "code": "echo ok"}
            )
            assert out.json()["stdout"] == "ok\n" and out.json()["exit_code"] == 0
            files = f"/api/v1/sandboxes/{name}/toolbox/files"
            assert c.put(files, params={"path": "in.txt"}, content=b"data").status_code == 200
            assert c.get(files, params={"path": "in.txt"}).content == b"data"
            second = c.post("/api/v1/sandboxes", json={}).json()["name"]
            workspace = state_dir / "local" / "sandboxes" / second / "workspace"
            uid = workspace.stat().st_uid if workspace.exists() else None
            assert c.delete(f"/api/v1/sandboxes/{name}").status_code == 204
    finally:
        stop(proc)
    # Ctrl-C removed every sandbox it started: no process, cgroup, mount or directory left
    assert not (state_dir / "local" / "sandboxes" / second).exists()
    found = subprocess.run(
        ["find", "/sys/fs/cgroup", "-name", second], capture_output=True, text=True
    ).stdout
    assert found == ""
    scope = runtime_scope("local", state_dir / "local")  # the worker's own cgroup parents
    found = subprocess.run(
        ["find", "/sys/fs/cgroup", "-name", scope], capture_output=True, text=True
    ).stdout
    assert found == ""
    if uid is not None and RUNTIME == "bwrap":
        states = subprocess.run(
            ["ps", "-u", str(uid), "-o", "stat="], capture_output=True, text=True
        )
        assert [s for s in states.stdout.split() if not s.startswith("Z")] == []  # zombies: dead
    assert str(state_dir) not in Path("/proc/mounts").read_text()

    # a second run reuses the data dir and the key
    proc2, key2 = start_up(data_dir, state_dir, port)
    try:
        assert key2 == key
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}
        ) as c:
            assert c.get("/api/v1/sandboxes").status_code == 200
    finally:
        stop(proc2)
        shutil.rmtree(state_dir, ignore_errors=True)
