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

import contextlib
import hashlib
import os
import stat
import tarfile
from pathlib import Path

from sandgate.worker.layers import MODE_MASK, OPAQUE_MARKER, OPAQUE_XATTR, WHITEOUT_PREFIX

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


def _opaque(path: str) -> bool:
    with contextlib.suppress(OSError):
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    return False


def _info(name: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.mode = stat.S_IMODE(st.st_mode) & MODE_MASK
    info.mtime = int(st.st_mtime)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def export_upper(upper: Path, out: Path) -> tuple[str, int, int]:
    """Write the layer of `upper` to `out`; (sha256 digest, size, entries)."""
    entries = 0
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for top, dirs, files in os.walk(upper):
            rel_top = os.path.relpath(top, upper)
            rel_top = "" if rel_top == "." else rel_top
            dirs[:] = sorted(d for d in dirs if _join(rel_top, d) not in NOT_THE_IMAGES)
            for name in dirs:
                rel = _join(rel_top, name)
                full = os.path.join(top, name)
                st = os.lstat(full)
                info = _info(rel, st)
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                entries += 1
                if _opaque(full):
                    tar.addfile(_info(_join(rel, OPAQUE_MARKER), st))
                    entries += 1
            for name in sorted(files):
                rel = _join(rel_top, name)
                if rel in NOT_THE_IMAGES:
                    continue
                full = os.path.join(top, name)
                st = os.lstat(full)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout
                    tar.addfile(_info(_join(rel_top, WHITEOUT_PREFIX + name), st))
                elif stat.S_ISLNK(st.st_mode):
                    info = _info(rel, st)
                    info.type, info.linkname = tarfile.SYMTYPE, os.readlink(full)
                    tar.addfile(info)
                elif stat.S_ISREG(st.st_mode):
                    info = _info(rel, st)
                    info.size = st.st_size
                    with open(full, "rb") as data:
                        tar.addfile(info, data)
                elif stat.S_ISFIFO(st.st_mode):
                    info = _info(rel, st)
                    info.type = tarfile.FIFOTYPE
                    tar.addfile(info)
                else:
                    continue  # sockets and devices are not an image's
                entries += 1
    digest = hashlib.sha256()
    size = 0
    with open(out, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return "sha256:" + digest.hexdigest(), size, entries


def _join(top: str, name: str) -> str:
    return f"{top}/{name}" if top else name
