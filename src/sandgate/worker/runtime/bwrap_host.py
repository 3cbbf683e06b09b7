"""Host preparation for the bwrap runtime: what `BwrapRuntime.prepare()` checks and sets up.

Once per worker start, before any sandbox (`bwrap.py` starts and stops them):

* the tools (``bwrap`` >= 0.8, ``setpriv``, ``mount``, ``/bin/sh``) and root;
* the sandbox uid range belongs to no host account;
* the state directories exist and unprivileged uids can traverse them;
* leftovers of an earlier run of this worker are removed: processes and cgroups first, then
  mounts and files;
* the worker's cgroups are prepared and what they can enforce is found (`cgroups.py`);
* the minimal /etc is generated and the seccomp filter written (`seccomp.py`); the bwrap
  arguments of the read-only root are computed from them;
* the disk quota is probed (`disk.py`) and the host's file table read (`fds.py`).

Each step raises `WorkerError` saying what to fix; what the host cannot enforce is logged and
reported by `features()` instead.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import pwd
import re
import shutil
import stat
from pathlib import Path

from sandgate.errors import WorkerError
from sandgate.worker import cgroups, disk, fds
from sandgate.worker.cgroups import CgroupHost
from sandgate.worker.cleanup import remove_tree
from sandgate.worker.uids import UidPool

log = logging.getLogger(__name__)

SANDBOX_UID = 1000
MIN_BWRAP = (0, 8, 0)  # the oldest tested (Debian 12's); --size alone needs 0.5.0

# Host /etc entries bound read-only into the sandbox when present. Nothing else of the
# host's /etc is visible (no shadow, no keys, no host names).
HOST_ETC = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "ssl",
    "localtime",
    "matplotlibrc",  # Debian's matplotlib reads its defaults here (the code interpreter)
    "fonts",  # fontconfig's configuration (fonts for plots)
)
ROOT_LINKS = ("bin", "sbin", "lib", "lib64", "lib32", "libx32")


def untraversable(path: Path) -> Path | None:
    """The first of `path` and its ancestors that an unprivileged uid cannot enter."""
    p = path.absolute()
    for d in [*reversed(p.parents), p]:
        try:
            st = os.stat(d)
        except OSError:
            return d
        if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_IXOTH:
            return d
    return None


def find_tools() -> tuple[str, str]:
    """(bwrap, setpriv): the programs every sandbox's chain execs, checked present (and
    `mount`, which the root step runs for a sandbox's own disk)."""
    if os.geteuid() != 0:
        raise WorkerError("the bwrap runtime must run as root (it drops to a uid per sandbox)")
    bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    mount = shutil.which("mount") or "/usr/bin/mount"
    needed = ((bwrap, "bubblewrap"), (setpriv, "util-linux"), (mount, "mount"))
    for path, package in needed:
        if not os.access(path, os.X_OK):
            raise WorkerError(
                f"{Path(path).name} not found: install it with `apt-get install -y {package}`"
            )
    if not os.access("/bin/sh", os.X_OK):
        raise WorkerError("/bin/sh not found")
    return bwrap, setpriv


