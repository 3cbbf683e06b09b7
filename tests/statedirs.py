"""Removing a test worker's state directory, mounts included.

A worker that was killed (the tests SIGKILL some on purpose) leaves its sandboxes' disk
images mounted; a real worker unmounts them at its next start, but a test's state directory
is never started again. Unmount first, or `rmtree` empties the mounted file systems, cannot
remove their mount points, and every one keeps a loop device attached.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from sandgate.worker import disk
from sandgate.worker.main import runtime_scope
from sandgate.worker.netns import NetHost

TEST_ROOTS = ("/var/lib/sandgate-test*", "/var/lib/sandgate-up*")


@contextlib.contextmanager
def held_as_live(path: Path) -> Iterator[None]:
    """Hold `path/worker.lock` as a running worker holds its state dir's, so that another
    session's end leaves the mounts below `path` alone (`unmount_test_leftovers`)."""
    fd = os.open(path / "worker.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_state(path: Path) -> None:
    disk.unmount_leftovers(path)
    remove_network_leftovers(path)
    shutil.rmtree(path, ignore_errors=True)


def remove_network_leftovers(path: Path) -> None:
    """The network namespaces, links and nftables table of every worker whose state dir is
    below `path` (a SIGKILLed worker leaves them, and a test's worker never starts again)."""
    if not path.is_dir() or shutil.which("ip") is None or shutil.which("nft") is None:
        return
    for worker_dir in path.iterdir():
        if worker_dir.is_dir():
            net = NetHost(runtime_scope(worker_dir.name, worker_dir))
            asyncio.run(net.close())


def unmount_test_leftovers() -> None:
    """Unmount what the suite's dead workers left mounted below the test state roots. A mount
    below a worker that still runs (its state dir's lock is held: another test session on
    this machine, or a CI run beside this one) is left alone: taking it away once pulled a
    live worker's sandbox disks and workspaces from under it."""
    for pattern in TEST_ROOTS:
        for root in Path("/").glob(pattern.lstrip("/")):
            for point in disk.mounts_below(root):
                if not _below_a_live_worker(point, root):  # deepest first: plain, else lazy
                    done = subprocess.run(["umount", str(point)], capture_output=True)
                    if done.returncode != 0:
                        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _below_a_live_worker(point: Path, root: Path) -> bool:
    for parent in point.parents:
        lock = parent / "worker.lock"
        if lock.exists():
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            finally:
                os.close(fd)
            return False
        if parent == root:
            return False
    return False
