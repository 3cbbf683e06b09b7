"""Unpack one image layer (a tar stream) into a directory overlayfs can stack.

An OCI layer says "delete X" with an empty ``.wh.X`` entry and "this directory replaces the
one below" with ``.wh..wh..opq``. overlayfs says the same with a character device 0:0 named
X and the ``trusted.overlay.opaque=y`` attribute: each is converted as it is read, so the
layers are used as they are, one lower directory each, never flattened or copied.

The tar is untrusted and the worker is root, so nothing in it is followed: every directory
is opened from the layer's root one component at a time with ``O_NOFOLLOW`` (a symlink met
on the way is an error, never a way out), names holding ``..`` are refused, and members are
created relative to the directory descriptor. Ownership is squashed to root (the sandbox
sees it through an idmapped mount as its own uid, `idmap.py`); set-uid/gid bits and device
nodes are dropped: nothing in a sandbox may gain a privilege from its image.

Blocking: call `unpack` in a thread.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sandgate.agent import entries
from sandgate.core.layer_rules import LayerRuleError as LayerError  # re-exported
from sandgate.core.layer_rules import Tally, member_parts
from sandgate.errors import InvalidRequestError

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
MODE_MASK = 0o1777  # no set-uid, no set-gid
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 20


@dataclass
class UnpackStats:
    files: int = 0
    bytes: int = 0
    whiteouts: int = 0
    skipped_devices: int = 0


def layer_name(digest: str) -> str:
    """The directory name of a layer in the store: the hex of its sha256 digest."""
    algorithm, _, hexdigest = digest.partition(":")
    if (
        algorithm != "sha256"
        or len(hexdigest) != 64
        or not all(c in "0123456789abcdef" for c in hexdigest)
    ):
        raise InvalidRequestError(f"bad layer digest {digest!r}: want sha256:<64 hex>")
    return hexdigest


def unpack(stream: IO[bytes], dest: Path, *, max_bytes: int = 1 << 62) -> UnpackStats:
    """Unpack the (uncompressed or gzip) tar read from `stream` into the empty `dest`; its
    files add up to at most `max_bytes` (`layer_rules.max_unpacked`)."""
    stats = UnpackStats()
    tally = Tally(max_bytes)
    root_fd = os.open(dest, _DIR_FLAGS)
    try:
        try:
            with tarfile.open(fileobj=stream, mode="r|*") as tar:
                for member in tar:
                    _unpack_member(tar, member, tally.add(member), root_fd, stats)
        except (
            tarfile.TarError,
            EOFError,
            OSError,
            UnicodeError,
            zlib.error,
            ValueError,
            OverflowError,
            RecursionError,
        ) as exc:
            if isinstance(exc, InvalidRequestError):
                raise
            raise LayerError(f"the layer cannot be read: {exc}") from None
    finally:
        os.close(root_fd)
    return stats


def _unpack_member(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    parts: list[str],
    root_fd: int,
    stats: UnpackStats,
) -> None:
    if not parts:
        return  # the root itself
    *parents, leaf = parts
    parent_fd = open_dir(root_fd, parents, create=True)
    try:
        if leaf == OPAQUE_MARKER:
            os.setxattr(f"/proc/self/fd/{parent_fd}", OPAQUE_XATTR, b"y")
            stats.whiteouts += 1
            return
        if leaf.startswith(WHITEOUT_PREFIX):
            target = leaf[len(WHITEOUT_PREFIX) :]
            if target in ("", ".", ".."):  # it would delete the directory, or its parent
                raise LayerError(f"layer member {member.name!r} is not a whiteout of a name")
            _remove(parent_fd, target)
            os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=parent_fd)
            stats.whiteouts += 1
            return
        mode = member.mode & MODE_MASK
        if member.isdir():
            with contextlib.suppress(FileExistsError):
                os.mkdir(leaf, 0o700, dir_fd=parent_fd)
            st = os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                _remove(parent_fd, leaf)
                os.mkdir(leaf, 0o700, dir_fd=parent_fd)
            os.chmod(leaf, mode, dir_fd=parent_fd, follow_symlinks=False)
            return
        _remove(parent_fd, leaf)  # a later entry of the same path replaces the earlier
        if member.isreg():
            source = tar.extractfile(member)
            if source is None:  # pragma: no cover - a regular member always has data
                raise LayerError(f"layer member {member.name!r} has no data")
            fd = os.open(
                leaf,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=parent_fd,
            )
            try:
                while chunk := source.read(_COPY_CHUNK):
                    entries.write_all(fd, chunk)
                os.fchmod(fd, mode)
                os.utime(fd, (member.mtime, member.mtime))
            finally:
                os.close(fd)
            stats.files += 1
            stats.bytes += member.size
        elif member.issym():
            os.symlink(member.linkname, leaf, dir_fd=parent_fd)
        elif member.islnk():
            *link_parents, link_leaf = member_parts(member.linkname) or [""]
            if not link_leaf:
                raise LayerError(f"layer member {member.name!r} links to the root")
            source_fd = open_dir(root_fd, link_parents, create=False)
            try:
                os.link(
                    link_leaf,
                    leaf,
                    src_dir_fd=source_fd,
                    dst_dir_fd=parent_fd,
                    follow_symlinks=False,
                )
            except FileNotFoundError:
                raise LayerError(
                    f"layer member {member.name!r} is a hard link to {member.linkname!r}, "
                    "which is not in the same layer"
                ) from None
            finally:
                os.close(source_fd)
        elif member.isfifo():
            os.mkfifo(leaf, mode, dir_fd=parent_fd)
        else:  # character and block devices: never in a sandbox (/dev is its own)
            stats.skipped_devices += 1
    finally:
        os.close(parent_fd)


def open_dir(root_fd: int, parts: list[str], *, create: bool) -> int:
    """A descriptor of root/parts..., each component opened without following a link."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError:  # ELOOP (a symlink) or ENOTDIR (a file)
                raise LayerError(
                    f"layer path component {part!r} is not a directory (a symlink or a file): "
                    "nothing is unpacked through a link"
                ) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove(parent_fd: int, name: str) -> None:
    """Remove `name` below `parent_fd` if present (a whole tree for a directory)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        for child in os.listdir(fd):
            _remove(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


__all__ = ("LayerError", "UnpackStats", "layer_name", "open_dir", "unpack")
