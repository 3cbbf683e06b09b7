"""A template sandbox's root: its image's layers, read-only, under a writable overlay.

The layers are unpacked once per worker (`images.py`), owned by root, shared by every
sandbox of the image. Each sandbox runs as its own host uid, so it sees them through an
**idmapped mount** of the layer store: a clone of it on which the on-disk owner 0 reads as
the sandbox's uid (a user namespace mapping ``0 -> uid`` lends the mapping, then goes).
overlayfs stacks those layers under an upper directory on the sandbox's own file system
(`disk.py`): whatever it writes, installs or deletes lands there, counts against its disk
quota and goes with it; the layers never change.

The mount syscalls (``open_tree``, ``mount_setattr``, ``move_mount``: Linux >= 5.12) are in
`idmap.py`, shared with the workspaces' binds. overlayfs
keeps private clones of its layers' mounts, so the idmapped mount is detached as soon as
the overlay stands: one mount per sandbox to remove, the overlay.

Blocking: call these in a thread.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
from pathlib import Path

from sandgate.errors import InvalidRequestError, WorkerError
from sandgate.worker import idmap
from sandgate.worker.layers import open_dir

_MNT_DETACH = 2

ROOT_NAME = "root"  # the sandbox's merged root, in its directory
LAYERS_NAME = "l"  # where the idmapped layer store is attached while the overlay is made
UPPER_NAME = "root-upper"  # on the sandbox's file system
WORK_NAME = "root-work"
MAX_MOUNT_DATA = 4000  # the kernel takes one page of mount options


_libc = ctypes.CDLL(None, use_errno=True)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def _check(result: int, what: str) -> int:
    if result < 0:
        errno = ctypes.get_errno()
        raise WorkerError(f"{what}: {os.strerror(errno)}")
    return result


def attach_idmapped(source: Path, target: Path, host_uid: int) -> None:
    """Attach a clone of the mount of `source` at `target`, owner 0 reading as `host_uid`."""
    idmap.bind(source, target, on_disk=0, seen_as=host_uid, below=True)


def detach(target: Path) -> None:
    """Lazily unmount `target` (gone from the tree now, freed once unused)."""
    _check(_libc.umount2(os.fsencode(target), _MNT_DETACH), f"cannot detach {target}")


def overlay_options(layers: list[str], upper: Path, work: Path) -> str:
    """overlayfs mount options; `layers` are relative to the mount's cwd, bottom first."""
    lower = ":".join(reversed(layers))  # overlayfs lists the top layer first
    # redirect_dir, metacopy and index off: the upper directory then holds whole files and
    # plain directories, which is what export.py reads as a build step's layer
    options = (
        f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=off,metacopy=off,index=off"
    )
    if len(options) > MAX_MOUNT_DATA:
        raise WorkerError(
            f"the image has too many layers ({len(layers)}) for one overlay mount; squash it"
        )
    return options


def mount_root(
    sandbox_dir: Path,
    layer_store: Path,
    layers: list[str],
    *,
    upper_parent: Path,
    host_uid: int,
) -> Path:
    """Make the sandbox's root in `sandbox_dir`/root: `layers` (names in `layer_store`,
    bottom first) under an upper directory in `upper_parent`, owned by `host_uid`.
    Nothing is left mounted on failure."""
    root = sandbox_dir / ROOT_NAME
    staging = sandbox_dir / LAYERS_NAME
    upper, work = upper_parent / UPPER_NAME, upper_parent / WORK_NAME
    upper.mkdir(mode=0o755)
    os.chown(upper, host_uid, host_uid)
    work.mkdir(mode=0o700)
    root.mkdir(mode=0o755)
    staging.mkdir(mode=0o700)
    attach_idmapped(layer_store, staging, host_uid)
    try:
        options = overlay_options([f"{LAYERS_NAME}/{name}" for name in layers], upper, work)
        done = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(root)],
            cwd=sandbox_dir,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
            raise WorkerError(f"cannot mount the sandbox's root overlay: {detail}")
    finally:
        detach(staging)
        staging.rmdir()
    return root


