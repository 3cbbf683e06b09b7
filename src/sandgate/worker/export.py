"""A build step's layer: what a sandbox changed in its root, as an OCI layer tarball.

The sandbox's overlay upper directory (`rootfs.py`) holds exactly what it added or changed;
what it deleted is an overlayfs whiteout there (a character device 0:0), a directory it
replaced is marked opaque. Those become ``.wh.NAME`` and ``.wh..wh..opq`` entries, the
inverse of `layers.unpack`. Owners are squashed to root (the sandbox's uid is its own),
times kept, set-uid/gid bits dropped, and the mount points sandgate put in the root (its
/workspace, /tmp, /dev, /proc, the agent's and /etc/hosts) are left out: they are not the
image's. Entries are written sorted, so the same changes give the same bytes.

Blocking: call it in a thread, with the sandbox's processes stopped or idle.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from pathlib import Path
from typing import IO

from sandgate.errors import InvalidRequestError
from sandgate.worker.layers import MODE_MASK, OPAQUE_MARKER, OPAQUE_XATTR, WHITEOUT_PREFIX

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO never blocks

# sandgate's mount points in a template sandbox's root (runtime/bwrap.py), relative
NOT_THE_IMAGES = frozenset(
    {
        "dev",
        "proc",
        "tmp",
        "workspace",
        "opt/sandgate",
        "opt/sandgate-host",
        "etc/hosts",
        "etc/resolv.conf",
    }
)


def _info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode) & MODE_MASK
    info.mtime = int(st.st_mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


MAX_DEPTH = 256  # directories deeper than this are refused


class ExportError(InvalidRequestError):
    """The sandbox's changes cannot be a layer (too large, too deep)."""

    code = "export_refused"


def export_upper(upper: Path, out: Path, *, max_bytes: int) -> tuple[str, int, int]:
    """Write the layer of `upper` to `out`; (sha256 digest, size, entries).

    The upper directory is the sandbox's, and a process of it may still run: it is walked
    with directory descriptors, each opened relative to its parent without following a
    link (a symlink is always written as a link), and each file is opened with
    ``O_NOFOLLOW | O_NONBLOCK`` and checked after it is open, so nothing outside `upper` is
    read and nothing blocks, whatever is swapped in during the walk. The files' sizes add
    up to at most `max_bytes` (the sandbox's disk quota: a sparse file is refused, not
    written out as gigabytes of zeros)."""
    budget = _Budget(max_bytes)
    root = os.open(upper, _DIR_FLAGS | os.O_NONBLOCK)
    try:
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            entries = _walk(tar, root, "", 0, budget)
    finally:
        os.close(root)
    digest = hashlib.sha256()
    size = 0
    with open(out, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return "sha256:" + digest.hexdigest(), size, entries


class _Budget:
    def __init__(self, left: int) -> None:
        self.left = left

    def take(self, size: int, name: str) -> None:
        self.left -= size
        if self.left < 0:
            raise ExportError(
                f"the step's changes are larger than the sandbox's disk quota (at {name}): "
                "a sparse file? give the build more resources.disk_mb"
            )


def _walk(tar: tarfile.TarFile, dir_fd: int, rel_top: str, depth: int, budget: _Budget) -> int:
    if depth > MAX_DEPTH:
        raise ExportError(f"directories nest deeper than {MAX_DEPTH} at {rel_top}")
    entries = 0
    for name in sorted(os.listdir(dir_fd)):
        rel = _join(rel_top, name)
        if rel in NOT_THE_IMAGES:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            if _add_file(tar, dir_fd, name, rel_top, rel, budget):
                entries += 1
            continue
        try:
            child = os.open(name, _DIR_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError:
            continue  # swapped for a link or gone since the stat
        try:
            info = _info(rel, os.fstat(child))
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
            entries += 1
            if _opaque_fd(child):
                tar.addfile(_info(_join(rel, OPAQUE_MARKER), st))
                entries += 1
            entries += _walk(tar, child, rel, depth + 1, budget)
        finally:
            os.close(child)
    return entries


def _opaque_fd(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError:
        return False


def _add_file(
    tar: tarfile.TarFile, dir_fd: int, name: str, rel_top: str, rel: str, budget: _Budget
) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout
        tar.addfile(_info(_join(rel_top, WHITEOUT_PREFIX + name), st))
    elif stat.S_ISLNK(st.st_mode):
        info = _info(rel, st)
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dir_fd)
        tar.addfile(info)
    elif stat.S_ISREG(st.st_mode):
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
            )
        except OSError:
            return False  # swapped for a link or gone since the stat
        with os.fdopen(fd, "rb") as data:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode):
                return False
            budget.take(opened.st_size, rel)
            info = _info(rel, opened)
            info.size = opened.st_size
            tar.addfile(info, _Exactly(data, opened.st_size))
    elif stat.S_ISFIFO(st.st_mode):
        info = _info(rel, st)
        info.type = tarfile.FIFOTYPE
        tar.addfile(info)
    else:
        return False  # sockets and devices are not an image's
    return True


class _Exactly:
    """A file read as exactly `size` bytes (zeros past an end it shrank to meanwhile)."""

    def __init__(self, data: IO[bytes], size: int) -> None:
        self._data = data
        self._left = size

    def read(self, n: int = -1) -> bytes:
        want = self._left if n < 0 else min(n, self._left)
        chunk = self._data.read(want)
        if len(chunk) < want:
            chunk += bytes(want - len(chunk))
        self._left -= len(chunk)
        return chunk


def _join(top: str, name: str) -> str:
    return f"{top}/{name}" if top else name
