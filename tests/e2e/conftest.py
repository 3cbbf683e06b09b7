"""Several real `sandgate server` instances on one fresh PostgreSQL database, one real worker.

Everything runs as subprocesses started through the CLI, exactly as an operator starts them:
`sandgate migrate`, `sandgate keys create`, N `sandgate server --node-url ... --secret-file
...` sharing one secret file, and `sandgate worker` dialing one of them. The database is
created per module on the server of `--pg-dsn` and dropped after it; without `--pg-dsn`
every test here is skipped.

    SANDGATE_E2E_RUNTIME   the worker's runtime (default `process`: these tests exercise
                           the control plane, not the isolation, and it starts fastest)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
from sqlalchemy import make_url

from sandgate.cli import launch as launcher
from tests import logrecords
from tests.integration.api.conftest import free_port, sandgate
from tests.keys import create_keys
from tests.statedirs import remove_state

RUNTIME = os.environ.get("SANDGATE_E2E_RUNTIME", "process")
RECOVERY_AFTER = 5.0  # --recovery-after of the healthy instances
RECOVERY_INTERVAL = 1.0  # --recovery-interval of every instance
HEARTBEAT = 10.0  # the worker's heartbeat interval (WorkerSettings.heartbeat_interval)
WORKER = "w1"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.postgres)
            item.add_marker(pytest.mark.slow)


def with_database(dsn: str, database: str) -> str:
    return (
        make_url(dsn)
        .set(drivername="postgresql", database=database, query={})
        .render_as_string(hide_password=False)
    )


def pg(dsn: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    """Run one statement on its own connection, on a loop of its own (tests are sync)."""

    async def go() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, go()).result()


@dataclass
class Instance:
    name: str
    port: int
    args: tuple[str, ...]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Cluster:
    admin_dsn: str
    db: str
    db_url: str
    base: Path
    state_dir: Path
    secret_file: Path
    key: str
    worker_token: str
    admin_key: str = ""  # `sandgate keys create --admin`: the fleet-wide views
    instances: dict[str, Instance] = field(default_factory=dict)
    worker: subprocess.Popen[bytes] | None = None
    worker_log: Path | None = None
    extra_workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    # -- instances -------------------------------------------------------------------------
    def start_instance(
        self,
        name: str,
        *,
        faults: str = "",
        owner_ttl: float | None = None,
        recovery_after: float = RECOVERY_AFTER,
        recovery_interval: float = RECOVERY_INTERVAL,
        extra: tuple[str, ...] = (),
        port: int = 0,
        node_url: str = "",
    ) -> Instance:
        """`port` and `node_url` (where peers reach it: a fault proxy in tests) default to a
        free port and that port on 127.0.0.1."""
        port = port or free_port()
        args = [
            "--db",
            self.db_url,
            "--port",
            str(port),
            "--node-url",
            node_url or f"http://127.0.0.1:{port}",
            "--secret-file",
            str(self.secret_file),
            "--recovery-after",
            f"{recovery_after:g}",
            "--recovery-interval",
            f"{recovery_interval:g}",
            "--start-timeout",
            "30",
        ]
        if owner_ttl is not None:
            args += ["--owner-ttl", f"{owner_ttl:g}"]
        env = {"SANDGATE_FAULTS": faults} if faults else {}
        inst = Instance(name, port, (*args, *extra), env, self.base / f"server-{name}.log")
        self.instances[name] = inst
        self.launch(inst)
        return inst

    def launch(self, inst: Instance) -> None:
        """(Re)start an instance's process with its arguments, on its port; wait until up."""
        env = {**launcher.child_env(faults=""), **inst.env}
        inst.proc = launcher.start(launcher.server_argv(*inst.args), log=inst.log, env=env)
        inst.starts += 1
        try:
            launcher.wait_healthy(
                inst.url, inst.proc, log=inst.log, probe_timeout=1, what=f"instance {inst.name}"
            )
        except launcher.LaunchError as exc:
            raise AssertionError(str(exc)) from None  # a test restarting a dying one retries

    def stop_instance(self, name: str, sig: int = signal.SIGTERM) -> None:
        inst = self.instances.pop(name)
        stop_process(inst.proc, sig)

    # -- worker ----------------------------------------------------------------------------
    def start_worker(
        self,
        via: Instance,
        capacity: int = 160,
        *,
        name: str = WORKER,
        token: str | None = None,
        faults: str = "",
        server_url: str = "",
    ) -> subprocess.Popen[bytes]:
        """Start worker `name` (the default one, w1, keeps `self.worker`) dialing `via`
        (at `server_url` if given: a fault proxy in front of it)."""
        log_path = self.base / f"worker-{name}.log"
        env = {k: v for k, v in os.environ.items() if k != "SANDGATE_FAULTS"}
        env["SANDGATE_TOKEN"] = token or self.worker_token
        env["SANDGATE_LOG_FORMAT"] = "json"  # read back by worker_records()
        if faults:
            env["SANDGATE_FAULTS"] = faults
        argv = launcher.worker_argv(
            server_url or via.url,
            name,
            runtime=RUNTIME,
            capacity=capacity,
            state_dir=self.state_dir / name,
        )
        proc = launcher.start(argv, log=log_path, env=env)
        if name == WORKER:
            self.worker, self.worker_log = proc, log_path
        else:
            self.extra_workers.append(proc)
        self.wait_connected(via, name)
        return proc

    def wait_connected(self, inst: Instance, name: str = WORKER, timeout: float = 30) -> None:
        what = f"worker {name} connected to {inst.name}"
        launcher.wait_worker(inst.url, self.key, name, timeout=timeout, what=what)

    # -- clients and the store ---------------------------------------------------------------
    def client(self, inst: Instance | str, timeout: float = 60.0) -> httpx.Client:
        target = self.instances[inst] if isinstance(inst, str) else inst
        return httpx.Client(
            base_url=target.url,
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=timeout,
        )

    def sql(self, statement: str, *args: Any) -> list[asyncpg.Record]:
        return pg(self.db_url, statement, *args)

    def owner(self) -> tuple[str, float] | None:
        rows = self.sql(
            "select node_url, extract(epoch from now() - updated_at)::float8 as age "
            "from tunnel_owners where tunnel_key = $1",
            WORKER,
        )
        return (rows[0]["node_url"], rows[0]["age"]) if rows else None

    # -- the worker's own account of what it started ---------------------------------------
    def worker_records(self) -> list[dict[str, Any]]:
        """Worker w1's log records: it logs one JSON object a line (SANDGATE_LOG_FORMAT=json)."""
        assert self.worker_log is not None
        return logrecords.read_records(self.worker_log)

    def worker_sandboxes(self, event: str) -> Counter[str]:
        """How many times worker w1 logged `event` (e.g. sandbox.started), per sandbox name."""
        return logrecords.sandboxes(self.worker_records(), event)

    def worker_events(self) -> tuple[Counter[str], Counter[str]]:
        """(starts, repeated provisions) per sandbox name, read from the worker's log."""
        return self.worker_sandboxes("sandbox.started"), self.worker_sandboxes(
            "sandbox.provision_repeat"
        )

    def delete_everything(self) -> None:
        """Delete every sandbox of the tenant that is not deleted yet (through the owner)."""
        a = self.instances["A"]
        with self.client(a) as c:
            names: list[str] = []
            cursor = None
            while True:
                params: dict[str, Any] = {"limit": 100}
                if cursor:
                    params["cursor"] = cursor
                page = c.get("/api/v1/sandboxes", params=params)
                if page.status_code != 200:
                    return
                body = page.json()
                names += [s["name"] for s in body["sandboxes"] if s["state"] != "deleted"]
                cursor = body.get("next_cursor")
                if not cursor:
                    break

            def delete(name: str) -> None:
                try:
                    c.delete(f"/api/v1/sandboxes/{name}")
                except httpx.HTTPError:
                    pass

            with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
                list(pool.map(delete, names))

    def stop(self) -> None:
        for inst in self.instances.values():
            if inst.proc is not None and inst.proc.poll() is None:
                os.kill(inst.proc.pid, signal.SIGCONT)
        stop_process(self.worker, signal.SIGTERM)  # first: it destroys its sandboxes
        for proc in self.extra_workers:
            stop_process(proc, signal.SIGTERM)
        for name in list(self.instances):
            self.stop_instance(name)