async def check_bwrap_version(bwrap: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        bwrap,
        "--version",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    out, _ = await proc.communicate()
    m = re.search(rb"(\d+)\.(\d+)\.(\d+)", out)
    version = tuple(int(x) for x in m.groups()) if m else (0, 0, 0)
    if version < MIN_BWRAP:
        raise WorkerError(
            f"bubblewrap {'.'.join(map(str, version))} is too old (need "
            f"{'.'.join(map(str, MIN_BWRAP))}, the oldest release sandgate is tested with)"
        )


def check_uid_range(uids: UidPool) -> None:
    """The leased uids must belong to nobody else on the host."""
    lo, hi = uids.base, uids.base + uids.count
    taken = [f"user {u.pw_name} ({u.pw_uid})" for u in pwd.getpwall() if lo <= u.pw_uid < hi]
    taken += [f"group {g.gr_name} ({g.gr_gid})" for g in grp.getgrall() if lo <= g.gr_gid < hi]
    if taken:
        raise WorkerError(
            f"the sandbox uid range [{lo}, {hi}) overlaps host accounts: "
            f"{', '.join(taken[:5])}; choose another uid base"
        )


def make_state_dirs(state_dir: Path, sandboxes_dir: Path, uids: UidPool) -> None:
    """The state directory, its `sandboxes/` (0711) and the uid lock directory."""
    try:
        state_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        sandboxes_dir.mkdir(mode=0o711, exist_ok=True)
        os.chmod(sandboxes_dir, 0o711)
        uids.ensure_dir()
    except OSError as exc:
        raise WorkerError(f"cannot create the state directory {state_dir}: {exc}") from exc
    blocked = untraversable(sandboxes_dir)
    if blocked is not None:
        raise WorkerError(
            f"{blocked} is not traversable by unprivileged uids (needs mode o+x, e.g. 0711); "
            f"sandboxes under {state_dir} could not reach their workspace. "
            f"Run `chmod o+x {blocked}` or choose another --state-dir."
        )


async def remove_leftovers(cg_host: CgroupHost, worker_name: str, sandboxes_dir: Path) -> None:
    """What an earlier run of this worker left: processes and cgroups first, then files."""
    try:
        found = await cgroups.cleanup_worker(cg_host, worker_name)
    except WorkerError as exc:
        raise WorkerError(f"cannot clean up after an earlier run: {exc.message}") from exc
    unmounted = await asyncio.to_thread(disk.unmount_leftovers, sandboxes_dir)
    # one listing of a directory the worker owns, once at start-up (blocking, as it always was)
    leftovers = [p for p in sandboxes_dir.iterdir()]  # noqa: ASYNC240
    for p in leftovers:
        await asyncio.to_thread(remove_tree, p)
    if found or leftovers or unmounted:
        log.warning(
            "runtime.leftovers_removed worker=%s cgroups=%s dirs=%s mounts=%s",
            worker_name,
            found,
            [p.name for p in leftovers],
            len(unmounted),
        )


def warn_missing_limits(limits: dict[str, bool], worker_name: str) -> None:
    if not all(limits.values()):
        log.warning(
            "runtime.limits_missing worker=%s limits=%s (not enforced on this host)",
            worker_name,
            limits,
        )


def _write_file(path: Path, content: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(content)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_etc(etc_dir: Path, *, resolver: str | None) -> list[str]:
    """Generate the sandbox's minimal /etc in `etc_dir`; the bwrap arguments that bind it.
    `resolver`: the address a sandbox's resolv.conf names (the egress gate's DNS answers
    there), None where sandboxes never have a network."""
    etc_dir.mkdir(mode=0o755, exist_ok=True)
    os.chmod(etc_dir, 0o755)
    files = {
        "passwd": (
            "root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::/workspace:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ),
        "group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
        "hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "nsswitch.conf": (
            "passwd: files\ngroup: files\nshadow: files\n"
            "hosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n"
        ),
    }
    if resolver is not None:
        files["resolv.conf"] = f"nameserver {resolver}\noptions timeout:2 attempts:2\n"
    for name, content in files.items():
        _write_file(etc_dir / name, content)
    stale = etc_dir / "resolv.conf"
    if resolver is None and stale.exists():
        stale.unlink()
    args = ["--dir", "/etc"]
    for name in sorted(files):
        args += ["--ro-bind", str(etc_dir / name), f"/etc/{name}"]
    for name in HOST_ETC:
        host = Path("/etc") / name
        if host.exists():
            args += ["--ro-bind", str(host), str(host)]
    return args


def elf_interpreter(path: Path) -> str | None:
    """The program interpreter (dynamic loader) a 64-bit little-endian ELF names, if any."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return None
        phoff = int.from_bytes(header[32:40], "little")
        phentsize = int.from_bytes(header[54:56], "little")
        phnum = int.from_bytes(header[56:58], "little")
        for index in range(phnum):
            f.seek(phoff + index * phentsize)
            entry = f.read(phentsize)
            if int.from_bytes(entry[0:4], "little") == 3:  # PT_INTERP
                offset = int.from_bytes(entry[8:16], "little")
                size = int.from_bytes(entry[32:40], "little")
                f.seek(offset)
                return f.read(size).rstrip(b"\0").decode()
    return None


def host_python() -> tuple[str, str, str] | None:
    """(loader, its library directory, python) under /usr, to run the agent in a template
    sandbox with the host's /usr bound aside; None where the host's Python is not so laid out."""
    try:
        python = os.path.realpath("/usr/bin/python3")
        interp = elf_interpreter(Path(python))
    except OSError:
        return None
    if interp is None:
        return None
    loader = os.path.realpath(interp)
    if not (python.startswith("/usr/") and loader.startswith("/usr/")):
        return None
    return loader, os.path.dirname(loader), python


def root_args(etc_args: list[str]) -> list[str]:
    """bwrap arguments building the read-only root: a tmpfs with the host's /usr, its
    top-level links into it, the generated /etc (`etc_args`), /dev and /proc."""
    args = ["--tmpfs", "/", "--ro-bind", "/usr", "/usr"]
    for name in ROOT_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    args += etc_args
    args += ["--dev", "/dev", "--proc", "/proc"]
    return args


async def probe_disk(state_dir: Path, worker_name: str) -> str | None:
    """Why this host cannot give sandboxes a disk quota, or None when it can."""
    problem = await asyncio.to_thread(disk.probe, state_dir)
    if problem is not None:
        log.warning(
            "runtime.disk_quota_unavailable worker=%s (%s): /workspace and /tmp are not "
            "size-limited on this host; disk_quota is reported false",
            worker_name,
            problem,
        )
    return problem


def file_limits() -> tuple[int, int]:
    """The host's fs.file-max and fs.nr_open."""
    try:
        return fds.host_file_limits()
    except (OSError, ValueError) as exc:
        raise WorkerError(f"cannot read the host's file table size: {exc}") from exc
