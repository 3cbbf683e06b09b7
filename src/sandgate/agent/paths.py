"""Sandbox paths onto the real filesystem (docs/agent-protocol.md, "Paths"), and entries.

A sandbox's own filesystem is its roots, ``(sandbox root, real directory)`` pairs held by the
agent's state; nothing here leaks a host path into an answer.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from sandgate.agent.request import AgentError, Header
else:
    from request import AgentError

Roots = tuple[tuple[str, str], ...]

SANDBOX_ROOTS = ("/workspace", "/tmp")

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


class Target(NamedTuple):
    """A checked path: its sandbox view and where it really is."""

    spath: str  # normalised, as the sandbox sees it (/workspace/...)
    real: str  # the path to use with the OS
    root: str  # real directory of the root it is under
    is_root: bool


def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def outside(value: str) -> AgentError:
    return AgentError("path_outside_sandbox", f"{value!r} is outside the sandbox's filesystem")


def resolve(roots: Roots, value: Any, *, follow: bool = False, name: str = "path") -> Target:
    """Map a sandbox path onto the real filesystem, refusing anything that leaves a root.

    Every component but the last is resolved (symlinks followed) and must stay inside the
    root. The last one is followed only when ``follow`` is true (open, list, cwd); otherwise
    a symlink there is the object itself (stat, remove, move, mkdir).
    """
    if not isinstance(value, str) or not value:
        raise AgentError("invalid_request", f"{name!r} must be a non-empty string")
    if "\x00" in value:
        raise AgentError("invalid_request", f"{name!r} contains a NUL byte")
    if not value.startswith("/"):
        value = "/workspace/" + value
    spath = posixpath.normpath(value)
    if spath.startswith("//"):
        spath = "/" + spath.lstrip("/")
    for sroot, rroot in roots:
        if spath == sroot:
            return Target(spath, rroot, rroot, True)
        if sroot == "/" or spath.startswith(sroot + "/"):  # "/": a template sandbox's root
            break
    else:  # in none of the roots: say which there are
        places = " or ".join(sroot for sroot, _ in roots)
        raise AgentError(
            "path_outside_sandbox",
            f"{value!r} is outside the sandbox's filesystem: use a path under {places}",
        )
    real = posixpath.join(rroot, spath[len(sroot) :].lstrip("/"))
    parent = os.path.realpath(posixpath.dirname(real))
    if not inside(parent, rroot):
        raise outside(value)
    real = posixpath.join(parent, posixpath.basename(real))
    if follow and os.path.islink(real):
        real = os.path.realpath(real)
        if not inside(real, rroot):
            raise outside(value)
    return Target(spath, real, rroot, False)


def to_sandbox(roots: Roots, real: str) -> str:
    """The sandbox view of a real path, for error messages (never leaks host paths)."""
    for sroot, rroot in roots:
        if inside(real, rroot):
            return sroot + real[len(rroot) :]
    return posixpath.basename(real)


def os_error(roots: Roots, exc: OSError) -> AgentError:
    code = ERRNO_CODES.get(exc.errno or 0, "io_error")
    message = exc.strerror or str(exc)
    for filename in (exc.filename, exc.filename2):
        if isinstance(filename, str):
            message += f": {to_sandbox(roots, filename)}"
    return AgentError(code, message)


def iso_mtime(mtime_ns: int) -> str:
    seconds, nanos = divmod(mtime_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos // 1000:06d}Z"


def entry(spath: str, st: os.stat_result) -> Header:
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


def lstat(target: Target) -> os.stat_result | None:
    try:
        return os.lstat(target.real)
    except FileNotFoundError:
        return None


def lstat_entry(target: Target) -> Header:
    return entry(target.spath, os.lstat(target.real))


# an upload is written beside its destination under this name, renamed onto it when complete
_UPLOAD_TEMP = re.compile(r"\..+\.sandgate-[0-9a-f]{12}", re.DOTALL)


def upload_temp_name(target_real: str) -> str:
    directory, name = posixpath.split(target_real)
    return posixpath.join(directory, f".{name[:200]}.sandgate-{os.urandom(6).hex()}")


def is_upload_temp(name: str) -> bool:
    """Whether a directory entry is an upload in progress (watches do not report those)."""
    return _UPLOAD_TEMP.fullmatch(posixpath.basename(name)) is not None
