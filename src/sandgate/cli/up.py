"""`sandgate up`: one API instance on SQLite plus one local worker, for a laptop."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path

from sandgate.cli.serve import make_server
from sandgate.config import ServerSettings

log = logging.getLogger(__name__)

WORKER_STOP_TIMEOUT = 20.0


def _secret_file(path: Path, make: str) -> tuple[str, bool]:
    """Read a 0600 file, creating it with `make` on first run."""
    if path.exists():
        return path.read_text().strip(), False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(make + "\n")
    return make, True


async def _credentials(db: str, data_dir: Path) -> tuple[str, str]:
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
                ApiKey(key_hash(api_key), "tenant", tenant.id, datetime.now(UTC), label="default")
            )
        token, new_token = _secret_file(data_dir / "worker-token", new_key("worker"))
        if new_token or await store.find_api_key(key_hash(token)) is None:
            await store.add_api_key(ApiKey(key_hash(token), "worker", None, datetime.now(UTC)))
        return api_key, token
    finally:
        await store.aclose()


def run_up(
    *, port: int, host: str, data_dir: Path, runtime: str, capacity: int, state_dir: Path
) -> int:
    import uvloop

    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)
    db = f"sqlite:///{(data_dir / 'sandgate.db').resolve()}"
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_up(db, port, host, data_dir, runtime, capacity, state_dir))


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

    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            return 1  # uvicorn logged why (port in use, ...)
        await asyncio.sleep(0.02)
    url = f"http://{host}:{port}"
    env = dict(os.environ, SANDGATE_TOKEN=token)
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sandgate",
        "worker",
        "--server",
        url,
        "--name",
        "local",
        "--runtime",
        runtime,
        "--capacity",
        str(capacity),
        "--state-dir",
        str(state_dir),
        env=env,
        start_new_session=True,  # we stop it ourselves, in order
    )
    _banner(url, api_key, data_dir)
    waiter = asyncio.create_task(worker.wait())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper, serving}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if waiter.done() and not stop.is_set():
        log.error("up.worker_exited", extra={"code": worker.returncode})
        code = 1
    if worker.returncode is None:
        worker.send_signal(signal.SIGTERM)  # the worker removes every sandbox it started
        try:
            await asyncio.wait_for(waiter, WORKER_STOP_TIMEOUT)
        except TimeoutError:
            log.error("up.worker_kill", extra={"after_s": WORKER_STOP_TIMEOUT})
            worker.kill()
            await worker.wait()
    stopper.cancel()
    server.should_exit = True
    await serving
    return code


def _banner(url: str, api_key: str, data_dir: Path) -> None:
    auth = f'-H "Authorization: Bearer $(cat {data_dir / "api-key"})"'
    json = "-H 'Content-Type: application/json'"
    sys.stdout.write(
        f"""
sandgate is running at {url}  (docs: {url}/docs)
API key: {api_key}   (saved in {data_dir / "api-key"})

Try it:
  curl -s -X POST {url}/api/v1/sandboxes {auth} {json} -d '{{}}'
  curl -s -X POST {url}/api/v1/sandboxes/<name>/execute {auth} {json} \\
       -d '{{"language": "bash", "code": "echo ok"}}'

Ctrl-C stops the worker and every sandbox it started.
"""
    )
    sys.stdout.flush()
