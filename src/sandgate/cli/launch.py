"""Starting `sandgate server` and `sandgate worker` as child processes, and waiting for them.

The one copy of what `sandgate up`, the benchmarks (`bench/`) and the test fixtures do to run
sandgate the way an operator does: the argv of `python -m sandgate server|worker ...`
(`server_argv`, `worker_argv`), its environment (`child_env`), the child itself in a session
of its own, writing to a log file (`start`, `start_async`), and a wait until it serves
(`wait_healthy`: `/healthz` answers 200; `wait_worker`: the worker is listed connected by
GET /api/v1/workers). A wait that runs out, or whose process exits first, raises
`LaunchError` naming the log and quoting its last lines.

    proc = start(server_argv("--db", db, "--port", str(port)), log=work / "server.log")
    wait_healthy(url, proc, log=work / "server.log")
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

FAULTS_ENV = "SANDGATE_FAULTS"  # sandgate.faults reads the fault points from it
TOKEN_ENV = "SANDGATE_TOKEN"  # the worker's --token
TAIL_LINES = 20  # of the log, quoted by a LaunchError


class LaunchError(Exception):
    """A started server or worker did not become ready: it exited, or the wait ran out."""


def server_argv(*args: str) -> list[str]:
    """`python -m sandgate server ARGS`, with this interpreter."""
    return [sys.executable, "-m", "sandgate", "server", *args]


def worker_argv(
    server: str,
    name: str,
    *,
    runtime: str,
    state_dir: Path | str,
    capacity: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`python -m sandgate worker --server S --name N --runtime R [--capacity C] --state-dir D
    EXTRA`, with this interpreter."""
    argv = [sys.executable, "-m", "sandgate", "worker", "--server", server, "--name", name]
    argv += ["--runtime", runtime]
    if capacity is not None:
        argv += ["--capacity", str(capacity)]
    return [*argv, "--state-dir", str(state_dir), *extra]


def child_env(*, token: str | None = None, faults: str | None = None) -> dict[str, str]:
    """This process's environment for a child: with `token` as the worker token if given;
    `faults` as its only fault points if given ("" for none; None keeps what is inherited)."""
    env = dict(os.environ)
    if faults is not None:
        env.pop(FAULTS_ENV, None)
        if faults:
            env[FAULTS_ENV] = faults
    if token is not None:
        env[TOKEN_ENV] = token
    return env


def _with_parent(env: Mapping[str, str] | None, die_with_parent: bool) -> Mapping[str, str] | None:
    if not die_with_parent:
        return env
    from sandgate.worker.main import PARENT_PID_ENV  # only a worker reads it

    return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def start(
    argv: Sequence[str],
    *,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start `argv` in a session of its own (a Ctrl-C or a test's signal to this process group
    does not reach it), its stdout and stderr appended to `log` (inherited without one).

    `env`: the child's whole environment (None: this process's). `die_with_parent`: a worker
    gets SIGTERM when this process dies, even by SIGKILL (`sandgate.worker.main
    .die_with_parent`)."""
    environ = _with_parent(env, die_with_parent)
    if log is None:
        return subprocess.Popen(argv, env=environ, start_new_session=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv, env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


async def start_async(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, die_with_parent: bool = False
) -> asyncio.subprocess.Process:
    """`start` on the running event loop, its output inherited (`sandgate up` supervises its
    worker so)."""
    environ = _with_parent(env, die_with_parent)
    return await asyncio.create_subprocess_exec(*argv, env=environ, start_new_session=True)


def tail(log: Path, lines: int = TAIL_LINES) -> str:
    """The last `lines` lines of a log ("" when it cannot be read)."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _failure(message: str, log: Path | None) -> LaunchError:
    if log is None:
        return LaunchError(message)
    return LaunchError(f"{message}; see {log}:\n{tail(log)}")


def wait_for(
    ready: Callable[[], bool],
    *,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    timeout: float = 30.0,
    interval: float = 0.05,
) -> None:
    """Poll `ready` until it is true. An HTTP or OS error from it counts as not yet. Raises
    LaunchError when `proc` exits first or after `timeout` seconds, naming `what` and `log`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready():
                return
        except (httpx.HTTPError, OSError):
            pass
        if proc is not None and proc.poll() is not None:
            raise _failure(f"{what}: the process exited with {proc.returncode}", log)
        if time.monotonic() >= deadline:
            raise _failure(f"{what}: not ready after {timeout:g} s", log)
        time.sleep(interval)


def wait_healthy(
    url: str,
    proc: subprocess.Popen[bytes] | None = None,
    *,
    log: Path | None = None,
    timeout: float = 30.0,
    interval: float = 0.05,
    probe_timeout: float = 5.0,
    what: str = "",
) -> None:
    """Wait until the server at `url` answers 200 on /healthz (each probe waits at most
    `probe_timeout`)."""

    def healthy() -> bool:
        return httpx.get(f"{url}/healthz", timeout=probe_timeout).status_code == 200

    wait_for(
        healthy,
        what=what or f"server {url}",
        proc=proc,
        log=log,
        timeout=timeout,
        interval=interval,
    )


def worker_listed(client: httpx.Client, name: str | None = None, *, connected: bool = True) -> bool:
    """Whether GET /api/v1/workers (through `client`, with its key) lists worker `name` (any
    worker when None) with that `connected`."""
    workers = client.get("/api/v1/workers").json()["workers"]
    return any((name is None or w["name"] == name) and w["connected"] == connected for w in workers)


def wait_worker(
    url: str,
    key: str,
    name: str | None = None,
    *,
    connected: bool = True,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    timeout: float = 30.0,
    interval: float = 0.05,
    probe_timeout: float = 60.0,
    what: str = "",
) -> None:
    """Wait until the server at `url`, asked with `key`, lists worker `name` (any worker when
    None) as `connected` (or, with connected=False, as not connected)."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=probe_timeout) as client:
        wait_for(
            lambda: worker_listed(client, name, connected=connected),
            what=what or f"worker {name or '(any)'} connected={connected}",
            proc=proc,
            log=log,
            timeout=timeout,
            interval=interval,
        )
