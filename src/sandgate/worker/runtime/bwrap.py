"""The production runtime: bubblewrap, one unprivileged host uid per sandbox.

Per sandbox (see docs/decisions/0001-bwrap-runtime.md for why):

* a host uid leased exclusively from ``[uid_base, uid_base + uid_count)`` (`uids.py`); the
  workspace directory is owned by it, mode 0700;
* cgroups ``sandgate/<worker>/<sandbox>`` with memory, pids and cpu limits (`cgroups.py`),
  joined by a tiny ``sh`` before anything else runs;
* ``setpriv`` drops to the leased uid/gid, clears groups, capabilities and sets
  no_new_privs, then execs ``bwrap`` which builds a user namespace (uid 1000 inside, nested
  user namespaces disabled), pid/ipc/uts/cgroup namespaces, a read-only tmpfs root with the host's
  /usr and a generated minimal /etc, a writable /workspace and /tmp, and a seccomp filter
  (`seccomp.py`).

* a file system of its own (`disk.py`): an ext4 image of `disk_mb` on a loop device holds
  /workspace and /tmp, so the kernel enforces the quota and the inode cap; where loop
  devices are missing, features() says ``disk_quota: false`` and /tmp is a tmpfs;
* ``RLIMIT_NOFILE`` per process so the sandbox holds at most `fd_share` of the host's file
  table (`fds.py`).
* a network namespace the worker made (`netns.py`), entered before the uid drop: loopback
  only while its network is off, else one link whose only exit is the worker's egress gate
  (`egress.py`). Where the host cannot (not root, no nftables), bwrap's own empty namespace
  and no network at all.

Host preparation (tools, uid range, state directories, leftovers, cgroups, /etc, seccomp
filter, disk and file-table probes) is in `bwrap_host.py`; this module starts and stops one
sandbox.

Process chain: worker's spawner thread (`spawner.py`: a descriptor table of its own, so a
start copies none of the sandboxes' descriptors) -> nsenter (joins the network namespace)
-exec-> unshare (a mount namespace of its own) -exec-> sh (`root_step.py`: joins the
cgroups, sets the descriptor limit, moves the detached disk in, see `disk.py`) -exec->
setpriv -exec-> bwrap
(outer, the `process` returned) -> the agent, as the sandbox's pid 1 (``--as-pid-1``: it
reaps the orphans itself, agent/orphans.py); a probe ``argv`` runs under bwrap's own pid-1
reaper instead.

The chain starts in ``/`` with an empty environment: bwrap's pid-1 reaper keeps the
environment and cwd it was started with (``--clearenv`` and ``--chdir`` apply only to the
command), and a sandbox reads it in ``/proc/1/environ``. None of the chain needs a variable
(every program is an absolute path; bwrap looks the command up in the sandbox's ``PATH``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandgate.agent import MODULES as AGENT_MODULES
from sandgate.agent import deployed_name, entries
from sandgate.core.egress_policy import NetworkPolicy
from sandgate.errors import InvalidRequestError, NetworkUnavailableError, WorkerError
from sandgate.worker import (
    cgroups,
    disk,
    disk_files,
    dynmods,
    fds,
    idmap,
    loopmount,
    netns,
    rootfs,
    seccomp,
    spawner,
)
from sandgate.worker.cgroups import CgroupHost, SandboxCgroups
from sandgate.worker.cleanup import remove_tree
from sandgate.worker.disk_files import DiskFiles
from sandgate.worker.egress import EgressConfig, EgressGate
from sandgate.worker.layers import layer_name
from sandgate.worker.pipes import PIPE_LIMIT, widen_pipes
from sandgate.worker.root_step import root_step_argv
from sandgate.worker.runtime import bwrap_host
from sandgate.worker.runtime.base import ImageSpec, RunningSandbox, SandboxSpec
from sandgate.worker.runtime.bwrap_host import SANDBOX_UID, untraversable
from sandgate.worker.uids import UidLease, UidPool
from sandgate.worker.workspaces import WorkspaceHost

log = logging.getLogger(__name__)

AGENT_MOUNT = "/opt/sandgate"
# a template sandbox's agent runs on the host's Python, bound here read-only and started by
# the host's own loader (the image may have another libc, or no Python at all)
HOST_USR_MOUNT = "/opt/sandgate-host/usr"
# what bwrap mounts in a template sandbox's root (besides its WorkingDir and /etc files)
IMAGE_MOUNT_DIRS = ("/dev", "/proc", "/tmp", "/workspace", AGENT_MOUNT, HOST_USR_MOUNT)
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEFAULT_UID_LOCK_DIR = Path("/run/sandgate/uids")
# the descriptors bwrap reads its seccomp filter and its options from, in the chain
SECCOMP_CHILD_FD = 3
ARGS_CHILD_FD = 4


def agent_argv() -> list[str]:
    """The command that runs the agent inside a bwrap sandbox."""
    return [
        "/usr/bin/python3",
        "-I",
        "-S",
        f"{AGENT_MOUNT}/agent.py",
        "--workspace",
        "/workspace",
        "--tmp",
        "/tmp",
    ]


def workspace_roots(spec: SandboxSpec) -> list[str]:
    """The agent's `--mount` arguments: each workspace mounted outside /workspace."""
    return [
        arg
        for mount in spec.workspaces
        if not (mount.path + "/").startswith("/workspace/")
        for arg in ("--mount", mount.path)
    ]


