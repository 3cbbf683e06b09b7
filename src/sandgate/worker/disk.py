"""A sandbox's disk: one ext4 file system image per sandbox, loop-mounted, holding its
/workspace and /tmp. The kernel enforces the quota (see docs/decisions/0007-disk-quotas.md).

The image is a sparse file of exactly the quota's size: the host loses at most that, however
the sandbox writes; the inode count is fixed when it is made (`inodes_for`). Writing past
either gives ENOSPC inside the sandbox. Mounted ``nosuid,nodev`` with ``discard``, so files
the sandbox deletes give their blocks back to the host; the loop device detaches itself when
the file system is gone (`loopmount.py`, which mounts it in-process).

A sandbox without a template gets its disk **detached** (`create(..., detached=True)`): the
worker holds the mount as an fd and the sandbox's own mount namespace moves it to
`mount_point` (`root_step.py`), so the worker's mount table does not grow with the
sandboxes it holds. A template sandbox's overlay needs its upper directory on a path: its
disk is attached at `mount_point` in the worker's table.

A worker makes one blank file system per size with `mkfs.ext4` and copies it for each
sandbox (`copy_blank`: its few data extents, in-process).

Blocking helpers (they run `mkfs.ext4`, copy and mount): call them in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandgate.errors import WorkerError
from sandgate.worker import loopmount
from sandgate.worker.cgroups import unescape_mountinfo

log = logging.getLogger(__name__)

INODES_PER_MB = 64  # 1 GiB of quota -> 65,536 files and directories
MIN_INODES = 2048
IMAGE_NAME = "disk.img"
MOUNT_NAME = "disk"


def inodes_for(disk_mb: int) -> int:
    return max(MIN_INODES, disk_mb * INODES_PER_MB)


@dataclass(frozen=True)
class SandboxDisk:
    image: Path
    mount_point: Path  # where the sandbox's chain sees it (and the worker, unless detached)
    workspace: Path  # path of the sandbox's /workspace, below mount_point
    tmp: Path  # of its /tmp
    mount_fd: int = -1  # a detached disk: the worker's fd of it (`release` closes it)

    @property
    def detached(self) -> bool:
        return self.mount_fd >= 0

    @property
    def root(self) -> Path:
        """Where the worker reaches the file system's root (statvfs, reads)."""
        return loopmount.fd_path(self.mount_fd) if self.detached else self.mount_point


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WorkerError(f"{what}: {exc}") from exc
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise WorkerError(f"{what}: {detail[-1] if detail else f'exit {done.returncode}'}")


