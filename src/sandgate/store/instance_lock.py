"""SQLite serves one API instance: a second one on the same file refuses to start.

The lock is an flock on `<database>.instance.lock`, held for the life of the server process
and released by the kernel when it dies, so a crash never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os

from sandgate.errors import ConflictError
from sandgate.store.migrate import _sqlite_file, async_url


def hold_instance_lock(url: str) -> int | None:
    """Take the instance lock of a SQLite database; None for PostgreSQL (any number)."""
    path = _sqlite_file(async_url(url))
    if path is None:
        return None
    lock_path = f"{path}.instance.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConflictError(
            f"another sandgate server already runs on {path}: SQLite serves one instance; "
            "use PostgreSQL (--db postgresql://...) to run several"
        ) from None
    return fd


def release_instance_lock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