def image_agent_argv(
    loader: str,
    library_dir: str,
    python: str,
    *,
    cwd: str,
    child_env: list[tuple[str, str]] | None = None,
) -> list[str]:
    """The agent of a template sandbox: host paths given under HOST_USR_MOUNT's view; the
    whole copy-on-write root is the sandbox's own, and commands start in `cwd`."""

    def inside(path: str) -> str:
        return HOST_USR_MOUNT + path.removeprefix("/usr")

    return [
        inside(loader),
        "--library-path",
        inside(library_dir),
        inside(python),
        *agent_argv()[1:],
        "--root",
        "/",
        "--cwd",
        cwd,
        "--loader",
        inside(loader),
        "--library-path",
        inside(library_dir),
        *(arg for key, value in child_env or () for arg in ("--env", f"{key}={value}")),
    ]


def image_workdir(image: ImageSpec) -> str:
    """Where a template sandbox's commands start: its WorkingDir, else /workspace."""
    workdir = image.workdir
    if not workdir:
        return "/workspace"
    if not workdir.startswith("/") or "\0" in workdir or "/../" in f"{workdir}/":
        raise InvalidRequestError(f"the template's WorkingDir {workdir!r} is not an absolute path")
    return workdir


def check_image_user(image: ImageSpec) -> None:
    """Refuse a template user that can be no uid inside (a name is looked up at start)."""
    user = image.user.partition(":")[0]
    if user.isdigit() and int(user) >= 65534:
        raise InvalidRequestError(f"the template's user {image.user!r} is not a uid below 65534")
    if not user.replace("-", "").replace("_", "").replace(".", "").isalnum() and user:
        raise InvalidRequestError(f"the template's user {image.user!r} is not a name or a uid")


