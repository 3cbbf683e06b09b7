"""Per-sandbox cgroups: resource limits and a reliable way to kill everything in a sandbox.

Layout: ``<base>/sandgate/<worker_name>/<sandbox>`` in every hierarchy we use, where
``<base>`` is the worker's own cgroup in that hierarchy (so a supervisor's limits on the worker
still cover its sandboxes, and a systemd unit with ``Delegate=yes`` works).

Controllers are taken from cgroup v1 when a v1 hierarchy has them (memory, pids, cpu), else
from the cgroup v2 (unified) hierarchy when its ``cgroup.controllers`` lists them. A v2
group is created whenever a unified hierarchy is mounted, even without controllers, for
``cgroup.kill``. What was actually applied is reported, never assumed.

Processes join by writing their own pid into each group's ``cgroup.procs`` before they exec
the sandbox (see ``join_script``), so every descendant is born inside the groups.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sandgate.errors import WorkerError

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
LIMIT_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
TOP = "sandgate"


def unescape_mountinfo(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1 : i + 4].isdigit():
            out.append(chr(int(path[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/<pid>/mountinfo, the fields sandgate reads."""

    root: str  # the directory of the file system mounted here
    mount_point: Path
    fstype: str
    super_options: tuple[str, ...]


def mount_entries(mountinfo: str) -> Iterator[MountEntry]:
    """The well-formed lines of a mountinfo text (proc(5)), in order."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if not sep or len(fields) < 5 or len(rfields) < 3:
            continue
        yield MountEntry(
            unescape_mountinfo(fields[3]),
            Path(unescape_mountinfo(fields[4])),
            rfields[0],
            tuple(rfields[2].split(",")),
        )


def _below(mount_point: Path, mount_root: str, own: str) -> Path:
    """The directory of cgroup `own` (a /proc/self/cgroup path) in a hierarchy mounted at
    `mount_point` whose root is `mount_root`; the mount point when `own` is not below it."""
    root = mount_root.rstrip("/")
    if own == root or own.startswith(root + "/"):
        rel = own[len(root) :].strip("/")
        return mount_point / rel if rel else mount_point
    return mount_point


def _read(path: Path) -> str:
    with open(path) as f:
        return f.read()


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CgroupHost:
    """What the host offers, detected once at worker start."""

    v1: dict[str, Path]  # controller -> the worker's own group dir in that v1 hierarchy
    unified: Path | None  # the worker's own group dir in the v2 hierarchy
    v2_controllers: frozenset[str]  # limit controllers usable from the v2 hierarchy
    memsw: bool  # v1 memory.memsw.* present (limit includes swap)

    @classmethod
    def detect(cls) -> CgroupHost:
        own: dict[str, str] = {}
        try:
            for line in _read(Path("/proc/self/cgroup")).splitlines():
                hid, ctrls, path = line.split(":", 2)
                if hid == "0" and ctrls == "":
                    own[""] = path
                for c in ctrls.split(","):
                    if c:
                        own[c] = path
        except OSError:
            pass
        v1: dict[str, Path] = {}
        unified: Path | None = None
        try:
            mountinfo = _read(Path("/proc/self/mountinfo"))
        except OSError:
            mountinfo = ""
        for entry in mount_entries(mountinfo):
            if entry.fstype == "cgroup":
                for ctrl in LIMIT_CONTROLLERS:
                    if ctrl in entry.super_options and ctrl not in v1:
                        v1[ctrl] = _below(entry.mount_point, entry.root, own.get(ctrl, "/"))
            elif entry.fstype == "cgroup2" and unified is None:
                unified = _below(entry.mount_point, entry.root, own.get("", "/"))
        v2_controllers: set[str] = set()
        if unified is not None:
            try:
                available = set(_read(unified / "cgroup.controllers").split())
            except OSError:
                available = set()
            v2_controllers = {c for c in LIMIT_CONTROLLERS if c in available and c not in v1}
        memsw = "memory" in v1 and (v1["memory"] / "memory.memsw.limit_in_bytes").exists()
        return cls(v1, unified, frozenset(v2_controllers), memsw)

    @property
    def mode(self) -> str:
        from_v1 = any(c in self.v1 for c in LIMIT_CONTROLLERS)
        from_v2 = bool(self.v2_controllers)
        if from_v1 and from_v2:
            return "hybrid"
        return "v1" if from_v1 else "v2" if from_v2 else "none"

    def limits(self) -> dict[str, bool]:
        return {c: c in self.v1 or c in self.v2_controllers for c in LIMIT_CONTROLLERS}

    def worker_dirs(self, worker_name: str) -> list[Path]:
        """`sandgate/<worker>` in every hierarchy used (deduplicated: co-mounted v1
        controllers share a directory)."""
        dirs: list[Path] = []
        for base in [*self.v1.values(), *([self.unified] if self.unified else [])]:
            d = base / TOP / worker_name
            if d not in dirs:
                dirs.append(d)
        return dirs

    def prepare(self, worker_name: str) -> dict[str, bool]:
        """Create `sandgate/<worker>` everywhere and enable v2 controllers down to it.

        Returns the limits that will really be applied (a v2 controller that cannot be
        enabled is dropped and logged)."""
        for d in self.worker_dirs(worker_name):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise WorkerError(f"cannot create cgroup {d}: {exc}") from exc
        limits = self.limits()
        if self.unified is not None and self.v2_controllers:
            for ctrl in sorted(self.v2_controllers):
                try:
                    for d in (self.unified, self.unified / TOP, self.unified / TOP / worker_name):
                        enabled = _read(d / "cgroup.subtree_control").split()
                        if ctrl not in enabled:
                            _write(d / "cgroup.subtree_control", f"+{ctrl}")
                except OSError as exc:
                    log.warning(
                        "cgroup.v2_controller_unavailable controller=%s error=%s", ctrl, exc
                    )
                    limits[ctrl] = False
        return limits

    def memory_includes_swap(self, worker_name: str) -> bool:
        """Does the memory limit also cap swap (v1 memsw, or v2 memory.swap.max set to 0)?"""
        if "memory" in self.v1:
            return self.memsw
        if "memory" in self.v2_controllers and self.unified is not None:
            return (self.unified / TOP / worker_name / "memory.swap.max").exists()
        return False

    def has_cgroup_kill(self, worker_name: str) -> bool:
        """After `prepare`: does the v2 group of this worker offer cgroup.kill (Linux 5.14+)?"""
        return (
            self.unified is not None and (self.unified / TOP / worker_name / "cgroup.kill").exists()
        )


def _safe_iterdir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []


@dataclass
class SandboxCgroups:
    dirs: list[Path] = field(default_factory=list)  # leaf groups created, one per hierarchy
    applied: dict[str, bool] = field(default_factory=dict)
    kill_file: Path | None = None
    oom_counter: Path | None = None  # `oom_kill N`: the memory limit's kills (metrics.py)

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def pids(self) -> set[int]:
        found: set[int] = set()
        for f in self.procs_files:
            try:
                found.update(int(x) for x in _read(f).split())
            except (OSError, ValueError):
                pass
        return found

    async def kill_all(self, wait_s: float = 5.0) -> bool:
        """SIGKILL everything in the groups until they are empty; False on timeout."""
        return await kill_dirs(self.dirs, self.kill_file, wait_s)

    async def remove(self, wait_s: float = 2.0) -> list[Path]:
        """rmdir the leaf groups; returns those that could not be removed."""
        return await rmdir_all(self.dirs, wait_s)


async def set_frozen(
    dirs: list[Path] | tuple[Path, ...], frozen: bool, wait_s: float = 2.0
) -> bool:
    """Freeze (or thaw) a sandbox's processes through its cgroup v2 group's cgroup.freeze;
    True once the kernel says so, False where the host has no such file."""
    for d in dirs:
        control = d / "cgroup.freeze"
        if not control.exists():
            continue
        try:
            control.write_text("1" if frozen else "0")
        except OSError:
            return False
        want = f"frozen {1 if frozen else 0}"
        deadline = asyncio.get_running_loop().time() + wait_s
        while asyncio.get_running_loop().time() < deadline:
            try:
                if want in _read(d / "cgroup.events").splitlines():
                    return True
            except OSError:
                return False
            await asyncio.sleep(0.01)
        return False
    return False


async def hold_frozen(
    holds: dict[str, int], name: str, dirs: list[Path] | tuple[Path, ...], frozen: bool
) -> bool:
    """Take (`frozen`) or give back one hold on sandbox `name`'s freeze, counted in `holds`:
    it is frozen from the first hold to the last, so one operation ending never thaws it
    under another (a sandbox mounting two workspaces, a commit beside a build's export).
    False when the hold could not be taken (no cgroup.freeze here) or there was none."""
    held = holds.get(name, 0)
    if frozen:
        ok = held > 0 or await set_frozen(dirs, True)
        if ok:
            holds[name] = held + 1
        return ok
    if held <= 0:
        return False
    if held > 1:
        holds[name] = held - 1
        return True
    del holds[name]
    return await set_frozen(dirs, False)


def create_sandbox_cgroups(
    host: CgroupHost,
    worker_name: str,
    name: str,
    *,
    limits: dict[str, bool],
    memory_mb: int,
    pids: int,
    cpus: float,
) -> SandboxCgroups:
    """Create and configure the sandbox's leaf groups; undo and raise WorkerError on failure.

    `limits` are the controllers `CgroupHost.prepare` found usable: each of those must be
    applied or the sandbox is not created (features() already promised them)."""
    cg = SandboxCgroups()
    try:
        leaf_of: dict[str, Path] = {}
        for ctrl, base in host.v1.items():
            d = base / TOP / worker_name / name
            if d not in cg.dirs:
                _mkdir_leaf(d)
                cg.dirs.append(d)
            leaf_of[ctrl] = d
        if host.unified is not None:
            d = host.unified / TOP / worker_name / name
            _mkdir_leaf(d)
            cg.dirs.append(d)
            for ctrl in host.v2_controllers:
                leaf_of[ctrl] = d
            if (d / "cgroup.kill").exists():
                cg.kill_file = d / "cgroup.kill"
        memory = memory_mb << 20
        quota = max(1000, int(cpus * CPU_PERIOD_US))
        for ctrl in LIMIT_CONTROLLERS:
            if not limits.get(ctrl) or ctrl not in leaf_of:
                cg.applied[ctrl] = False
                continue
            d = leaf_of[ctrl]
            v1 = ctrl in host.v1
            if ctrl == "memory":
                if v1:
                    _write(d / "memory.limit_in_bytes", str(memory))
                    if host.memsw:
                        _write(d / "memory.memsw.limit_in_bytes", str(memory))
                    cg.oom_counter = d / "memory.oom_control"
                else:
                    _write(d / "memory.max", str(memory))
                    if (d / "memory.swap.max").exists():
                        _write(d / "memory.swap.max", "0")
                    cg.oom_counter = d / "memory.events"
            elif ctrl == "pids":
                _write(d / "pids.max", str(pids))
            elif ctrl == "cpu":
                if v1:
                    # Every write of either checks the bandwidth of every group on the host
                    # (the kernel walks them all), so a period the new group already has (the
                    # kernel's default, 100 ms) is read, not written again.
                    if _read(d / "cpu.cfs_period_us").strip() != str(CPU_PERIOD_US):
                        _write(d / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                    _write(d / "cpu.cfs_quota_us", str(quota))
                else:
                    _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            cg.applied[ctrl] = True
    except OSError as exc:
        for d in cg.dirs:
            try:
                d.rmdir()
            except OSError:
                pass
        raise WorkerError(f"cannot set up the sandbox cgroups: {exc}") from exc
    return cg


def _mkdir_leaf(d: Path) -> None:
    try:
        d.mkdir()
    except FileNotFoundError:
        d.parent.mkdir(parents=True, exist_ok=True)
        d.mkdir()
    except FileExistsError:
        raise OSError(
            errno.EEXIST, f"cgroup {d} already exists (a sandbox of that name?)"
        ) from None


async def kill_dirs(dirs: list[Path], kill_file: Path | None, wait_s: float) -> bool:
    if kill_file is not None:
        try:
            _write(kill_file, "1")
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("cgroup.kill_failed path=%s error=%s", kill_file, exc)
    deadline = time.monotonic() + wait_s
    delay = 0.002
    while True:
        pids: set[int] = set()
        for d in dirs:
            try:
                pids.update(int(x) for x in _read(d / "cgroup.procs").split())
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                continue
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            log.warning("cgroup.kill_timeout dirs=%s pids=%s", [str(d) for d in dirs], sorted(pids))
            return False
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def rmdir_all(dirs: list[Path], wait_s: float) -> list[Path]:
    deadline = time.monotonic() + wait_s
    left = list(dirs)
    while True:
        still: list[Path] = []
        for d in left:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    log.warning("cgroup.rmdir_failed path=%s error=%s", d, exc)
                still.append(d)
        left = still
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.01)


async def cleanup_worker(host: CgroupHost, worker_name: str, wait_s: float = 5.0) -> list[str]:
    """Kill and remove every leftover sandbox group of this worker (after a crash).

    Returns the sandbox names found."""
    names: set[str] = set()
    leaves: list[Path] = []
    kill_files: list[Path] = []
    for wd in host.worker_dirs(worker_name):
        for child in _safe_iterdir(wd):
            if child.is_dir():
                names.add(child.name)
                leaves.append(child)
                if (child / "cgroup.kill").exists():
                    kill_files.append(child / "cgroup.kill")
    for kf in kill_files:
        try:
            _write(kf, "1")
        except OSError:
            pass
    if leaves:
        await kill_dirs(leaves, None, wait_s)
        left = await rmdir_all(leaves, wait_s)
        if left:
            raise WorkerError(f"cannot remove leftover cgroups: {', '.join(map(str, left))}")
    return sorted(names)


def remove_worker_groups(host: CgroupHost, worker_name: str) -> None:
    """rmdir `sandgate/<worker>` (and `sandgate` when empty) everywhere; for tests and a
    worker's orderly shutdown once every sandbox is stopped. Non-empty groups stay."""
    for d in host.worker_dirs(worker_name):
        for target in (d, d.parent):
            try:
                target.rmdir()
            except OSError:
                break