def unmount_root(sandbox_dir: Path) -> None:
    """Unmount the sandbox's root overlay if it is mounted (before its file system)."""
    root = sandbox_dir / ROOT_NAME
    if os.path.ismount(root):
        done = subprocess.run(["umount", str(root)], capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            detach(root)
    if root.is_dir():
        root.rmdir()


MAX_LINK_HOPS = 40
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_path(root_fd: int, parts: list[str]) -> int:
    return open_dir(root_fd, parts, create=False)


def _resolve_dir(root_fd: int, path: str, host_uid: int) -> list[str]:
    """The components of `path` inside the image root, its symlinks followed as if the root
    were / (an absolute target starts again at the root; '..' stops there), the directories
    it lacks made (the sandbox's own); never a step outside the root."""
    pending = [p for p in path.split("/") if p not in ("", ".")]
    resolved: list[str] = []
    hops = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        parent = _open_path(root_fd, resolved)
        try:
            try:
                st = os.stat(part, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=parent)
                os.chown(part, host_uid, host_uid, dir_fd=parent, follow_symlinks=False)
                resolved.append(part)
                continue
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_LINK_HOPS:
                    raise InvalidRequestError(f"the image's {path} has too many symlinks")
                target = os.readlink(part, dir_fd=parent)
                if target.startswith("/"):
                    resolved = []
                pending = [p for p in target.split("/") if p not in ("", ".")] + pending
                continue
            if not stat.S_ISDIR(st.st_mode):
                shown = "/" + "/".join([*resolved, part])
                raise InvalidRequestError(
                    f"the image's {shown} is not a directory: sandgate mounts {path} there"
                )
            resolved.append(part)
        finally:
            os.close(parent)
    return resolved


def make_mount_points(
    root: Path, host_uid: int, *, dirs: list[str], files: list[str]
) -> dict[str, str]:
    """Where bwrap mounts each of `dirs` and `files` in a template sandbox's root, resolved
    here in the root and made if missing, so bwrap follows no link of the image (it would
    follow one out of the root: the host's root is still reachable while it sets up).
    A file mount point that is a link in the image (/etc/resolv.conf often is) is replaced
    by an empty file in the sandbox's own upper layer."""
    points: dict[str, str] = {}
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        for path in dirs:
            points[path] = "/" + "/".join(_resolve_dir(root_fd, path, host_uid))
        for path in files:
            parent_path, _, name = path.rpartition("/")
            parts = _resolve_dir(root_fd, parent_path or "/", host_uid)
            parent = _open_path(root_fd, parts)
            try:
                try:
                    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISDIR(st.st_mode):
                    raise InvalidRequestError(
                        f"the image's {path} is a directory: sandgate mounts a file there"
                    )
                if st is None or not stat.S_ISREG(st.st_mode):
                    if st is not None:
                        os.unlink(name, dir_fd=parent)
                    fd = os.open(
                        name,
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                        0o644,
                        dir_fd=parent,
                    )
                    os.fchown(fd, host_uid, host_uid)
                    os.close(fd)
            finally:
                os.close(parent)
            points[path] = "/" + "/".join([*parts, name])
    finally:
        os.close(root_fd)
    return points


def lookup_user(root: Path, user: str, host_uid: int) -> int:
    """The uid the image's `user` names: its number, or the name looked up in the image's
    own /etc/passwd (read inside its root, no link followed out of it)."""
    name = user.partition(":")[0]
    if name in ("", "root"):
        return 0
    if name.isdigit():
        return int(name)
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        try:
            etc = _open_path(root_fd, _resolve_dir(root_fd, "/etc", host_uid))
        except (OSError, InvalidRequestError):
            etc = -1
        if etc >= 0:
            try:
                fd = os.open("passwd", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=etc)
                with os.fdopen(fd, "rb") as f:
                    for line in f.read(1 << 20).decode(errors="replace").splitlines():
                        fields = line.split(":")
                        if len(fields) > 2 and fields[0] == name and fields[2].isdigit():
                            return int(fields[2])
            except OSError:
                pass
            finally:
                os.close(etc)
    finally:
        os.close(root_fd)
    raise InvalidRequestError(f"the template's user {name!r} is not in its /etc/passwd")


def probe(work_dir: Path, host_uid: int) -> str | None:
    """Why template roots cannot be made here (no idmapped mounts: Linux < 5.12, or a file
    system that does not take them), or None when they can: one is made and removed."""
    base = work_dir / ".idmap-probe"
    source, target = base / "source", base / "target"
    try:
        for d in (base, source, target):
            d.mkdir(mode=0o700, exist_ok=True)
        attach_idmapped(source, target, host_uid)
        detach(target)
        return None
    except (OSError, WorkerError) as exc:
        return getattr(exc, "message", None) or str(exc)
    finally:
        for d in (target, source, base):
            try:
                d.rmdir()
            except OSError:
                pass
