"""Idmapped bind mounts: a directory whose files belong to one host uid, seen through a mount
as if they belonged to another.

A workspace's files are owned on disk by the storage uid (`workspaces.STORAGE_UID`), the same
on every worker of a deployment, while each sandbox runs as its own leased uid. Sandboxes
that share a workspace, and the sandbox that mounts it next week, all need to read and write
the same files: each gets the workspace through a bind mount mapped "storage uid <-> its uid"
(`mount_setattr(MOUNT_ATTR_IDMAP)`, Linux >= 5.12; ext4 supports it). What one writes is
stored as the storage uid; nothing is chowned, and no uid is shared between sandboxes.

Python has no binding for `open_tree`/`mount_setattr`/`move_mount` (util-linux's
`mount -o X-mount.idmap` came in 2.39, after Debian 12's 2.38), so they are called through
libc's `syscall`. The user namespace that carries the mapping is made by `unshare --user`
(its process only lives until the namespace's fd is open). Blocking: call in a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Final

from sandgate.errors import WorkerError
from sandgate.worker import loopmount
from sandgate.worker.cgroups import unescape_mountinfo

# x86_64 and aarch64 share these numbers (they are from the common syscall table)
_SYS_OPEN_TREE: Final = 428
_SYS_MOUNT_SETATTR: Final = 442
_OPEN_TREE_CLONE: Final = 1
_AT_FDCWD: Final = -100
_AT_EMPTY_PATH: Final = 0x1000
_AT_RECURSIVE: Final = 0x8000
_MOUNT_ATTR_IDMAP: Final = 0x00100000
_MOUNT_ATTR_NOSUID: Final = 0x2
_MOUNT_ATTR_NODEV: Final = 0x4


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise WorkerError(f"{what}: {os.strerror(err)}")
    return result


def _userns_fd(on_disk: int, seen_as: int) -> int:
    """An fd of a user namespace mapping uid and gid `on_disk` (inside) to `seen_as`."""
    child = subprocess.Popen(
        ["/usr/bin/unshare", "--user", "/bin/sleep", "30"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={},
    )
    try:
        own = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 5.0
        while os.readlink(f"/proc/{child.pid}/ns/user") == own:  # not unshared yet
            if time.monotonic() > deadline or child.poll() is not None:
                raise WorkerError("cannot make a user namespace for an idmapped mount")
            time.sleep(0.0002)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{child.pid}/{name}", "w") as f:
                f.write(f"{on_disk} {seen_as} 1\n")
        return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise WorkerError(f"cannot make a user namespace for an idmapped mount: {exc}") from exc
    finally:
        child.kill()
        child.wait()


def bind(source: Path, target: Path, *, on_disk: int, seen_as: int, below: bool = False) -> None:
    """Attach a clone of the mount of `source` at `target` (an existing directory), on which
    files owned by `on_disk` are seen as owned by `seen_as`, and written as `on_disk`.
    Without `below` it is nosuid and nodev; with it, the mounts below `source` are mapped
    too (a template's layer store: `rootfs.py`)."""
    if platform.machine() not in ("x86_64", "aarch64"):
        raise WorkerError(f"idmapped mounts are not wired for {platform.machine()}")
    userns = _userns_fd(on_disk, seen_as)
    tree = -1
    try:
        flags = _OPEN_TREE_CLONE | os.O_CLOEXEC
        tree = _check(
            _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), ctypes.c_uint(flags)),
            f"cannot clone the mount of {source}",
        )
        harden = 0 if below else _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
        attr = _MountAttr(_MOUNT_ATTR_IDMAP | harden, 0, 0, userns)
        _check(
            _libc.syscall(
                _SYS_MOUNT_SETATTR,
                tree,
                b"",
                ctypes.c_uint(_AT_EMPTY_PATH | (_AT_RECURSIVE if below else 0)),
                ctypes.byref(attr),
                ctypes.c_size_t(ctypes.sizeof(attr)),
            ),
            f"cannot idmap the mount of {source} (needs Linux >= 5.12 and a file system that "
            "supports idmapped mounts)",
        )
        loopmount.attach(tree, target)
    finally:
        if tree >= 0:
            os.close(tree)
        os.close(userns)


def is_mount(path: Path) -> bool:
    """Whether `path` is a mount point: read from mountinfo, since `os.path.ismount` misses a
    bind of a directory of the same file system (same device, as the probe's is)."""
    wanted = str(path.absolute())
    try:
        with open("/proc/self/mountinfo") as f:
            return any(unescape_mountinfo(line.split()[4]) == wanted for line in f)
    except OSError:
        return os.path.ismount(path)


def unbind(target: Path) -> None:
    """Undo `bind` (lazily when busy: the sandbox's namespace may still hold it briefly)."""
    if not is_mount(target):
        return
    done = subprocess.run(["umount", str(target)], capture_output=True, timeout=30)
    if done.returncode != 0:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=30)
    if is_mount(target):
        raise WorkerError(f"cannot unmount {target}")