def stop_process(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(sig)
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_cluster(
    pg_dsn: str,
    base: Path,
    *,
    extra: tuple[str, ...] = (),
    capacity: int = 160,
    worker_faults: str = "",
    worker: bool = True,
    a_port: int = 0,
    a_node_url: str = "",
) -> Iterator[Cluster]:
    """Instances A and B (each with `extra` arguments) and worker w1 dialing A (unless
    `worker` is false: the test starts it)."""
    if RUNTIME == "bwrap" and (os.geteuid() != 0 or shutil.which("bwrap") is None):
        pytest.skip("the bwrap runtime needs root and bubblewrap")
    db = f"sandgate_e2e_{uuid.uuid4().hex[:10]}"
    admin = with_database(pg_dsn, make_url(pg_dsn).database or "postgres")
    pg(admin, f'CREATE DATABASE "{db}"')
    state_dir = Path("/var/lib/sandgate-test") / f"e2e-{uuid.uuid4().hex[:10]}"
    cl: Cluster | None = None
    try:
        db_url = with_database(pg_dsn, db)
        sandgate("migrate", "--db", db_url)
        secret_file = base / "secret"
        secret_file.write_text(secrets.token_urlsafe(48))
        secret_file.chmod(0o600)
        tenant_keys, token, admin_key = create_keys(db_url, ("e2e",), worker_name=WORKER)
        cl = Cluster(
            admin_dsn=admin,
            db=db,
            db_url=db_url,
            base=base,
            state_dir=state_dir,
            secret_file=secret_file,
            key=tenant_keys["e2e"],
            worker_token=token,
            admin_key=admin_key,
        )
        a = cl.start_instance("A", extra=extra, port=a_port, node_url=a_node_url)
        cl.start_instance("B", extra=extra)
        if worker:
            cl.start_worker(a, capacity, faults=worker_faults)
        yield cl
    finally:
        if cl is not None:
            cl.stop()
            for log in sorted(base.glob("*.log")):
                sys.stderr.write(f"\n--- {log.name} (tail) ---\n{tail(log)}\n")
        remove_state(state_dir)
        pg(admin, f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


@pytest.fixture(scope="module")
def cluster(pg_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Instances A and B (healthy, racing recovery) and worker w1 dialing A."""
    with running_cluster(pg_dsn, tmp_path_factory.mktemp("cluster")) as cl:
        yield cl


@pytest.fixture
def clean(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, back to A + B + w1 and no live sandbox after the test."""
    yield cluster
    for name, inst in list(cluster.instances.items()):
        if inst.proc is not None and inst.proc.poll() is None:
            os.kill(inst.proc.pid, signal.SIGCONT)
        if name not in ("A", "B"):
            cluster.stop_instance(name)
    cluster.delete_everything()


def now() -> float:
    return time.monotonic()
