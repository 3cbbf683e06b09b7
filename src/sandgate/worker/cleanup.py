"""Removing a sandbox's files, whatever its tenant left in them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sandgate.errors import WorkerError


def remove_tree(path: Path) -> None:
    """Delete `path` and everything below it. Blocking: call it in a thread.

    `rm -rf` walks the tree without recursion (Python 3.11's shutil.rmtree recurses and
    fails on a directory a tenant nested a few thousand levels deep), never follows
    symlinks, and stays on one file system, so a mount inside cannot take it elsewhere.
    """
    if not path.is_symlink() and not path.exists():
        return
    done = subprocess.run(
        ["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True, text=True
    )
    if path.is_symlink() or path.exists():
        raise WorkerError(f"could not remove {path}: {done.stderr.strip() or done.returncode}")
