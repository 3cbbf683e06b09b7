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


def _opaque(name: str, dir_fd: int) -> bool:
    fd = -1
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def _info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode) & MODE_MASK
    info.mtime = int(st.st_mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def export_upper(upper: Path, out: Path) -> tuple[str, int, int]:
    """Write the layer of `upper` to `out`; (sha256 digest, size, entries).

    The upper directory is the sandbox's, and a process of it may still run: it is walked
    with directory descriptors (`os.fwalk`), never through a symlink, and each file is
    opened relative to its directory with ``O_NOFOLLOW`` and checked after it is open, so
    nothing outside `upper` is ever read, whatever is swapped in during the walk."""
    entries = 0
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for top, dirs, files, top_fd in os.fwalk(upper, follow_symlinks=False):
            rel_top = os.path.relpath(top, upper)
            rel_top = "" if rel_top == "." else rel_top
            dirs[:] = sorted(d for d in dirs if _join(rel_top, d) not in NOT_THE_IMAGES)
            for name in dirs:
                rel = _join(rel_top, name)
                try:
                    st = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue  # swapped while walking: fwalk will not enter it either
                info = _info(rel, st)
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                entries += 1
                if _opaque(name, top_fd):
                    tar.addfile(_info(_join(rel, OPAQUE_MARKER), st))
                    entries += 1
            for name in sorted(files):
                rel = _join(rel_top, name)
                if rel in NOT_THE_IMAGES:
                    continue
                if _add_file(tar, top_fd, name, rel_top, rel):
                    entries += 1
    digest = hashlib.sha256()
    size = 0
    with open(out, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return "sha256:" + digest.hexdigest(), size, entries


def _add_file(tar: tarfile.TarFile, dir_fd: int, name: str, rel_top: str, rel: str) -> bool:
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
