"""`sandgate worker`: prepare the runtime, dial the control plane, serve until signalled."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from sandgate.agent import MODULES as AGENT_MODULES
from sandgate.agent import PROGRAMS as AGENT_PROGRAMS
from sandgate.agent import deployed_name
from sandgate.agent.frames import Header
from sandgate.config import WorkerSettings
from sandgate.faults import FAULTS
from sandgate.tunnel.client import TunnelClient
from sandgate.tunnel.rpc import RpcChannel
from sandgate.worker import budget, pool
from sandgate.worker.egress import EgressConfig
from sandgate.worker.runtime.base import Runtime
from sandgate.worker.service import WorkerService
from sandgate.worker.state import WorkerLocalState
from sandgate.worker.workspaces import WorkspaceHost

log = logging.getLogger(__name__)

AGENT_SOURCE = Path(__file__).resolve().parent.parent / "agent"


SANDBOX_PYTHON = Path("/usr/bin/python3")

# agent.py is a launcher: Python never caches the bytecode of a script it runs, but it does for
# modules, so the agent proper is imported from bytecode compiled here once (the directory is
# read-only inside the sandbox). Saves ~5 ms and ~2 MiB per sandbox start.
_LAUNCHER = """import sys
sys.path.insert(0, __file__.rpartition("/")[0])
import sandgate_agent
sys.exit(sandgate_agent.main(sys.argv[1:]))
"""


def install_agent(agent_dir: Path) -> None:
    """Copy the agent where every sandbox uid can read it (it is bind-mounted read-only)."""
    agent_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(agent_dir, 0o755)
    for module in AGENT_MODULES:  # every module of the agent, flat (see sandgate/agent)
        target = agent_dir / deployed_name(module)
        shutil.copyfile(AGENT_SOURCE / f"{module}.py", target)
        os.chmod(target, 0o644)
    for program in AGENT_PROGRAMS:  # run by the control plane as processes (kernel_bridge)
        shutil.copyfile(AGENT_SOURCE / f"{program}.py", agent_dir / f"{program}.py")
        os.chmod(agent_dir / f"{program}.py", 0o644)
    (agent_dir / "agent.py").write_text(_LAUNCHER)
    os.chmod(agent_dir / "agent.py", 0o644)
    if SANDBOX_PYTHON.exists():
        subprocess.run(
            [str(SANDBOX_PYTHON), "-m", "compileall", "-q", str(agent_dir)],
            check=True,
            capture_output=True,
        )
        for cached in (agent_dir / "__pycache__").iterdir():
            os.chmod(cached, 0o644)
        os.chmod(agent_dir / "__pycache__", 0o755)


def runtime_scope(name: str, state_dir: Path) -> str:
    """The name the runtime files host resources under (cgroups): unique per (name, state dir).

    Two workers on one host never share it, so one's crash cleanup cannot touch the other's
    sandboxes, and it is stable across restarts, so leftovers of a crash are found again.
    """
    slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")[:40] or "worker"
    digest = hashlib.sha256(f"{state_dir.resolve()}\0{name}".encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


LOCK_WAIT_TIMEOUT = 30.0  # how long a new worker waits for the state dir's previous holder
LOCK_POLL_INTERVAL = 0.2


def lock_state_dir(state_dir: Path, wait_timeout: float = LOCK_WAIT_TIMEOUT) -> int:
    """Hold an exclusive lock on the worker's state dir for the life of the process.

    A worker that held it may still be tearing down its sandboxes (the worker of a `sandgate up`
    that was killed stops on the way out), so wait up to `wait_timeout` for it to let go.
    """
    fd = os.open(state_dir / "worker.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_timeout
    warned = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            os.close(fd)
            raise SystemExit(
                f"another worker is running with state dir {state_dir} (still after "
                f"{wait_timeout:g} s); give this one another --name or --state-dir"
            )
        if not warned:
            warned = True
            log.warning(
                "worker.state_dir_busy: waiting for the worker that holds it to stop",
                extra={"state_dir": str(state_dir), "wait_s": wait_timeout},
            )
        time.sleep(LOCK_POLL_INTERVAL)


def egress_config(settings: WorkerSettings) -> EgressConfig | None:
    if not settings.network:
        return None
    return EgressConfig(
        deny=settings.egress_deny,
        permit=settings.egress_permit,
        resolver=settings.egress_resolver,
        subnet=settings.sandbox_subnet,
    )


def make_runtime(settings: WorkerSettings, state_dir: Path, agent_dir: Path) -> Runtime:
    scope = runtime_scope(settings.name, state_dir)
    if settings.runtime == "bwrap":
        from sandgate.worker.runtime.bwrap import BwrapRuntime

        return BwrapRuntime(
            state_dir,
            agent_dir,
            worker_name=scope,
            egress=egress_config(settings),
            fd_share=settings.fd_share,
            direct_files=settings.direct_files,
            favor_dynmods=settings.cgroup_favordynmods,
            workspaces=WorkspaceHost(
                # by default shared by the workers started with the same --state-dir
                (settings.workspace_root or settings.state_dir / "workspaces").absolute(),
                state_dir / "workspace-mounts",
                faults=settings.faults,
            ),
        )
    if settings.runtime == "process":
        from sandgate.worker.runtime.process import ProcessRuntime

        log.warning(
            "runtime.unisolated: the process runtime gives NO isolation; development only",
            extra={"worker": settings.name},
        )
        return ProcessRuntime(state_dir, agent_dir, worker_name=scope)
    raise ValueError(f"unknown runtime {settings.runtime!r}; use bwrap or process")


def seal_inherited_descriptors() -> None:
    """Make every descriptor we inherited close on exec.

    Not every spawn closes what it does not pass (`close_fds`: an `exec` in a sandbox's
    chain, a library's helper); what we open ourselves is already close-on-exec (PEP 446),
    so this leaves nothing of the worker's to leak into a sandbox.
    """
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # closed meanwhile (the listing's own descriptor)


PARENT_PID_ENV = "SANDGATE_PARENT_PID"  # set by `sandgate up`: stop when that process dies
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def raise_file_limit() -> None:
    """Lift the worker's own RLIMIT_NOFILE to its hard limit: its egress gate holds six
    descriptors per sandbox connection (two sockets, two pipes), so the usual soft 1024
    would cut the sandboxes off long before their own limits do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def die_with_parent() -> None:
    """Under `sandgate up` (`$SANDGATE_PARENT_PID`): get SIGTERM when it dies, even by SIGKILL.

    SIGTERM makes the worker remove every sandbox it started. The parent may have died before
    the request took effect, so its pid is checked once it has.
    """
    expected = os.environ.get(PARENT_PID_ENV)
    if not expected or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("worker.pdeathsig_failed", extra={"errno": ctypes.get_errno()})
    if os.getppid() != int(expected):
        raise SystemExit(f"the process that started this worker (pid {expected}) is gone")


async def run_worker(settings: WorkerSettings) -> None:
    die_with_parent()
    seal_inherited_descriptors()
    raise_file_limit()
    state_dir = settings.state_dir / settings.name
    state_dir.mkdir(parents=True, exist_ok=True)
    for directory in (settings.state_dir, state_dir):
        os.chmod(directory, 0o711)  # sandbox uids must traverse to their workspace
    lock_fd = lock_state_dir(state_dir)  # noqa: F841 - held open until the process exits
    agent_dir = state_dir / "agent"
    install_agent(agent_dir)
    runtime = make_runtime(settings, state_dir, agent_dir)
    await runtime.prepare()
    features = runtime.features()
    features["enforces"] = budget.measure(
        state_dir,
        memory_overcommit=settings.memory_overcommit,
        disk_overcommit=settings.disk_overcommit,
        disk_quota=bool(features.get("disk_quota")),
        fd_share=settings.fd_share,
    )
    log.info("worker.ready", extra={"worker": settings.name, "features": features})
    for fault in sorted(settings.faults):
        log.critical("fault.active", extra={"fault": fault, "does": FAULTS[fault]})
    service, client = assemble(settings, runtime, features)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_until_stopped(service.run(client.run), stop, lambda: service.shutting_down)
    log.info("worker.stopped", extra={"worker": settings.name})


STOP_RECANCEL = 1.0  # a stop not yet taken up is asked again this often


async def run_until_stopped(
    work: Coroutine[Any, Any, None], stop: asyncio.Event, tearing_down: Callable[[], bool]
) -> None:
    """Run `work` until it ends or `stop` is set; then cancel it until its teardown has
    begun (`tearing_down()`), and wait for the teardown to finish.

    Cancelling once is not enough: Python 3.11's `asyncio.wait_for` can swallow a
    cancellation that lands as its inner await completes (gh-86296), and a worker whose one
    cancel was swallowed would keep running after SIGTERM. Once the teardown runs, signals
    are left alone: more of them must not cut it short (the parent-death signal comes again
    each time the worker passes to another thread of a dying multi-threaded parent).
    """
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        while not task.done():
            if not tearing_down():
                task.cancel()
            await asyncio.wait({task}, timeout=STOP_RECANCEL)
    finally:
        waiter.cancel()
    failure = None if task.cancelled() else task.exception()
    if failure is not None:
        raise failure


def assemble(
    settings: WorkerSettings, runtime: Runtime, features: dict[str, Any]
) -> tuple[WorkerService, TunnelClient]:
    """The worker's service and the tunnel client that serves it (not dialed yet): what
    `run_worker` runs, and what fast tests wire to a server in-process."""
    service = WorkerService(
        runtime,
        capacity=settings.capacity,
        state=WorkerLocalState(),
        enforces=features.get("enforces"),
        faults=settings.faults,
        pools=settings.pools,
    )
    if service.layers is not None:
        service.layers.prepare()
    # the control plane places by what is left beside the warm pools (worker/pool.py)
    reported = dict(features)
    if settings.pools and isinstance(features.get("enforces"), dict):
        reported["enforces"] = pool.reported_enforces(features["enforces"], settings.pools)
    reported["pools"] = dict(settings.pools)

    def hello() -> dict[str, Any]:
        return {
            "name": settings.name,
            "capacity": settings.capacity - pool.reserved(settings.pools),
            "features": reported,
            "sandboxes": sorted(service.state.sandboxes),
            # still being destroyed: not running, not forgotten either
            "tearing_down": sorted(service.state.tearing_down),
        }

    async def on_welcome(welcome: Header) -> None:
        for name in welcome.get("remove") or []:
            log.warning("sandbox.unknown_to_control_plane", extra={"sandbox": name})
            await service.destroy(str(name))

    def on_channel(channel: RpcChannel | None) -> None:
        if channel is None:
            service.notify = None
            service.fetch_chunk = None
            service.fetch_template = None
            return

        async def notify(event: str, fields: dict[str, Any]) -> None:
            await channel.event(event, **fields)

        async def fetch_chunk(digest: str, offset: int) -> bytes:
            _, chunk = await channel.request("blob", {"digest": digest, "offset": offset})
            return chunk

        async def fetch_template(name: str) -> dict[str, Any] | None:
            reply, _ = await channel.request("template", {"name": name})
            image = reply.get("image")
            return image if isinstance(image, dict) else None

        service.notify = notify
        service.fetch_chunk = fetch_chunk
        service.fetch_template = fetch_template

    client = TunnelClient(
        settings.server_url,
        settings.token,
        hello=hello,
        handler=service.handle,
        on_welcome=on_welcome,
        on_channel=on_channel,
        heartbeat_interval=settings.heartbeat_interval,
        reconnect_min=settings.reconnect_min,
        reconnect_max=settings.reconnect_max,
    )
    return service, client
