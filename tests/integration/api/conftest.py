"""A real deployment for API tests: `sandgate server` on a SQLite file and a real worker.

Both run as subprocesses started through the CLI, exactly as a user starts them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandgate.cli import launch
from tests import logrecords
from tests.keys import create_keys
from tests.statedirs import remove_network_leftovers, remove_state

RUNTIME = os.environ.get("SANDGATE_TEST_RUNTIME", "bwrap")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sandgate(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "sandgate", *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    return out.stdout.strip()


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what or predicate}")


@dataclass
class Deployment:
    url: str
    db: str
    data_dir: Path
    state_dir: Path
    keys: dict[str, str]
    worker_token: str
    admin_key: str = ""  # `sandgate keys create --admin`: the fleet-wide views
    server: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)

    def client(self, tenant: str = "alpha", **kw: object) -> httpx.Client:
        options: dict[str, object] = {"timeout": 60.0, **kw}
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
            **options,  # type: ignore[arg-type]
        )

    def admin(self, **kw: object) -> httpx.Client:
        """A client with the deployment's admin key (the fleet-wide views)."""
        options: dict[str, object] = {"timeout": 60.0, **kw}
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.admin_key}"},
            **options,  # type: ignore[arg-type]
        )

    def start_worker(
        self,
        name: str = "w1",
        capacity: int = 32,
        faults: str = "",
        server_url: str = "",
        args: tuple[str, ...] = (),
    ) -> None:
        """`server_url`: where the worker dials (default the server; a fault proxy in tests)."""
        log = self.data_dir / f"worker-{name}.log"
        argv = launch.worker_argv(
            server_url or self.url,
            name,
            runtime=RUNTIME,
            capacity=capacity,
            state_dir=self.state_dir,
            extra=args,
        )
        env = launch.child_env(token=self.worker_token, faults=faults)
        env["SANDGATE_LOG_FORMAT"] = "json"  # read back by worker_records()
        self.worker = launch.start(argv, log=log, env=env)
        launch.wait_worker(
            self.url, self.keys["alpha"], name, proc=self.worker, log=log, timeout=20
        )

    def worker_records(self, name: str = "w1") -> list[dict[str, Any]]:
        """Worker `name`'s log records (it logs JSON lines: SANDGATE_LOG_FORMAT=json)."""
        return logrecords.read_records(self.data_dir / f"worker-{name}.log")

    def worker_sandboxes(self, event: str, name: str = "w1") -> Counter[str]:
        """How many times worker `name` logged `event` (e.g. sandbox.started), per sandbox."""
        return logrecords.sandboxes(self.worker_records(name), event)

    def wait_worker(self, name: str, *, connected: bool) -> None:
        launch.wait_worker(self.url, self.keys["alpha"], name, connected=connected, timeout=20)

    def stop_worker(self, sig: int = signal.SIGTERM) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(sig)
            self.worker.wait(timeout=30)
        self.worker = None

    def stop(self) -> None:
        self.stop_worker()
        remove_network_leftovers(self.state_dir)  # of a worker SIGKILLed and not restarted
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.server.kill()


def start_deployment(
    base: Path, *, worker: bool = True, server_args: tuple[str, ...] = ()
) -> Deployment:
    data_dir = base / "data"
    data_dir.mkdir(parents=True)
    db = f"sqlite:///{data_dir / 'sandgate.db'}"
    keys, token, admin_key = create_keys(db, ("alpha", "beta"))
    port = free_port()
    state_dir = Path("/var/lib/sandgate-test") / uuid.uuid4().hex[:10]
    dep = Deployment(
        url=f"http://127.0.0.1:{port}",
        db=db,
        data_dir=data_dir,
        state_dir=state_dir,
        keys=keys,
        worker_token=token,
        admin_key=admin_key,
    )
    log = data_dir / "server.log"
    dep.server = launch.start(
        launch.server_argv("--db", db, "--port", str(port), *server_args), log=log
    )
    try:
        launch.wait_healthy(dep.url, dep.server, log=log, timeout=20, what="server up")
        if worker:
            dep.start_worker()
    except BaseException:  # a deployment that did not come up leaves no process behind
        tear_down(dep)
        raise
    return dep


@pytest.fixture(scope="session")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    if RUNTIME == "bwrap" and (os.geteuid() != 0 or shutil.which("bwrap") is None):
        pytest.skip("the bwrap runtime needs root and bubblewrap (apt-get install -y bubblewrap)")
    dep = start_deployment(tmp_path_factory.mktemp("deployment"))
    try:
        yield dep
    finally:
        tear_down(dep)


@contextlib.contextmanager
def own_deployment(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *,
    worker: bool = True,
    server_args: tuple[str, ...] = (),
) -> Iterator[Deployment]:
    """A deployment of a module's own (one it restarts, limits or fills), torn down after."""
    if RUNTIME == "bwrap" and (os.geteuid() != 0 or shutil.which("bwrap") is None):
        pytest.skip("the bwrap runtime needs root and bubblewrap (apt-get install -y bubblewrap)")
    dep = start_deployment(tmp_path_factory.mktemp(name), worker=worker, server_args=server_args)
    try:
        yield dep
    finally:
        tear_down(dep)


def tear_down(dep: Deployment, lines: int = 40) -> None:
    """Stop the deployment, remove its worker state, show the tail of its logs."""
    dep.stop()
    remove_state(dep.state_dir)
    for name in ("server.log", "worker-w1.log"):
        path = dep.data_dir / name
        if path.exists():
            sys.stderr.write(f"\n--- {name} (tail) ---\n")
            sys.stderr.write("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))


@pytest.fixture
def alpha(deployment: Deployment) -> Iterator[httpx.Client]:
    with deployment.client("alpha") as client:
        yield client


@pytest.fixture
def beta(deployment: Deployment) -> Iterator[httpx.Client]:
    with deployment.client("beta") as client:
        yield client


@pytest.fixture
def sandbox(alpha: httpx.Client) -> Iterator[str]:
    response = alpha.post("/api/v1/sandboxes", json={})
    assert response.status_code == 201, response.text
    name: str = response.json()["name"]
    yield name
    alpha.delete(f"/api/v1/sandboxes/{name}")
