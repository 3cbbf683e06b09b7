"""`sandgate up`: one API instance on SQLite plus one local worker it supervises, for a laptop.

The worker is a child process that dies with `up`, even when `up` is killed with SIGKILL
(`SANDGATE_PARENT_PID`, see `sandgate.worker.main.die_with_parent`), and that `up` starts
again, with backoff, whenever it dies. A restarted worker removes what its predecessor left
(`runtime.prepare()`) and reports no sandboxes, so the control plane marks the old ones error.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import cast

import uvicorn
from fastapi import FastAPI

from sandgate.cli.launch import child_env, start_async, worker_argv
from sandgate.cli.serve import make_server
from sandgate.config import ServerSettings

log = logging.getLogger(__name__)

WORKER_STOP_TIMEOUT = 20.0
WORKER_ATTACH_TIMEOUT = 30.0  # the banner waits this long for the worker to attach
RESTART_MIN_INTERVAL = 0.5  # the first restart of a dead worker; doubling up to the max
RESTART_MAX_INTERVAL = 10.0
STABLE_AFTER = 30.0  # a worker that ran this long starts the backoff over
URL_FILE = "url"  # beside `api-key`: what the CLI and SDK call from this directory
UP_STATE_ROOT = Path("/var/lib/sandgate-up")  # when the data dir is not traversable


def default_state_dir(data_dir: Path) -> Path:
    """`<data-dir>/state`, or a directory of its own under /var/lib/sandgate-up when sandbox
    uids cannot traverse to the data dir (one under a 0700 home, say)."""
    from sandgate.worker.runtime.bwrap_host import untraversable

    data = data_dir.resolve()
    if untraversable(data.parent) is None:
        return data / "state"
    return UP_STATE_ROOT / hashlib.sha256(str(data).encode()).hexdigest()[:12]


def preflight(host: str, port: int, runtime: str, state_dir: Path) -> str | None:
    """What would stop `up`, as one line saying what to do; None when nothing does."""
    from sandgate.worker.runtime.bwrap_host import untraversable

    dev = "or give --runtime process for development (no isolation)"
    if runtime == "bwrap":
        if os.geteuid() != 0:
            return f"the bwrap runtime needs root (each sandbox gets a uid of its own): {dev}"
        for tool, package in (("bwrap", "bubblewrap"), ("setpriv", "util-linux")):
            if shutil.which(tool) is None:
                return f"{tool} not found: run `apt-get install -y {package}`, {dev}"
        # the worker makes the state dir itself 0711; what leads to it must let uids through
        blocked = untraversable(next(p for p in state_dir.absolute().parents if p.exists()))
        if blocked is not None:
            return (
                f"{blocked} is not traversable by sandbox uids (needs o+x), so sandboxes under "
                f"{state_dir} could not reach their workspace: `chmod o+x {blocked}` or give "
                "another --state-dir"
            )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is in use: stop what listens there, or choose "
                    "another with --port"
                )
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def _secret_file(path: Path, make: str) -> tuple[str, bool]:
    """Read a 0600 file, creating it with `make` on first run."""
    if path.exists():
        return path.read_text().strip(), False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(make + "\n")
    return make, True


def _private_database(data_dir: Path) -> None:
    """The database 0600 (SQLite gives its -wal and -shm files the same mode)."""
    db = data_dir / "sandgate.db"
    os.close(os.open(db, os.O_WRONLY | os.O_CREAT, 0o600))
    for suffix in ("", "-wal", "-shm"):
        path = db.with_name(db.name + suffix)
        if path.exists():
            os.chmod(path, 0o600)


def _save_url(data_dir: Path, url: str) -> None:
    tmp = data_dir / f".{URL_FILE}.tmp"
    tmp.write_text(url + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, data_dir / URL_FILE)


async def _credentials(db: str, data_dir: Path) -> tuple[str, str]:
    from sandgate.core.clock import utcnow
    from sandgate.core.credentials import key_hash, new_key
    from sandgate.store import migrate
    from sandgate.store.base import ApiKey
    from sandgate.store.sql import open_store

    await migrate.upgrade(db)
    store = await open_store(db)
    try:
        tenant = await store.ensure_tenant("default")
        api_key, new_api = _secret_file(data_dir / "api-key", new_key("tenant"))
        if new_api or await store.find_api_key(key_hash(api_key)) is None:
            await store.add_api_key(
                ApiKey(key_hash(api_key), "tenant", tenant.id, utcnow(), label="default")
            )
        token, new_token = _secret_file(data_dir / "worker-token", new_key("worker"))
        if new_token or await store.find_api_key(key_hash(token)) is None:
            await store.add_api_key(ApiKey(key_hash(token), "worker", None, utcnow()))
        return api_key, token
    finally:
        await store.aclose()


def run_up(
    *, port: int, host: str, data_dir: Path, runtime: str, capacity: int, state_dir: Path | None
) -> int:
    import uvloop

    data_dir.mkdir(parents=True, exist_ok=True)
    state = state_dir if state_dir is not None else default_state_dir(data_dir)
    # sandbox uids traverse the data dir to a state dir inside it; its files stay 0600
    inside = state.absolute().is_relative_to(data_dir.resolve())
    os.chmod(data_dir, 0o711 if inside else 0o700)
    problem = preflight(host, port, runtime, state)
    if problem is not None:
        sys.stderr.write(f"error: {problem}\n")
        return 1
    _private_database(data_dir)
    db = f"sqlite:///{(data_dir / 'sandgate.db').resolve()}"
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_up(db, port, host, data_dir, runtime, capacity, state))


async def _serve(server: uvicorn.Server) -> None:
    try:
        await server.serve()
    except SystemExit:  # uvicorn exits when it cannot bind; it logged why in one line
        pass


async def _up(
    db: str, port: int, host: str, data_dir: Path, runtime: str, capacity: int, state_dir: Path
) -> int:
    api_key, token = await _credentials(db, data_dir)
    secret, _ = _secret_file(data_dir / "secret", secrets.token_urlsafe(32))
    settings = ServerSettings(db_url=db, host=host, port=port, secret=secret)
    server = make_server(settings, own_signals=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    serving = asyncio.create_task(_serve(server))
    while not server.started:
        if serving.done():
            sys.stderr.write(f"error: the API could not start on {host}:{port} (see above)\n")
            return 1
        await asyncio.sleep(0.02)
    url = f"http://{host}:{port}"
    _save_url(data_dir, url)
    argv = worker_argv(url, "local", runtime=runtime, capacity=capacity, state_dir=state_dir)
    env = child_env(token=token)
    supervisor = asyncio.create_task(_supervise(argv, env, stop))
    # the banner says "try it": so the worker is attached first, and the first try works
    if not await _worker_attached(server, supervisor, WORKER_ATTACH_TIMEOUT):
        log.warning("up.worker_not_attached", extra={"after_s": WORKER_ATTACH_TIMEOUT})
    _banner(url, api_key, data_dir)
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({stopper, serving, supervisor}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if not stop.is_set():
        log.error("up.api_stopped: stopping the worker too")
        code = 1
    stop.set()
    await supervisor  # stops the worker, which removes every sandbox it started
    server.should_exit = True
    await serving
    return code


async def _worker_attached(
    server: uvicorn.Server, supervisor: asyncio.Task[None], within: float
) -> bool:
    """Wait until the local worker's tunnel serves in this process's API instance."""
    app = cast(FastAPI, server.config.app)  # make_server hands uvicorn our FastAPI app
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not supervisor.done():
        services = getattr(app.state, "services", None)  # set by the app's lifespan
        if services is not None and services.state.tunnels:
            return True
        await asyncio.sleep(0.05)
    return False


async def _supervise(argv: list[str], env: dict[str, str], stop: asyncio.Event) -> None:
    """Run the worker until `stop` is set, starting it again with backoff each time it dies."""
    delay = RESTART_MIN_INTERVAL
    while True:
        started = time.monotonic()
        try:
            # a session of its own: a Ctrl-C in the terminal reaches only `up`, which stops the
            # worker in order; it dies with `up` all the same (PR_SET_PDEATHSIG)
            worker = await start_async(argv, env=env, die_with_parent=True)
        except OSError as exc:
            log.error("up.worker_spawn_failed", extra={"error": str(exc)})
            code: int | None = None
        else:
            exited = asyncio.create_task(worker.wait())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if stop.is_set():
                await _stop_worker(worker)
                return
            code = worker.returncode
        ran = time.monotonic() - started
        if ran >= STABLE_AFTER:
            delay = RESTART_MIN_INTERVAL
        log.warning(
            "up.worker_restarted: the worker died; a new one starts after the delay",
            extra={"exit_code": code, "ran_s": round(ran, 1), "delay_s": delay},
        )
        try:
            await asyncio.wait_for(stop.wait(), delay)
            return
        except TimeoutError:
            delay = min(delay * 2, RESTART_MAX_INTERVAL)


async def _stop_worker(worker: asyncio.subprocess.Process) -> None:
    if worker.returncode is not None:
        return
    worker.send_signal(signal.SIGTERM)  # the worker removes every sandbox it started
    try:
        await asyncio.wait_for(worker.wait(), WORKER_STOP_TIMEOUT)
    except TimeoutError:
        log.error("up.worker_kill", extra={"after_s": WORKER_STOP_TIMEOUT})
        worker.kill()
        await worker.wait()


def _banner(url: str, api_key: str, data_dir: Path) -> None:
    auth = f'-H "Authorization: Bearer $(cat {data_dir / "api-key"})"'
    json = "-H 'Content-Type: application/json'"
    sys.stdout.write(
        f"""
sandgate is running at {url}  (docs: {url}/docs)
API key: {api_key}   (saved in {data_dir / "api-key"}, the URL in {data_dir / URL_FILE})

Try it:
  curl -s -X POST {url}/api/v1/sandboxes {auth} {json} -d '{{}}'
  curl -s -X POST {url}/api/v1/sandboxes/<name>/execute {auth} {json} \\
       -d '{{"language": "bash", "code": "echo ok"}}'

E2B's SDKs work unmodified (docs/e2b.md):
  export E2B_API_KEY=$(cat {data_dir / "api-key"}) E2B_API_URL={url} E2B_SANDBOX_URL={url}

Ctrl-C stops the worker and every sandbox it started.
"""
    )
    sys.stdout.flush()
