"""A sandgate server (SQLite) and one bwrap worker for a benchmark script, stopped after."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sandgate.cli import launch


@dataclass(frozen=True)
class Stack:
    url: str
    key: str  # a tenant's
    admin: str  # an admin key (public templates)
    work: Path  # a scratch directory, removed after
    server_pid: int = 0
    worker_pid: int = 0


def sandgate(*args: str) -> str:
    exe = Path(sys.executable).parent / "sandgate"
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def pss_kib(pid: int) -> int:
    """The proportional set size of one process, in KiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running(*worker_args: str, capacity: int = 16) -> Iterator[Stack]:
    work = Path(tempfile.mkdtemp(prefix="sandgate-bench-"))
    state_dir = Path("/var/lib/sandgate-bench") / uuid.uuid4().hex[:8]
    db = f"sqlite:///{work / 'bench.db'}"
    key = sandgate("keys", "create", "--db", db, "--tenant", "bench")
    admin = sandgate("keys", "create", "--db", db, "--admin")
    token = sandgate("keys", "create", "--db", db, "--worker")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "bench.log"
    server = launch.start(
        launch.server_argv("--db", db, "--port", str(port), "--log-level", "WARNING"), log=log
    )
    worker = launch.start(
        launch.worker_argv(
            url,
            "bench",
            runtime="bwrap",
            capacity=capacity,
            state_dir=state_dir,
            extra=("--log-level", "WARNING", *worker_args),
        ),
        log=log,
        env=launch.child_env(token=token),
    )
    try:
        launch.wait_worker(url, key, proc=worker, log=log, interval=0.1, what="the worker")
        yield Stack(url, key, admin, work, server.pid, worker.pid)
    finally:
        for proc in (worker, server):
            proc.send_signal(signal.SIGTERM)
        for proc in (worker, server):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(state_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
