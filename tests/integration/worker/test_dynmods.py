"""The worker turns on the host's cgroup2 option favordynmods (worker/dynmods.py), keeping
every other option of the hierarchy and the mount's own flags, and says why where it cannot."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from sandgate.worker import dynmods
from tests.integration.worker.conftest import Env, other_runtime

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]
FEATURES = Path("/sys/kernel/cgroup/features")


def cgroup2_line() -> tuple[str, list[str]]:
    """The cgroup2 mount's own flags and its superblock options, from mountinfo."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            return left.split()[5], right.split()[2].split(",")
    raise AssertionError("no cgroup2 mount on this host")


@pytest.mark.skipif(
    not FEATURES.exists() or "favordynmods" not in FEATURES.read_text().split(),
    reason="needs Linux 6.1+ (the cgroup2 option favordynmods)",
)
def test_prepare_turns_favordynmods_on_and_keeps_the_rest(env: Env) -> None:
    flags_before, options_before = cgroup2_line()
    rt = other_runtime(env)
    asyncio.run(rt.prepare())
    try:
        flags_after, options_after = cgroup2_line()
        assert "favordynmods" in options_after
        assert set(options_before) <= set(options_after)
        assert set(options_after) - set(options_before) <= {"favordynmods"}
        assert flags_after == flags_before  # nosuid, nodev, ...: the mount is not touched
        assert dynmods.favor() is None  # on: a second worker changes nothing
        assert cgroup2_line() == (flags_after, options_after)
    finally:
        asyncio.run(rt.close())


def test_a_failed_reconfigure_is_reported_and_changes_nothing(tmp_path: Path) -> None:
    """fspick refuses a directory that is not the root of a mount: the worker gets the
    reason, in words, and the host's cgroup2 options stay as they were."""
    before = cgroup2_line()
    mountinfo, features = tmp_path / "mountinfo", tmp_path / "features"
    mountinfo.write_text(f"41 31 0:38 / {tmp_path} rw,relatime - cgroup2 cgroup2 rw,nsdelegate\n")
    features.write_text("favordynmods\n")
    assert dynmods.favor(mountinfo, features) == (
        f"cannot set favordynmods on {tmp_path}: Invalid argument"
    )
    assert cgroup2_line() == before
