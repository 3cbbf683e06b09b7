"""The store's disk fills up under a real server: /readyz says so, creates answer a clean 503.

The SQLite file lives on a 1 MiB tmpfs mounted for the test (root only); the server and worker
logs stay outside it. SQLite in WAL mode keeps writing into space it already holds (a WAL
restarted after a checkpoint), so the assertions poll and retry instead of counting on the
first write after the disk filled.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.api.conftest import RUNTIME, Deployment, free_port, sandgate, wait_until
from tests.statedirs import remove_state

CAUSE = "disk is full"  # SQLite's words: "database or disk is full"


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def full_disk_deployment(tmp_path: Path, disk: Path) -> Iterator[Deployment]:
    if RUNTIME == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("the bwrap runtime needs bubblewrap (apt-get install -y bubblewrap)")
    db = f"sqlite:///{disk / 'sandgate.db'}"
    port = free_port()
    dep = Deployment(
        url=f"http://127.0.0.1:{port}",
        db=db,
        data_dir=tmp_path,  # the logs: never on the disk that fills up
        state_dir=Path("/var/lib/sandgate-test") / uuid.uuid4().hex[:10],
        keys={"alpha": sandgate("keys", "create", "--db", db, "--tenant", "alpha")},
        worker_token=sandgate("keys", "create", "--db", db, "--worker"),
    )
    with open(tmp_path / "server.log", "ab") as log:
        dep.server = subprocess.Popen(
            [sys.executable, "-m", "sandgate", "server", "--db", db, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: httpx.get(f"{dep.url}/healthz").status_code == 200, what="server up")
        dep.start_worker()
        yield dep
    finally:
        dep.stop()
        remove_state(dep.state_dir)  # its mounts first (tests/statedirs.py)
        log_text = (tmp_path / "server.log").read_text(errors="replace")
        sys.stderr.write("\n--- server.log (tail) ---\n" + "\n".join(log_text.splitlines()[-30:]))


def fill(directory: Path) -> Path:
    """Write a file until the filesystem has no byte left (ENOSPC)."""
    path = directory / "filler"
    with open(path, "wb", buffering=0) as out:
        for size in (64 << 10, 4 << 10, 512, 1):
            try:
                while True:
                    out.write(b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    return path


def readyz(dep: Deployment) -> httpx.Response:
    return httpx.get(f"{dep.url}/readyz", timeout=30)


def test_full_disk_fails_readyz_and_creates_cleanly_until_space_is_freed(
    full_disk_deployment: Deployment,
) -> None:
    dep = full_disk_deployment
    assert readyz(dep).status_code == 200, readyz(dep).text
    filler = fill(Path(dep.db.removeprefix("sqlite:///")).parent)
    try:
        answer = readyz(dep)
        deadline = time.monotonic() + 30
        while answer.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            answer = readyz(dep)
        assert answer.status_code == 503, answer.text
        body = answer.json()
        assert body["status"] == "degraded"
        store_problems = [p for p in body["problems"] if p.startswith("store: ")]
        assert store_problems and CAUSE in store_problems[0], body
        with dep.client(timeout=60) as alpha:
            answers = []
            for _ in range(20):  # a WAL restarted after a checkpoint still takes a write
                created = alpha.post("/api/v1/sandboxes", json={})
                answers.append(created)
                if created.status_code != 201:
                    break
            assert all(a.status_code in (201, 503) for a in answers), [a.text for a in answers]
            refused = answers[-1]
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "store_error", refused.text
            assert refused.headers["retry-after"]
            assert CAUSE in refused.json()["error"]["message"], refused.text
    finally:
        filler.unlink()
    server_log = (dep.data_dir / "server.log").read_text(errors="replace")
    assert f"store.failed cause='database or {CAUSE}'" in server_log
    wait_until(lambda: readyz(dep).status_code == 200, timeout=30, what="/readyz ok again")
    with dep.client(timeout=60) as alpha:
        created = alpha.post("/api/v1/sandboxes", json={})
        assert created.status_code == 201, created.text
        for sandbox in alpha.get("/api/v1/sandboxes").json()["sandboxes"]:
            alpha.delete(f"/api/v1/sandboxes/{sandbox['name']}")
    assert dep.server is not None and dep.server.poll() is None  # it rode the fault out
