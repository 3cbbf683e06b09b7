"""Sandbox paths onto the real filesystem (docs/agent-protocol.md, "Paths"), and OS errors.

A sandbox's own filesystem is its roots, ``(sandbox root, real directory)`` pairs held by the
agent's state; nothing here leaks a host path into an answer.
"""

from __future__ import annotations

import os
import posixpath

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

if TYPE_CHECKING:
    from typing import Any

    from sandgate.agent.entries import ERRNO_CODES, entry, sandbox_path
    from sandgate.agent.request import AgentError, Header
else:
    from entries import ERRNO_CODES, entry, sandbox_path
    from request import AgentError

Roots = tuple[tuple[str, str], ...]

SANDBOX_ROOTS = ("/workspace", "/tmp")


class Target:
    """A checked path: its sandbox view and where it really is."""

    __slots__ = ("is_root", "real", "root", "spath")

    def __init__(self, spath: str, real: str, root: str, is_root: bool) -> None:
        self.spath = spath  # normalised, as the sandbox sees it (/workspace/...)
        self.real = real  # the path to use with the OS
        self.root = root  # real directory of the root it is under
        self.is_root = is_root

    def __repr__(self) -> str:
        return f"Target({self.spath!r}, real={self.real!r}, is_root={self.is_root})"


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
    spath = sandbox_path(value)
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


def lstat(target: Target) -> os.stat_result | None:
    try:
        return os.lstat(target.real)
    except FileNotFoundError:
        return None


def lstat_entry(target: Target) -> Header:
    return entry(target.spath, os.lstat(target.real))
