"""Exclusive leases of host uids for sandboxes.

Every bwrap sandbox runs as its own unprivileged host uid (and gid of the same number). A
uid is leased by taking ``flock(LOCK_EX | LOCK_NB)`` on ``<lock_dir>/<uid>.lock`` and keeping
the file descriptor open for the sandbox's life. The kernel drops the lock when the fd is
closed or its process dies, so a crashed worker's leases free themselves, and two worker
processes that share the lock directory never hand out the same uid.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from sandgate.errors import WorkerError


class UidLease:
    """One leased uid; `release()` (idempotent) gives it back."""

    __slots__ = ("_fd", "uid")

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only fd of the open file description drops the flock

    def __repr__(self) -> str:
        return f"UidLease(uid={self.uid}, held={self.held})"


class UidPool:
    """Leases uids from [base, base + count), exclusively across processes on one host."""

    def __init__(self, lock_dir: Path, base: int, count: int) -> None:
        if base < 1000 or count < 1:
            raise ValueError(f"bad uid range: base {base} (must be >= 1000), count {count}")
        if base + count > 2**32 - 2:
            raise ValueError(f"uid range {base}+{count} exceeds the 32-bit uid space")
        self.lock_dir = lock_dir
        self.base = base
        self.count = count
        self._next = 0  # round-robin start, so a freed uid is not reused at once
        self._held: dict[int, UidLease] = {}

    def ensure_dir(self) -> None:
        self.lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def held(self) -> set[int]:
        """Uids this pool object currently holds (leases of other processes are not listed)."""
        return {uid for uid, lease in self._held.items() if lease.held}

    def try_lease(self, uid: int) -> UidLease | None:
        """Lease exactly `uid`, or None when someone (this process included) holds it."""
        if not self.base <= uid < self.base + self.count:
            raise ValueError(f"uid {uid} outside [{self.base}, {self.base + self.count})")
        path = self.lock_dir / f"{uid}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        lease = UidLease(uid, fd)
        # replaces a released lease of this uid, if any: one entry per uid ever leased (at
        # most `count`), not rebuilt per lease (that cost a start ~0.4 ms at 1,000 held)
        self._held[uid] = lease
        return lease

    def lease(self) -> UidLease:
        """Lease a free uid; WorkerError when all `count` are taken."""
        try:
            self.ensure_dir()
        except OSError as exc:
            raise WorkerError(
                f"cannot create the uid lock directory {self.lock_dir}: {exc}"
            ) from exc
        for i in range(self.count):
            uid = self.base + (self._next + i) % self.count
            if uid in self._held and self._held[uid].held:
                continue
            try:
                lease = self.try_lease(uid)
            except OSError as exc:
                raise WorkerError(f"cannot lock {self.lock_dir}/{uid}.lock: {exc}") from exc
            if lease is not None:
                self._next = (uid - self.base + 1) % self.count
                return lease
        raise WorkerError(
            f"all {self.count} sandbox uids [{self.base}, {self.base + self.count}) are in use"
        )
