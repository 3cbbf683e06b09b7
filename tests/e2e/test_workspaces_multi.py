"""Workspace commits across instances on one PostgreSQL database: one lock for the
deployment, whichever instance a commit reaches, and a holder killed mid-commit.

A bwrap worker dials instance A. Commits through A and B at once all succeed, one at a time
under the workspace's advisory lock, none meets git's index.lock, and the history holds
every change. An instance SIGKILLed while its commit is half done (the worker's
`pause-workspace-git` fault holds it between two git steps) loses its lock with its store
connection: the next commit, through B, goes ahead at once, the dead holder's operation
stops before writing anything, and `git fsck` accepts the repository. A worker SIGKILLed
mid-commit, with the index.lock a killed git leaves, is handled the same way."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandgate.cli import launch as launcher
from tests.e2e.conftest import WORKER, Cluster, running_cluster, stop_process

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.bwrap]

COMMITS_PER_INSTANCE = 20


def start_worker(cl: Cluster, *, faults: str = "") -> None:
    via = cl.instances["A"]
    log_path = cl.base / f"worker-{WORKER}.log"
    argv = launcher.worker_argv(
        via.url, WORKER, runtime="bwrap", capacity=8, state_dir=cl.state_dir / WORKER
    )
    cl.worker = launcher.start(
        argv, log=log_path, env=launcher.child_env(token=cl.worker_token, faults=faults)
    )
    cl.worker_log = log_path
    cl.wait_connected(via)


@pytest.fixture(scope="module")
def cluster(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        pytest.skip("workspaces need root and bubblewrap")
    with running_cluster(pg_dsn, tmp_path_factory.mktemp("workspaces"), worker=False) as cl:
        start_worker(cl)
        yield cl


def run(client: httpx.Client, sandbox: str, code: str) -> str:
    out = client.post(f"/api/v1/sandboxes/{sandbox}/execute", json={"code": code})
    assert out.status_code == 200 and out.json()["exit_code"] == 0, out.text
    stdout: str = out.json()["stdout"]
    return stdout


def all_commits(client: httpx.Client, name: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    start = None
    while True:
        params: dict[str, Any] = {"limit": 7, **({"start": start} if start else {})}
        page = client.get(f"/api/v1/workspaces/{name}/commits", params=params)
        assert page.status_code == 200, page.text
        found += page.json()["commits"]
        start = page.json()["next"]
        if start is None:
            return found


def fsck(cl: Cluster, ws_id: str) -> str:
    """`git fsck` of the workspace's history, its image mounted read-only here (nothing
    else has it mounted: no sandbox uses it and no operation runs)."""
    image = cl.state_dir / WORKER / "workspaces" / ws_id / "disk.img"
    deadline = time.monotonic() + 20  # the worker unmounts it once its last user is gone
    while f"workspace-mounts/{ws_id}" in Path("/proc/self/mountinfo").read_text() or (
        subprocess.run(["losetup", "-j", str(image)], capture_output=True, text=True).stdout
    ):
        assert time.monotonic() < deadline, "the worker kept the workspace mounted"
        time.sleep(0.1)
    with tempfile.TemporaryDirectory() as point:
        subprocess.run(["mount", "-o", "loop,ro,noload", str(image), point], check=True)
        try:
            done = subprocess.run(
                ["git", "--git-dir", f"{point}/git", "-c", "safe.directory=*", "fsck", "--full"],
                capture_output=True,
                text=True,
            )
        finally:
            subprocess.run(["umount", point], check=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def worker_log(cl: Cluster) -> str:
    assert cl.worker_log is not None
    return cl.worker_log.read_text(errors="replace")


def test_concurrent_commits_through_two_instances(cluster: Cluster) -> None:
    with cluster.client("A") as a, cluster.client("B") as b:
        made = a.post("/api/v1/workspaces", json={"name": "busy", "quota_mb": 64})
        assert made.status_code == 201, made.text
        box = a.post("/api/v1/sandboxes", json={"workspace": "busy"}).json()["name"]
        clients = [a, b]

        def change_and_commit(i: int) -> httpx.Response:
            client = clients[i % 2]
            run(client, box, f"echo {i} > f{i}")
            return client.post("/api/v1/workspaces/busy/commits", json={"message": f"c{i}"})

        with concurrent.futures.ThreadPoolExecutor(max_workers=2 * COMMITS_PER_INSTANCE) as pool:
            answers = list(pool.map(change_and_commit, range(2 * COMMITS_PER_INSTANCE)))
        assert [r.status_code for r in answers] == [201] * len(answers), [
            r.text for r in answers if r.status_code != 201
        ]
        assert all("index.lock" not in r.text for r in answers)
        assert "index.lock" not in worker_log(cluster)

        commits = all_commits(b, "busy")
        made_here = [r.json()["commit"]["sha"] for r in answers if r.json()["created"]]
        assert set(made_here) <= {c["sha"] for c in commits}
        changed: set[str] = set()
        for sha in made_here:
            shown = a.get(f"/api/v1/workspaces/busy/commits/{sha}")
            changed |= {f["path"] for f in shown.json()["files"]}
        assert changed == {f"f{i}" for i in range(2 * COMMITS_PER_INSTANCE)}
        a.delete(f"/api/v1/sandboxes/{box}")
        ws_id = a.get("/api/v1/workspaces/busy").json()["id"]
        fsck(cluster, ws_id)


def test_a_holder_killed_mid_commit_releases_the_lock(cluster: Cluster) -> None:
    stop_process(cluster.worker)
    start_worker(cluster, faults="pause-workspace-git")
    doomed = cluster.start_instance("C")
    with cluster.client("A") as a, cluster.client("B") as b, cluster.client(doomed) as c:
        assert a.post("/api/v1/workspaces", json={"name": "held"}).status_code == 201
        box = a.post("/api/v1/sandboxes", json={"workspace": "held"}).json()["name"]
        run(a, box, "echo before > f")
        ws_id = a.get("/api/v1/workspaces/held").json()["id"]
        before = len(all_commits(a, "held"))
        paused = worker_log(cluster).count("fault.pause_workspace_git")

        outcome: dict[str, Any] = {}

        def doomed_commit() -> None:
            try:
                outcome["c"] = c.post("/api/v1/workspaces/held/commits", json={"message": "C's"})
            except httpx.HTTPError as exc:
                outcome["c"] = exc

        holder = threading.Thread(target=doomed_commit)
        holder.start()
        deadline = time.monotonic() + 20
        while worker_log(cluster).count("fault.pause_workspace_git") == paused:
            assert time.monotonic() < deadline, "C's commit never reached the worker"
            time.sleep(0.05)
        cluster.stop_instance("C", signal.SIGKILL)  # its store session, and the lock, end
        holder.join(timeout=30)
        assert isinstance(outcome["c"], httpx.HTTPError)  # C died with its request

        # (no execute first: the sandbox is frozen while a commit of its workspace runs)
        took = time.monotonic()
        saved = b.post("/api/v1/workspaces/held/commits", json={"message": "B's"})
        assert saved.status_code == 201, saved.text
        # the lock was free at once (B waited for the worker's pause at most, never 60 s)
        assert time.monotonic() - took < 20
        # the dead holder's operation stopped at its next step, before writing a commit
        assert "workspace.lock_lost_stopped" in worker_log(cluster)
        subjects = [x["message"].splitlines()[0] for x in all_commits(a, "held")]
        assert "C's" not in subjects and subjects[0] == "B's", subjects
        assert len(subjects) == before + 1
        shown = a.get(f"/api/v1/workspaces/held/commits/{saved.json()['commit']['sha']}").json()
        assert {f["path"] for f in shown["files"]} == {"f"}  # what C's commit never wrote
        a.delete(f"/api/v1/sandboxes/{box}")
        fsck(cluster, ws_id)


def test_a_worker_killed_mid_commit_leaves_a_sound_repository(cluster: Cluster) -> None:
    with cluster.client("A") as a:
        assert a.post("/api/v1/workspaces", json={"name": "crash"}).status_code == 201
        ws_id = a.get("/api/v1/workspaces/crash").json()["id"]
        box = a.post("/api/v1/sandboxes", json={"workspace": "crash"}).json()["name"]
        run(a, box, "echo 1 > one")
        paused = worker_log(cluster).count("fault.pause_workspace_git")
        holder = threading.Thread(
            target=lambda: a.post("/api/v1/workspaces/crash/commits", json={"message": "x"})
        )
        holder.start()
        deadline = time.monotonic() + 20
        while worker_log(cluster).count("fault.pause_workspace_git") == paused:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert cluster.worker is not None
        cluster.worker.kill()
        cluster.worker.wait()
        holder.join(timeout=60)
        # the dead worker's mount of the image is still there; through it, what a git killed
        # while it wrote the index leaves behind
        left = cluster.state_dir / WORKER / WORKER / "workspace-mounts" / ws_id
        assert os.path.ismount(left)
        (left / "git" / "index.lock").write_bytes(b"half")
        start_worker(cluster)  # unmounts what the dead one left
        box = a.post("/api/v1/sandboxes", json={"workspace": "crash"}).json()["name"]
        run(a, box, "echo 2 > two")
        saved = a.post("/api/v1/workspaces/crash/commits", json={"message": "after the crash"})
        assert saved.status_code == 201, saved.text
        shown = a.get(f"/api/v1/workspaces/crash/commits/{saved.json()['commit']['sha']}").json()
        assert {f["path"] for f in shown["files"]} == {"one", "two"}
        assert "workspace.stale_index_lock" in worker_log(cluster)
        a.delete(f"/api/v1/sandboxes/{box}")
        fsck(cluster, ws_id)
