"""Removing a test worker's state directory, mounts included.

A worker that was killed (the tests SIGKILL some on purpose) leaves its sandboxes' disk
images mounted; a real worker unmounts them at its next start, but a test's state directory
is never started again. Unmount first, or `rmtree` empties the mounted file systems, cannot
remove their mount points, and every one keeps a loop device attached.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sandgate.worker import disk

TEST_ROOTS = ("/var/lib/sandgate-test*", "/var/lib/sandgate-up*")


def remove_state(path: Path) -> None:
    disk.unmount_leftovers(path)
    shutil.rmtree(path, ignore_errors=True)


def unmount_test_leftovers() -> None:
    """Unmount whatever the suite's workers left mounted below the test state roots."""
    for pattern in TEST_ROOTS:
        for root in Path("/").glob(pattern.lstrip("/")):
            disk.unmount_leftovers(root)
