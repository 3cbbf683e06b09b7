"""What a file is on the wire, the codes of OS errors, the name an upload is written under,
and a whole read and write of a descriptor: shared by the agent (`paths.py`, `files.py`) and
the worker's own file path (`sandgate.worker.disk_files`), so both answer alike.

Standard library only and no flat imports: deployed beside the agent and imported by the
worker as ``sandgate.agent.entries``.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
import time
from types import MappingProxyType

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from typing import Any

MAX_READ_LENGTH = 4 << 20  # bytes one read (or an open's `first`) may ask for

ERRNO_CODES = MappingProxyType(
    {
        errno.ENOENT: "not_found",
        errno.ENOTDIR: "not_a_directory",
        errno.EISDIR: "is_a_directory",
        errno.EEXIST: "exists",
        errno.ENOTEMPTY: "directory_not_empty",
        errno.EACCES: "permission_denied",
        errno.EPERM: "permission_denied",
        errno.EROFS: "permission_denied",
        errno.EINVAL: "invalid_request",
        errno.ENAMETOOLONG: "invalid_request",
        errno.ENOSPC: "storage_full",  # the worker names the sandbox's quota
        errno.EDQUOT: "storage_full",
    }
)


def sandbox_path(value: str) -> str:
    """A path as the sandbox means it: a relative one under /workspace, normalised (no `.`,
    `..` or repeated slashes)."""
    if not value.startswith("/"):
        value = "/workspace/" + value
    spath = posixpath.normpath(value)
    if spath.startswith("//"):
        spath = "/" + spath.lstrip("/")
    return spath


def iso_mtime(mtime_ns: int) -> str:
    seconds, nanos = divmod(mtime_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos // 1000:06d}Z"


def entry(spath: str, st: os.stat_result) -> dict[str, Any]:
    """A file's entry as answers carry it: `spath` is its path as the sandbox sees it."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        kind = "file"
    elif stat.S_ISDIR(mode):
        kind = "dir"
    elif stat.S_ISLNK(mode):
        kind = "symlink"
    else:
        kind = "other"
    return {
        "name": posixpath.basename(spath),
        "path": spath,
        "type": kind,
        "size": st.st_size,
        "mode": f"{stat.S_IMODE(mode):04o}",
        "mtime": iso_mtime(st.st_mtime_ns),
    }


# an upload is written beside its destination under this name, renamed onto it when complete
_UPLOAD_TEMP = re.compile(r"\..+\.sandgate-[0-9a-f]{12}", re.DOTALL)


def upload_temp_name(target: str) -> str:
    """The temp file an upload to `target` is written to, in the same directory (a name
    alone gives a name alone)."""
    directory, name = posixpath.split(target)
    return posixpath.join(directory, f".{name[:200]}.sandgate-{os.urandom(6).hex()}")


def is_upload_temp(name: str) -> bool:
    """Whether a directory entry is an upload in progress (watches do not report those)."""
    return _UPLOAD_TEMP.fullmatch(posixpath.basename(name)) is not None


def not_readable(opened: os.stat_result, spath: str) -> tuple[str, str] | None:
    """Why an opened file is not served for reading (error code, message), or None: only
    regular files are."""
    if stat.S_ISDIR(opened.st_mode):
        return "is_a_directory", f"{spath} is a directory"
    if not stat.S_ISREG(opened.st_mode):
        return "invalid_request", f"{spath} is not a regular file"
    return None


def read_up_to(fd: int, length: int, offset: int | None = None) -> bytes:
    """Up to `length` bytes from `fd` (at `offset`, or at its position): fewer only at its
    end."""
    chunks: list[bytes] = []
    remaining = length
    while remaining:
        if offset is None:
            chunk = os.read(fd, remaining)
        else:
            chunk = os.pread(fd, remaining, offset + length - remaining)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    """All of `data` to `fd` (at `offset`, or at its position)."""
    view = memoryview(data)
    while view:
        if offset is None:
            view = view[os.write(fd, view) :]
        else:
            done = os.pwrite(fd, view, offset + len(data) - len(view))
            view = view[done:]