def make_image(image: Path, *, disk_mb: int) -> None:
    """A sparse file of exactly `disk_mb` MiB, made into ext4 (`image` must not exist)."""
    with open(image, "xb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.truncate(disk_mb << 20)
    _run(
        [
            "mkfs.ext4",
            "-q",
            "-F",
            "-b",
            "4096",
            "-m",
            "0",
            "-N",
            str(inodes_for(disk_mb)),
            "-O",
            "^has_journal,^resize_inode",
            "-E",
            "lazy_itable_init=1,nodiscard",
            str(image),
        ],
        "cannot make the file system",
    )


MAX_BLANK_DATA = 64 << 20  # a blank image holds ~150 KiB of data; more: no sparse copy here
MAX_BLANKS = 16  # disk sizes a worker keeps a blank of; other sizes get mkfs per sandbox


def blank_path(blank_dir: Path, disk_mb: int) -> Path:
    return blank_dir / f"ext4-{disk_mb}mb-{inodes_for(disk_mb)}i.img"


def copy_blank(image: Path, *, disk_mb: int, blank_dir: Path) -> None:
    """`image` made as a copy of this worker's blank file system of that size (made once,
    with `make_image`): only its data extents are copied (~150 KiB), in-process, so a start
    does not spawn `mkfs.ext4` (a spawn copies the worker's descriptor table, which grows
    with the sandboxes held). The copies share the blank's file system UUID, which the
    kernel does not use to tell mounts apart. Falls back to `make_image` where the file
    system holding `blank_dir` cannot tell data from holes, and for a size past the
    `MAX_BLANKS` the worker already keeps (the sizes are the tenants' choice)."""
    blank = blank_path(blank_dir, disk_mb)
    if not blank.exists():
        blank_dir.mkdir(mode=0o700, exist_ok=True)
        if len(list(blank_dir.glob("*.img"))) >= MAX_BLANKS:  # tenants pick the sizes
            make_image(image, disk_mb=disk_mb)
            return
        making = blank.with_name(f"{blank.name}.{os.getpid()}.{id(image):x}.tmp")
        try:
            make_image(making, disk_mb=disk_mb)
            os.replace(making, blank)  # atomic: concurrent starts each make one, one wins
        finally:
            making.unlink(missing_ok=True)
    source = os.open(blank, os.O_RDONLY | os.O_CLOEXEC)
    try:
        extents = _data_extents(source)
        if extents is None:
            make_image(image, disk_mb=disk_mb)
            return
        with open(image, "xb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.truncate(disk_mb << 20)
            for start, end in extents:
                while start < end:
                    copied = os.copy_file_range(source, f.fileno(), end - start, start, start)
                    if copied == 0:
                        raise WorkerError(f"cannot copy the blank disk {blank}: it shrank")
                    start += copied
    except OSError as exc:
        image.unlink(missing_ok=True)
        raise WorkerError(f"cannot make the disk image from {blank}: {exc}") from exc
    except BaseException:
        image.unlink(missing_ok=True)
        raise
    finally:
        os.close(source)


def _data_extents(fd: int) -> list[tuple[int, int]] | None:
    """The (start, end) of each data extent of the file, or None if that is more than
    MAX_BLANK_DATA (a file system that reports the whole file as data)."""
    extents: list[tuple[int, int]] = []
    size, offset, total = os.fstat(fd).st_size, 0, 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past offset
                break
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        total += end - start
        if total > MAX_BLANK_DATA:
            return None
        extents.append((start, end))
        offset = end
    return extents


def mount_image(image: Path, mount_point: Path, *, device: int | None = None) -> int:
    """Mount the file system in `image` at `mount_point`, in this mount table: the number of
    its loop device. `device`: that of the image's last mount (`loopmount.mount_detached`)."""
    mount_fd, device = loopmount.mount_detached(image, device=device)
    try:
        loopmount.attach(mount_fd, mount_point)
    finally:
        os.close(mount_fd)
    os.chmod(mount_point, 0o711)
    return device


def create(
    sandbox_dir: Path,
    *,
    disk_mb: int,
    uid: int,
    detached: bool = False,
    blank_dir: Path | None = None,
) -> SandboxDisk:
    """Make (from `blank_dir`'s blank of that size, if given: `copy_blank`), mount and lay
    out the sandbox's file system; nothing is left on failure."""
    image = sandbox_dir / IMAGE_NAME
    mount_point = sandbox_dir / MOUNT_NAME
    mount_fd = -1
    try:
        if blank_dir is None:
            make_image(image, disk_mb=disk_mb)
        else:
            copy_blank(image, disk_mb=disk_mb, blank_dir=blank_dir)
        mount_point.mkdir(mode=0o711)
        if detached:
            mount_fd = loopmount.mount_detached(image).fd
            root = loopmount.fd_path(mount_fd)
            os.chmod(root, 0o711)
        else:
            mount_image(image, mount_point)
            root = mount_point
        for name, mode in (("workspace", 0o700), ("tmp", 0o1777)):
            path = root / name
            path.mkdir()
            os.chown(path, uid, uid)
            os.chmod(path, mode)
    except BaseException:
        if mount_fd >= 0:
            os.close(mount_fd)
        remove(sandbox_dir)
        raise
    return SandboxDisk(
        image, mount_point, mount_point / "workspace", mount_point / "tmp", mount_fd=mount_fd
    )


def release(made: SandboxDisk) -> None:
    """Let go of a detached disk: it ends with the sandbox's mount namespace (its processes
    gone) and the worker's fd, and its loop device with it. Attached: `remove` unmounts it."""
    if made.detached:
        os.close(made.mount_fd)


def unmount(point: Path) -> None:
    _run(["umount", str(point)], f"cannot unmount {point}")


def remove(sandbox_dir: Path) -> None:
    """Unmount the sandbox's file system (if mounted) and delete its image. Call it only
    once the sandbox's processes are gone, or the unmount is refused while they hold it."""
    mount_point = sandbox_dir / MOUNT_NAME
    if os.path.ismount(mount_point):
        _run(["umount", str(mount_point)], f"cannot unmount {mount_point}")
    (sandbox_dir / IMAGE_NAME).unlink(missing_ok=True)
    with contextlib.suppress(FileNotFoundError):
        mount_point.rmdir()  # empty once unmounted (a plain directory otherwise: kept)


def mounts_below(root: Path) -> list[Path]:
    """Mount points at or below `root` in this mount namespace, deepest first."""
    found: list[Path] = []
    prefix = str(root.absolute()).rstrip("/") + "/"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = unescape_mountinfo(line.split()[4])
                if point.startswith(prefix):
                    found.append(Path(point))
    except OSError:
        return []
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def unmount_leftovers(root: Path) -> list[Path]:
    """Unmount what a crashed run left mounted below `root` (lazily when busy)."""
    done: list[Path] = []
    for point in mounts_below(root):
        try:
            _run(["umount", str(point)], f"cannot unmount {point}")
        except WorkerError as exc:
            log.warning("disk.unmount_busy point=%s (%s); detaching it lazily", point, exc)
            _run(["umount", "-l", str(point)], f"cannot detach {point}")
        done.append(point)
    return done


def probe(work_dir: Path) -> str | None:
    """Why per-sandbox file systems cannot be made here (no loop devices, no mkfs.ext4,
    not root), or None when they can: a tiny image is made, mounted and removed."""
    probe_dir = work_dir / ".disk-probe"
    try:
        if probe_dir.exists():
            remove(probe_dir)  # what a run that died during its probe left
        else:
            probe_dir.mkdir(mode=0o700)
        create(probe_dir, disk_mb=16, uid=0)
        remove(probe_dir)
        return None
    except (OSError, WorkerError) as exc:
        return getattr(exc, "message", None) or str(exc)
    finally:
        try:
            remove(probe_dir)
            probe_dir.rmdir()
        except (OSError, WorkerError):
            pass
