"""Workspaces, the rules alone: names, where a sandbox mounts them, their quota, the key of
their deployment-wide lock. Pure: the API checks requests with these, the worker checks the
provision it is given with the same ones (it never trusts a filter it did not apply).

A workspace is a tenant's directory tree that outlives sandboxes, with a git history
(`worker/git_history.py`). A sandbox mounts it read-write at `/workspace` by default, or at
a path of its choosing under one of `MOUNT_ROOTS`; several per sandbox, never one inside
another.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sandgate.errors import InvalidRequestError, ResourceCapError

DEFAULT_MOUNT: Final = "/workspace"
MOUNT_ROOTS: Final = ("workspace", "mnt", "home", "data", "srv", "work")
MAX_MOUNTS: Final = 8
MIN_QUOTA_MB: Final = 16
DEFAULT_QUOTA_MB: Final = 1024
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")  # whole strings only: fullmatch
_PART = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ID = re.compile(r"ws-[0-9a-f]{20}")


@dataclass(frozen=True)
class WorkspaceMount:
    name: str  # the tenant's name for it
    path: str  # where the sandbox sees it

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "path": self.path}


@dataclass(frozen=True)
class ResolvedMount:
    """A mount the control plane resolved from the credential: what a provision carries.
    The worker mounts `id` only if the owner recorded with the workspace is `owner`."""

    id: str
    name: str
    path: str
    owner: str

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "name": self.name, "path": self.path, "owner": self.owner}


def new_workspace_id() -> str:
    return "ws-" + uuid.uuid4().hex[:20]


def check_id(value: Any) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidRequestError(f"{value!r} is not a workspace id (ws- and 20 hex digits)")
    return value


def check_name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidRequestError(
            f"workspace name {value!r} is not valid: use 1-63 lowercase letters, digits, '.', "
            "'_' or '-', starting with a letter or digit"
        )
    return value


def check_quota(value: Any, *, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError("quota_mb must be a whole number of MiB")
    if value < MIN_QUOTA_MB:
        raise InvalidRequestError(f"quota_mb must be at least {MIN_QUOTA_MB}")
    if value > most:
        raise ResourceCapError(
            f"quota_mb {value} is above this deployment's limit of {most} MiB per workspace; "
            f"ask for at most {most}",
            cap="max_workspace_mb",
            value=most,
        )
    return value


def check_mount_path(value: Any) -> str:
    """An absolute, normalised path below one of MOUNT_ROOTS (or /workspace itself)."""
    if not isinstance(value, str) or not value.startswith("/") or value.startswith("//"):
        raise InvalidRequestError(f"mount path {value!r} must be an absolute path")
    parts = value.strip("/").split("/")
    if posixpath.normpath(value) != value or not all(_PART.fullmatch(p) for p in parts):
        raise InvalidRequestError(
            f"mount path {value!r} must be normalised, of letters, digits, '.', '_', '-'"
        )
    if any(p in (".", "..") for p in parts):
        raise InvalidRequestError(f"mount path {value!r} must not hold '.' or '..'")
    if parts[0] not in MOUNT_ROOTS or (value != DEFAULT_MOUNT and len(parts) < 2):
        roots = ", ".join("/" + r for r in MOUNT_ROOTS[1:])
        raise InvalidRequestError(
            f"mount path {value!r} is not allowed: use /workspace, or a directory below "
            f"/workspace, {roots}"
        )
    return value


def _inside(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer + "/")


def parse_mounts(workspace: Any, workspaces: Any) -> tuple[WorkspaceMount, ...]:
    """A create's `workspace` (a name, at /workspace) and `workspaces` ([{name, path}] or a
    {path: name} map, E2B's volume_mounts shape), checked together."""
    found: list[WorkspaceMount] = []
    if workspace is not None:
        found.append(WorkspaceMount(check_name(workspace), DEFAULT_MOUNT))
    items: Sequence[Any]
    if workspaces is None:
        items = ()
    elif isinstance(workspaces, Mapping):
        items = [{"path": path, "name": name} for path, name in workspaces.items()]
    elif isinstance(workspaces, list | tuple):
        items = workspaces
    else:
        raise InvalidRequestError("workspaces must be a list of {name, path}")
    for item in items:
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, Mapping) or set(item) - {"name", "path"}:
            raise InvalidRequestError("each of workspaces is {name, path} (path optional)")
        found.append(
            WorkspaceMount(
                check_name(item.get("name")), check_mount_path(item.get("path", DEFAULT_MOUNT))
            )
        )
    if len(found) > MAX_MOUNTS:
        raise InvalidRequestError(f"a sandbox mounts at most {MAX_MOUNTS} workspaces")
    for i, a in enumerate(found):
        for b in found[i + 1 :]:
            if a.name == b.name:
                raise InvalidRequestError(f"workspace {a.name} is mounted twice; mount it once")
            if _inside(a.path, b.path) or _inside(b.path, a.path):
                raise InvalidRequestError(
                    f"mount paths {a.path} and {b.path} overlap; give each workspace its own "
                    "directory"
                )
    return tuple(found)


def lock_key(workspace_id: str) -> int:
    """The PostgreSQL advisory lock key of a workspace: a signed 64-bit hash of its id."""
    digest = hashlib.sha256(b"sandgate-workspace:" + workspace_id.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def author_email(tenant: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", tenant) or "tenant"
    return f"{safe}@tenants.sandgate"