def agent_env(image: ImageSpec) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The image's environment split in two: what the agent runs with, and the LD_*
    variables, which only the commands it starts get (the agent runs on the host's loader
    and libraries: an image's LD_PRELOAD is for its own libc)."""
    own = [(k, v) for k, v in image.env if not k.startswith("LD_")]
    children = [(k, v) for k, v in image.env if k.startswith("LD_")]
    return own, children


def check_spec(spec: SandboxSpec) -> None:
    """Refuse a sandbox name or environment that could escape its paths or break argv."""
    if not NAME_RE.fullmatch(spec.name):
        raise InvalidRequestError(
            f"invalid sandbox name {spec.name!r}: use 1-63 of [a-z0-9-], not starting with '-'"
        )
    image_env = spec.image.env if spec.image is not None else ()
    for key, value in (*spec.env.items(), *image_env):
        if not ENV_NAME_RE.fullmatch(key):
            raise InvalidRequestError(f"invalid environment variable name {key!r}")
        if "\0" in value:
            raise InvalidRequestError(f"environment variable {key} contains a NUL byte")
    if spec.memory_mb < 16 or spec.pids < 8 or spec.cpus <= 0 or spec.disk_mb < 16:
        raise InvalidRequestError(
            f"sandbox limits too small: memory_mb={spec.memory_mb} (>= 16), "
            f"pids={spec.pids} (>= 8), cpus={spec.cpus} (> 0), disk_mb={spec.disk_mb} (>= 16)"
        )


class BwrapRuntime:
    name = "bwrap"

    def __init__(
        self,
        state_dir: Path,
        agent_dir: Path,
        *,
        worker_name: str,
        uid_base: int = 200000,
        uid_count: int = 10000,
        egress: EgressConfig | None = None,
        uid_lock_dir: Path | None = None,
        fd_share: float = fds.DEFAULT_FD_SHARE,
        workspaces: WorkspaceHost | None = None,
        direct_files: bool = True,
        favor_dynmods: bool = True,
        cpu_pressure: str | None = None,
    ) -> None:
        """`uid_lock_dir` must be shared by every worker on the host that uses an overlapping
        uid range; the default is host-wide (/run/sandgate/uids), not per state_dir.
        `direct_files`: whole files on a sandbox's own disk are written and read by the
        worker itself where the host allows (`disk_files.py`), else all through the agent.
        `favor_dynmods`: the host's cgroup2 option favordynmods is turned on at prepare
        (`dynmods.py`), so that a start's move into its cgroups does not wait.
        `cpu_pressure`: the agents' ``--cpu-pressure`` (agent/pressure.py): the file, as a
        path inside the sandbox, where the host's CPU pressure is read, or ``"off"``: never,
        so the shell started ahead of the next command (agent/warm.py) is started whatever
        the load; None: the agent's default, /proc/pressure/cpu."""
        if not NAME_RE.fullmatch(worker_name):
            raise ValueError(f"invalid worker name {worker_name!r}: use [a-z0-9-], 1-63 chars")
        if cpu_pressure == "":
            raise ValueError("cpu_pressure: a path inside the sandbox, 'off' or None")
        self.state_dir = Path(state_dir).absolute()
        self.agent_dir = Path(agent_dir).absolute()
        self.worker_name = worker_name
        # None: sandboxes never get a network; else the gate is set up at prepare if it can
        self.egress = egress
        self.net: netns.NetHost | None = None
        self.gate: EgressGate | None = None
        self._network_problem = "the runtime is not prepared"
        self._network_changes = asyncio.Lock()  # one set_network at a time: links, slots
        self._direct_files = direct_files
        self._cpu_pressure = () if cpu_pressure is None else ("--cpu-pressure", cpu_pressure)
        self._favor_dynmods = favor_dynmods
        self._file_threads: disk_files.FileThreads | None = None  # set at prepare if it can
        self._spawner: spawner.Spawner | None = None  # set at prepare
        self.uids = UidPool(uid_lock_dir or DEFAULT_UID_LOCK_DIR, uid_base, uid_count)
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.etc_dir = self.state_dir / "etc"
        self.seccomp_path = self.state_dir / "seccomp.bpf"
        self._prepared = False
        self._bwrap = "/usr/bin/bwrap"
        self._setpriv = "/usr/bin/setpriv"
        self._nsenter = "/usr/bin/nsenter"
        self._unshare = "/usr/bin/unshare"
        self._cg_host: CgroupHost | None = None
        self._limits: dict[str, bool] = {c: False for c in cgroups.LIMIT_CONTROLLERS}
        self._cgroup_kill = False
        self._memsw = False
        self._root_args: list[str] = []
        self._etc_args: list[str] = []
        self._agent_checked = False
        self._disk_problem: str | None = "the runtime is not prepared"
        self.layer_store = self.state_dir / "layers"  # images.LayerCache keeps it
        self.blank_disks = self.state_dir / "blank-disks"  # disk.copy_blank's, one per size
        self._host_python: tuple[str, str, str] | None = None  # loader, its dir, python
        self._images_problem: str | None = "the runtime is not prepared"
        self.fd_share = fd_share
        self.workspaces = workspaces  # persistent workspaces (workspaces.py); None: none here
        self._file_limits = (0, 0)  # the host's fs.file-max and fs.nr_open

    # ------------------------------------------------------------------ features

    def features(self) -> dict[str, Any]:
        host = self._cg_host
        return {
            "runtime": "bwrap",
            "isolation": "bwrap",
            "prepared": self._prepared,
            "user_namespace": True,
            "uid": "per-sandbox",
            "seccomp": True,
            "no_new_privs": True,
            "capabilities": "none",
            "network": "gate" if self.gate is not None else "none",
            "readonly_root": True,
            "pid_namespace": True,
            "ipc_namespace": True,
            "uts_namespace": True,
            "nested_user_namespaces": False,
            "cgroup": host.mode if host is not None and self._prepared else "none",
            "cgroup_kill": self._cgroup_kill,
            "limits": dict(self._limits),
            "memory_limit_includes_swap": self._limits["memory"] and self._memsw,
            "disk_quota": self._disk_problem is None,
            "disk_quota_inodes_per_mb": disk.INODES_PER_MB if self._disk_problem is None else 0,
            "fd_share": self.fd_share,
            # template root file systems (rootfs.py): idmapped layers under an overlay
            "images": self._host_python is not None and self._images_problem is None,
            # persistent workspaces (workspaces.py): an image per workspace, idmapped binds
            "workspaces": self.workspaces is not None and self.workspaces.problem is None,
        }

    # ------------------------------------------------------------------ prepare

    async def prepare(self) -> None:
        """Check and set up this host before any start(); `bwrap_host` has each step."""
        self._bwrap, self._setpriv = bwrap_host.find_tools()
        await bwrap_host.check_bwrap_version(self._bwrap)
        bwrap_host.check_uid_range(self.uids)
        bwrap_host.make_state_dirs(self.state_dir, self.sandboxes_dir, self.uids)

        self._cg_host = CgroupHost.detect()
        await bwrap_host.remove_leftovers(self._cg_host, self.worker_name, self.sandboxes_dir)
        self._limits = self._cg_host.prepare(self.worker_name)
        if self._favor_dynmods:
            self._favor_cgroup_moves()
        self._cgroup_kill = self._cg_host.has_cgroup_kill(self.worker_name)
        self._memsw = self._cg_host.memory_includes_swap(self.worker_name)
        bwrap_host.warn_missing_limits(self._limits, self.worker_name)

        await self._prepare_network()
        resolver = self.net.resolver_address if self.net is not None else None
        try:
            self._etc_args = bwrap_host.write_etc(self.etc_dir, resolver=resolver)
            seccomp.write_filter(self.seccomp_path)
        except OSError as exc:
            raise WorkerError(f"cannot write the sandbox /etc or seccomp filter: {exc}") from exc
        self._root_args = bwrap_host.root_args(self._etc_args)
        self._host_python = bwrap_host.host_python()
        self._images_problem = await asyncio.to_thread(rootfs.probe, self.state_dir, self.uids.base)
        if self._images_problem is not None:
            log.warning(
                "runtime.images_unavailable worker=%s (%s): this worker starts only the "
                "built-in templates",
                self.worker_name,
                self._images_problem,
            )
        self._disk_problem = await bwrap_host.probe_disk(self.state_dir, self.worker_name)
        if self.workspaces is not None:
            await asyncio.to_thread(self.workspaces.prepare, disk_problem=self._disk_problem)
            self.workspaces.watch_lingering()
        self._file_limits = bwrap_host.file_limits()
        self._prepare_file_threads()
        if self._spawner is None:
            try:
                self._spawner = spawner.Spawner()
            except OSError as exc:
                raise WorkerError(f"cannot start the sandbox spawner thread: {exc}") from exc
        self._prepared = True
        log.info("runtime.prepared worker=%s features=%s", self.worker_name, self.features())

    def _favor_cgroup_moves(self) -> None:
        problem = dynmods.favor()
        if problem is not None:
            log.warning(
                "runtime.cgroup_moves_wait worker=%s (%s): each sandbox start may wait ~10 ms "
                "for the kernel to move it into its cgroups",
                self.worker_name,
                problem,
            )

    def _prepare_file_threads(self) -> None:
        if not self._direct_files or self._file_threads is not None:
            return
        threads = disk_files.FileThreads()
        problem = threads.check()
        if problem is not None:
            threads.close()
            log.warning(
                "runtime.direct_files_unavailable worker=%s (%s): the agent serves every file",
                self.worker_name,
                problem,
            )
            return
        self._file_threads = threads

    async def _prepare_network(self) -> None:
        """The egress gate and this worker's nftables table, where the host can have them."""
        if self.egress is None:
            self._network_problem = "the worker was started with --no-network"
            return
        problem = netns.available()
        if problem is not None:
            self._network_problem = problem
            log.warning(
                "runtime.network_unavailable worker=%s (%s): sandboxes get no network",
                self.worker_name,
                problem,
            )
            return
        config = self.egress
        self._nsenter = shutil.which("nsenter") or self._nsenter
        net = netns.NetHost(self.worker_name, subnet=config.subnet)
        gate = EgressGate(config)
        try:
            await gate.start()
        except OSError as exc:
            raise WorkerError(f"cannot start the egress gate: {exc}") from exc
        try:
            await net.prepare(gate_port=gate.gate_port, dns_port=gate.dns_port)
        except BaseException:
            await gate.close()
            raise
        self.net, self.gate = net, gate

    @property
    def switches_network(self) -> bool:
        """Whether a running sandbox's network can be turned on and off (`set_network`)."""
        return self.gate is not None

    async def set_network(self, sandbox: RunningSandbox, policy: NetworkPolicy) -> None:
        """Apply `policy` to a running sandbox: to its new connections and DNS queries at
        once; a link added or taken away when it turns the network on or off."""
        net: netns.SandboxNet | None = sandbox.private.get("net")
        if self.net is None or self.gate is None or net is None:
            if policy.enabled:
                raise NetworkUnavailableError(self._network_unavailable())
            return
        name = sandbox.spec.name
        async with self._network_changes:
            self.gate.add(name, policy)
            if policy.enabled and not net.connected:
                await self.net.connect(net)
                self.gate.link(name, net.sandbox_ip)
            elif not policy.enabled and net.connected:
                await self.gate.unlink(name)
                await self.net.disconnect(net)

    def network_state(self, sandbox: RunningSandbox) -> dict[str, Any]:
        """Its policy and the gate's counters for it (`egress.GatedSandbox.stats`)."""
        if self.gate is None:
            return {"network": False}
        return self.gate.stats(sandbox.spec.name)

    def _network_unavailable(self) -> str:
        return (
            f"this worker gives sandboxes no network ({self._network_problem}); sandboxes get "
            "a network through the worker's egress gate, which needs root, iproute2 and "
            "nftables (apt-get install -y iproute2 nftables)"
        )

    # ------------------------------------------------------------------ start

    async def start(self, spec: SandboxSpec, argv: list[str] | None = None) -> RunningSandbox:
        """Start `argv` (default: the agent) in a new sandbox; does not wait for readiness."""
        if not self._prepared or self._cg_host is None:
            raise WorkerError("BwrapRuntime.prepare() must run before start()")
        check_spec(spec)
        if spec.network.enabled and self.gate is None:
            raise NetworkUnavailableError(self._network_unavailable())
        if spec.image is not None:
            check_image_user(spec.image)  # refused before anything is made
            missing = [
                layer.digest
                for layer in spec.image.layers
                if not (self.layer_store / layer_name(layer.digest)).is_dir()
            ]
            if missing:
                raise WorkerError(f"the image's layers are not on this worker: {missing}")
        agent = argv is None  # the agent reaps orphans as pid 1 (agent/orphans.py); not others
        if argv is None:
            if spec.image is None:  # its files API reaches the workspaces mounted elsewhere too
                argv = [*agent_argv(), *workspace_roots(spec)]
            elif self._host_python is None:
                raise WorkerError("this host's Python cannot run the agent in a template sandbox")
            else:
                argv = image_agent_argv(
                    *self._host_python,
                    cwd=image_workdir(spec.image),
                    child_env=agent_env(spec.image)[1],
                )
            argv += self._cpu_pressure
            self._check_agent_dir()
        if not argv:
            raise InvalidRequestError("empty argv")

        lease: UidLease | None = None
        sandbox_dir = self.sandboxes_dir / spec.name
        dir_created = False
        cg: SandboxCgroups | None = None
        net: netns.SandboxNet | None = None
        bound = _BoundWorkspaces()
        made: disk.SandboxDisk | None = None
        log_fd = seccomp_fd = args_fd = -1
        try:
            if self.net is not None and self.gate is not None:
                net = await self.net.take(connected=spec.network.enabled)
                self.gate.add(spec.name, spec.network)
                if net.connected:
                    self.gate.link(spec.name, net.sandbox_ip)
            lease = self.uids.lease()
            uid = lease.uid
            try:
                sandbox_dir.mkdir(mode=0o711)
            except FileExistsError:
                raise WorkerError(f"sandbox {spec.name!r} already exists on this worker") from None
            dir_created = True
            os.chmod(sandbox_dir, 0o711)
            tmp: Path | None = None
            own_disk: Path | None = None
            if self._disk_problem is None:
                made = await asyncio.to_thread(
                    disk.create,
                    sandbox_dir,
                    disk_mb=spec.disk_mb,
                    uid=uid,
                    detached=spec.image is None,  # a template's overlay needs a path
                    blank_dir=self.blank_disks,
                )
                workspace, tmp, own_disk = made.workspace, made.tmp, made.mount_point
            else:
                workspace = sandbox_dir / "workspace"
                workspace.mkdir(mode=0o700)
                os.chown(workspace, uid, uid)
                os.chmod(workspace, 0o700)
            root: Path | None = None
            points: dict[str, str] = {}
            inner_uid = SANDBOX_UID
            binds = await self._bind_workspaces(spec, sandbox_dir, uid, bound)
            if spec.image is not None:
                names = [layer_name(layer.digest) for layer in spec.image.layers]
                mounting = asyncio.ensure_future(
                    asyncio.to_thread(
                        rootfs.mount_root,
                        sandbox_dir,
                        self.layer_store,
                        names,
                        upper_parent=own_disk or sandbox_dir,
                        host_uid=uid,
                    )
                )
                try:  # a cancelled start still waits for its mount, then undoes it
                    root = await asyncio.shield(mounting)
                except asyncio.CancelledError:
                    with contextlib.suppress(BaseException):
                        await mounting
                    raise
                inner_uid = await asyncio.to_thread(rootfs.lookup_user, root, spec.image.user, uid)
                points = await asyncio.to_thread(
                    rootfs.make_mount_points,
                    root,
                    uid,
                    dirs=[*IMAGE_MOUNT_DIRS, image_workdir(spec.image), *(p for p, _ in binds)],
                    files=self._image_files(),
                )
            log_path = sandbox_dir / "agent.log"
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            cg = cgroups.create_sandbox_cgroups(
                self._cg_host,
                self.worker_name,
                spec.name,
                limits=self._limits,
                memory_mb=spec.memory_mb,
                pids=spec.pids,
                cpus=spec.cpus,
            )
            seccomp_fd = seccomp.open_filter(self.seccomp_path)
            args = self._bwrap_args(
                spec,
                workspace,
                tmp,
                SECCOMP_CHILD_FD,
                root,
                points,
                inner_uid,
                binds=binds,
                as_pid_1=agent,
            )
            args_fd = _memfd_with(b"".join(a.encode() + b"\0" for a in args))
            cmd = self._command(
                uid,
                ARGS_CHILD_FD,
                argv,
                nofile=self.nofile_for(spec),
                procs_files=cg.procs_files,
                net=net,
                own_disk=made if made is not None and made.detached else None,
            )
            assert self._spawner is not None  # prepared
            # in /, with no environment (pid 1's /proc/1/environ: nothing of the host, see the
            # docstring), in a session of its own (the worker's terminal signals must not
            # reach it), from a thread whose descriptor table holds none of the sandboxes'
            process = await spawner.start(
                self._spawner,
                cmd,
                stderr=log_fd,
                pass_fds={SECCOMP_CHILD_FD: seccomp_fd, ARGS_CHILD_FD: args_fd},
                limit=PIPE_LIMIT,
            )
            widen_pipes(process)
        except BaseException as exc:
            if cg is not None:
                await cg.kill_all(wait_s=2.0)
                await cg.remove()
            await self._unbind_workspaces(bound)
            if made is not None:
                disk.release(made)
            if dir_created and not bound.targets:
                await asyncio.to_thread(_remove_sandbox_dir, sandbox_dir)
            if lease is not None:
                lease.release()
            await self._remove_net(spec.name, net)
            if isinstance(exc, InvalidRequestError | WorkerError) or not isinstance(exc, Exception):
                raise
            raise WorkerError(f"cannot start sandbox {spec.name!r}: {exc}") from exc
        finally:
            for fd in (log_fd, seccomp_fd, args_fd):
                if fd >= 0:
                    os.close(fd)
        return RunningSandbox(
            spec=spec,
            process=process,
            # the worker's way in (a detached disk's is through its descriptor)
            workspace=workspace if made is None else made.root / "workspace",
            private={
                "uid": uid,
                "lease": lease,
                "cgroups": cg,
                "sandbox_dir": sandbox_dir,
                "log_path": log_path,
                "stopped": False,
                "net": net,
                "workspaces": bound,
                "disk": made,
            },
            cgroup_dirs=tuple(cg.dirs),
            oom_counter=cg.oom_counter,
            disk=None if made is None else made.root,
            scratch=() if own_disk is not None else (workspace,),  # /tmp: a tmpfs, in memory
            upper=None if root is None else (own_disk or sandbox_dir) / rootfs.UPPER_NAME,
            files=self._disk_files(spec, made, uid),
        )

    def _disk_files(
        self, spec: SandboxSpec, made: disk.SandboxDisk | None, uid: int
    ) -> DiskFiles | None:
        """The worker's own way to the sandbox's files, where its /workspace and /tmp are
        its own disk's directories exactly as the worker sees them (disk_files.py)."""
        if self._file_threads is None or made is None or not made.detached:
            return None
        if spec.workspaces or spec.image is not None:
            return None
        return DiskFiles(made.mount_fd, uid, uid, self._file_threads)

    async def _bind_workspaces(
        self, spec: SandboxSpec, sandbox_dir: Path, uid: int, bound: _BoundWorkspaces
    ) -> list[tuple[str, Path]]:
        """Each of the spec's workspaces mounted (for its recorded owner only) and bound at
        `<sandbox>/ws<i>`, seen by the sandbox's uid as its own: (mount path, that bind)."""
        if not spec.workspaces:
            return []
        host = self.workspaces
        if host is None or host.problem is not None:
            why = "none configured" if host is None else host.problem
            raise WorkerError(f"this worker cannot mount workspaces ({why})")
        binds: list[tuple[str, Path]] = []
        for i, mount in enumerate(spec.workspaces):
            files = await host.attach(mount.id, mount.owner)
            bound.attached.append(mount.id)
            target = sandbox_dir / f"ws{i}"
            target.mkdir(mode=0o700)
            await asyncio.to_thread(host.bind, files, target, uid)
            bound.targets.append(target)
            binds.append((mount.path, target))
        return binds

    async def _unbind_workspaces(self, bound: _BoundWorkspaces) -> None:
        """Undo `_bind_workspaces` once the sandbox's processes are gone; the targets left
        bound (a failure) keep the sandbox's directory from being removed through them."""
        while bound.targets:
            await asyncio.to_thread(idmap.unbind, bound.targets[-1])
            bound.targets.pop()
        while bound.attached and self.workspaces is not None:
            await self.workspaces.release(bound.attached.pop())

    def _image_files(self) -> list[str]:
        """The files of the generated /etc a template sandbox gets (its name lookups)."""
        # resolv.conf is written only where sandboxes can have a network (write_etc)
        names = ("hosts", "resolv.conf")
        return [f"/etc/{name}" for name in names if (self.etc_dir / name).exists()]

    def _check_agent_dir(self) -> None:
        if self._agent_checked:
            return
        agent = self.agent_dir / "agent.py"
        blocked = untraversable(self.agent_dir)
        if blocked is not None:
            raise WorkerError(f"agent dir: {blocked} is missing or not traversable (o+x)")
        modules = [self.agent_dir / deployed_name(module) for module in AGENT_MODULES]
        for f in (agent, *modules):
            try:
                mode = os.stat(f).st_mode
            except OSError as exc:
                raise WorkerError(f"agent file missing: {exc}") from exc
            if not mode & stat.S_IROTH:
                raise WorkerError(f"{f} must be world-readable (it is read by the sandbox uid)")
        self._agent_checked = True

    def nofile_for(self, spec: SandboxSpec) -> int:
        """RLIMIT_NOFILE of each of the sandbox's processes (`fds` has the rule)."""
        file_max, nr_open = self._file_limits
        return fds.nofile_for(spec.pids, share=self.fd_share, file_max=file_max, nr_open=nr_open)

    def _command(
        self,
        uid: int,
        args_fd: int,
        argv: list[str],
        *,
        nofile: int,
        procs_files: list[Path],
        net: netns.SandboxNet | None = None,
        own_disk: disk.SandboxDisk | None = None,
    ) -> list[str]:
        """With `net`, nsenter first puts the chain in the sandbox's network namespace (as
        root: the sandbox's own user namespace, made by bwrap below, then holds no capability
        over it). With a detached `own_disk`, the chain then gets a mount namespace of its
        own, private, for the disk to be moved into: bwrap's set-up copies that table, which
        does not grow with the sandboxes held. The root step (`root_step.py`) joins the
        cgroups of `procs_files`, sets the descriptor limit (soft and hard: the sandbox cannot
        raise it) and moves the disk in; setpriv drops to the sandbox uid, then execs bwrap,
        which reads its options from `args_fd` (so neither host `ps` nor the sandbox's
        /proc/1/cmdline shows host paths or the sandbox's environment; only `argv` is
        visible)."""
        enter = [] if net is None else [self._nsenter, f"--net={net.path}", "--"]
        move: tuple[Path, Path] | None = None
        if own_disk is not None:
            enter += [self._unshare, "--mount", "--propagation", "private", "--"]
            move = (loopmount.fd_path(own_disk.mount_fd), own_disk.mount_point)
        drop = [
            self._setpriv,
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            self._bwrap,
            "--args",
            str(args_fd),
            "--",
            *argv,
        ]
        return [*enter, *root_step_argv(procs_files, nofile, move, drop)]

    def _bwrap_args(
        self,
        spec: SandboxSpec,
        workspace: Path,
        tmp: Path | None,
        seccomp_fd: int,
        root: Path | None = None,
        points: dict[str, str] | None = None,
        inner_uid: int = SANDBOX_UID,
        *,
        binds: list[tuple[str, Path]] | None = None,
        as_pid_1: bool = False,
    ) -> list[str]:
        """bwrap's options (not the command: bwrap takes that from its real argv only).

        `as_pid_1`: the command is the sandbox's pid 1, with no init of bwrap's beside it
        (the agent, which reaps orphans itself: one process fewer per sandbox, and one task
        fewer for every sandbox start's `pivot_root` to walk on the host).

        `root`: a template sandbox's overlay root (`rootfs.py`), writable, instead of the
        read-only tmpfs root with the host's /usr; `points`: where its mount points resolve
        in it (`rootfs.make_mount_points`: bwrap is given no path through an image's link)."""
        at = dict(points or {})

        def where(path: str) -> str:
            return at.get(path, path)

        cmd = [
            "--unshare-user",
            "--uid",
            str(inner_uid),
            "--gid",
            str(inner_uid),
            "--unshare-pid",
            *(["--as-pid-1"] if as_pid_1 else []),
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
        ]
        if self.net is None:  # no namespace of the worker's: bwrap's own, loopback only
            cmd.append("--unshare-net")
        if root is None:
            cmd += self._root_args
        else:
            cmd += ["--bind", str(root), "/", "--dev", where("/dev"), "--proc", where("/proc")]
            for name in self._image_files():
                cmd += ["--ro-bind", str(self.etc_dir / name.removeprefix("/etc/")), where(name)]
        if tmp is not None:
            cmd += ["--bind", str(tmp), where("/tmp")]
        else:  # no disk quota here: a tmpfs, bounded by the sandbox's memory limit
            size = min(spec.memory_mb, spec.disk_mb) << 20
            cmd += ["--size", str(size), "--tmpfs", where("/tmp")]
        mounted = dict(binds or ())  # mount path -> host path (workspaces.py, idmapped)
        cmd += ["--bind", str(mounted.pop("/workspace", workspace)), where("/workspace")]
        for path, source in sorted(mounted.items()):
            cmd += ["--bind", str(source), where(path)]
        if root is None:
            cmd += ["--dir", "/opt"]
        cmd += ["--ro-bind", str(self.agent_dir), where(AGENT_MOUNT)]
        if root is None:
            cmd += ["--remount-ro", "/"]
        else:
            cmd += ["--ro-bind", "/usr", where(HOST_USR_MOUNT)]
        cmd += [
            "--chdir",
            where("/workspace"),
            "--hostname",
            spec.name,
            "--die-with-parent",
            "--new-session",
            "--seccomp",
            str(seccomp_fd),
            "--clearenv",
            "--setenv",
            "PATH",
            SANDBOX_PATH,
            "--setenv",
            "HOME",
            "/workspace",
            "--setenv",
            "LANG",
            "C.UTF-8",
        ]
        for key, value in agent_env(spec.image)[0] if spec.image is not None else ():
            cmd += ["--setenv", key, value]  # the image's own (its PATH, ...), below the spec's
        for key, value in spec.env.items():
            cmd += ["--setenv", key, value]
        return cmd

    # ------------------------------------------------------------------ stop

    async def _remove_net(self, name: str, net: netns.SandboxNet | None) -> None:
        if self.gate is not None:
            self.gate.remove(name)
        if net is not None and self.net is not None:
            await self.net.remove(net)

    async def close(self) -> None:
        if self._spawner is not None:  # what it started still running dies with its thread
            self._spawner.close()
            self._spawner = None
        if self._file_threads is not None:
            self._file_threads.close()
            self._file_threads = None
        if self.gate is not None:
            await self.gate.close()
        if self.net is not None:
            await self.net.close()
        if self._cg_host is not None:
            cgroups.remove_worker_groups(self._cg_host, self.worker_name)

    async def stop(self, sandbox: RunningSandbox) -> None:
        private = sandbox.private
        if private.get("stopped"):
            return
        if sandbox.files is not None:
            sandbox.files.close()  # before its disk is released
        problems: list[str] = []
        cg: SandboxCgroups | None = private.get("cgroups")
        process = sandbox.process
        all_dead = True
        if cg is not None:
            all_dead = await cg.kill_all(wait_s=5.0)
            if not all_dead:
                problems.append("processes survived SIGKILL for 5 s")
        if process.returncode is None:
            try:
                process.kill()
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(process.wait(), 5.0)
            except TimeoutError:
                problems.append(f"bwrap (pid {process.pid}) did not exit")
                all_dead = False
        if process.stdin is not None:
            process.stdin.close()
        if cg is not None:
            left = await cg.remove()
            if left:
                problems.append(f"cgroups not removed: {', '.join(map(str, left))}")
        bound: _BoundWorkspaces | None = private.get("workspaces")
        if bound is not None and all_dead:
            try:
                await self._unbind_workspaces(bound)
            except WorkerError as exc:
                problems.append(exc.message)
        made: disk.SandboxDisk | None = private.get("disk")
        if made is not None and all_dead:
            disk.release(made)  # its processes gone: the disk ends with this fd
            private["disk"] = None
        sandbox_dir: Path | None = private.get("sandbox_dir")
        if sandbox_dir is not None and (bound is None or not bound.targets):
            try:
                await asyncio.to_thread(_remove_sandbox_dir, sandbox_dir)
            except (OSError, WorkerError) as exc:
                problems.append(f"cannot remove {sandbox_dir}: {getattr(exc, 'message', exc)}")
        if all_dead:
            try:
                await self._remove_net(sandbox.spec.name, private.get("net"))
                private["net"] = None
            except WorkerError as exc:
                problems.append(exc.message)
        lease: UidLease | None = private.get("lease")
        if lease is not None and all_dead:
            # never hand the uid to a new sandbox while an old process might still run as it
            lease.release()
        private["stopped"] = not problems
        if problems:
            raise WorkerError(f"stopping sandbox {sandbox.spec.name!r}: {'; '.join(problems)}")


@dataclass
class _BoundWorkspaces:
    attached: list[str] = field(default_factory=list)  # workspace ids attached (to release)
    targets: list[Path] = field(default_factory=list)  # their binds in the sandbox's dir


def _memfd_with(data: bytes) -> int:
    fd = os.memfd_create("sandgate-bwrap-args", os.MFD_CLOEXEC)
    try:
        entries.write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_sandbox_dir(sandbox_dir: Path) -> None:
    rootfs.unmount_root(sandbox_dir)  # its upper layer is on the sandbox's file system
    disk.remove(sandbox_dir)  # unmounted first: rm stays on one file system
    remove_tree(sandbox_dir)
