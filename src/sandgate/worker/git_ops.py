"""The worker's `workspace_git` operation: its fields read into one call on a workspace's
history (`git_history.py`), answered as JSON. The control plane checked the caller and holds
the workspace's lock; the worker checks the owner again (`workspaces.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from sandgate.agent.frames import Header
from sandgate.core.workspaces import author_email
from sandgate.errors import InvalidRequestError
from sandgate.worker.git_history import Author, GitHistory

WORKSPACE_OPS: Final = frozenset({"workspace_create", "workspace_delete", "workspace_git"})
MAX_LOG_PAGE: Final = 500

Work = Callable[[GitHistory], dict[str, Any]]


def git_work(header: Header) -> Work:
    """What `workspace_git` asks: commit {message, sandbox?}, log {limit, start?}, show {rev},
    restore {rev, sandbox?}."""
    owner = str(header.get("owner", ""))
    author = Author(owner, author_email(owner))
    sandbox = header.get("sandbox")
    trailers = {"Sandgate-Tenant": owner}
    if isinstance(sandbox, str) and sandbox:
        trailers["Sandgate-Sandbox"] = sandbox
    action = header.get("action")
    if action == "commit":
        message = str(header.get("message") or "")
        return lambda git: git.commit(message, author, trailers=trailers).to_json()
    if action == "restore":
        rev = _rev(header)
        return lambda git: git.restore(rev, author, trailers=trailers).to_json()
    if action == "show":
        rev = _rev(header)
        return lambda git: git.show(rev).to_json()
    if action == "log":
        limit = header.get("limit", 50)
        start = header.get("start")
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LOG_PAGE:
            raise InvalidRequestError(f"limit must be 1 to {MAX_LOG_PAGE}")
        if start is not None and not isinstance(start, str):
            raise InvalidRequestError("start must be a commit sha")

        def log(git: GitHistory) -> dict[str, Any]:
            commits, after = git.log(limit=limit, start=start)
            return {"commits": [c.to_json() for c in commits], "next": after}

        return log
    raise InvalidRequestError(f"unknown workspace action {action!r}")


def _rev(header: Header) -> str:
    rev = header.get("rev")
    if not isinstance(rev, str) or not rev:
        raise InvalidRequestError("name the commit (its sha)")
    return rev
