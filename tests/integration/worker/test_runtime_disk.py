"""Disk quotas and descriptor bounds of the bwrap runtime, enforced by the real kernel
(issue 10, points 2 and 5): a sandbox writing past its quota gets ENOSPC inside while the
host loses at most the quota; the inode cap holds; nothing stays mounted after a stop or a
crash; every process's RLIMIT_NOFILE keeps the sandbox within its share of file-max."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from sandgate.worker import disk, fds
from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.runtime.bwrap import BwrapRuntime
from sandgate.worker.spawner import SpawnedProcess
from tests.integration.worker.conftest import Env, other_runtime
from tests.integration.worker.test_runtime_bwrap import py, readline, run, uniq

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]

FILL = """
import errno, json, os, sys
path, chunk = sys.argv[1], b"x" * (1 << 20)
written, error = 0, None
try:
    with open(path, "wb") as f:
        while written < int(sys.argv[2]):
            f.write(chunk)
            f.flush()
            written += 1
        os.fsync(f.fileno())
except OSError as exc:
    error = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps({"written_mb": written, "error": error}), flush=True)
"""


def loops_of(image: Path) -> str:
    return subprocess.run(
        ["losetup", "-j", str(image)], capture_output=True, text=True
    ).stdout.strip()


def test_the_runtime_reports_a_disk_quota_only_because_it_holds_here(rt: BwrapRuntime) -> None:
    assert rt.features()["disk_quota"] is True
    assert rt.features()["disk_quota_inodes_per_mb"] == disk.INODES_PER_MB


def test_writing_past_the_quota_stops_inside_and_the_host_loses_at_most_the_quota(
    rt: BwrapRuntime,
) -> None:
    before = os.statvfs(rt.state_dir)
    spec = SandboxSpec(name=uniq("dd"), disk_mb=64)

    async def scenario() -> tuple[dict[str, object], int]:
        sb = await rt.start(spec, argv=py(FILL, "/workspace/big", "500"))
        try:
            line = await readline(sb, wait_s=60)
            image = sb.private["sandbox_dir"] / disk.IMAGE_NAME
            held = os.stat(image).st_blocks * 512  # what the host really gave the image
            return json.loads(line), held
        finally:
            await rt.stop(sb)

    got, held = asyncio.run(scenario())
    assert got["error"] == "ENOSPC", got
    assert 40 <= int(str(got["written_mb"])) < 64, got
    assert held <= 64 << 20
    after = os.statvfs(rt.state_dir)
    lost = (before.f_bavail - after.f_bavail) * after.f_frsize
    assert lost < 64 << 20  # the image is gone again; at worst it held the quota


def test_workspace_and_tmp_share_one_quota(rt: BwrapRuntime) -> None:
    code = """
    import errno, json
    out = {}
    for path in ("/tmp/a", "/workspace/b"):
        n = 0
        try:
            with open(path, "wb") as f:
                for n in range(1, 41):
                    f.write(b"y" * (1 << 20))
                    f.flush()
        except OSError as exc:
            out[path] = [n, errno.errorcode[exc.errno]]
        else:
            out[path] = [n, None]
    print(json.dumps(out))
    """
    got = run(rt, py(code), SandboxSpec(name=uniq("tmp"), disk_mb=64)).json()
    assert got["/tmp/a"] == [40, None], got
    assert got["/workspace/b"][1] == "ENOSPC" and got["/workspace/b"][0] < 40, got


def test_the_inode_cap_stops_a_file_flood(rt: BwrapRuntime) -> None:
    code = """
    import errno, json, os
    made, error = 0, None
    try:
        while made < 100_000:
            os.close(os.open(f"/workspace/f{made}", os.O_CREAT | os.O_WRONLY, 0o600))
            made += 1
    except OSError as exc:
        error = errno.errorcode[exc.errno]
    print(json.dumps({"made": made, "error": error}))
    """
    got = run(rt, py(code), SandboxSpec(name=uniq("ino"), disk_mb=64)).json()
    assert got["error"] == "ENOSPC", got
    assert got["made"] <= disk.inodes_for(64), got


def gone_within(image: Path, seconds: float = 5.0) -> bool:
    """Whether the image's loop device detaches itself (its last user gone) in time."""
    deadline = time.monotonic() + seconds
    while loops_of(image):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_the_disk_is_mounted_in_the_sandboxs_namespace_alone_and_a_stop_detaches_it(
    rt: BwrapRuntime,
) -> None:
    async def scenario() -> tuple[Path, Path, str, list[Path], str]:
        # alive until the stop: a process that has exited has no mount table to read (EINVAL)
        up = "import time; print('up', flush=True); time.sleep(120)"
        sb = await rt.start(SandboxSpec(name=uniq("um")), argv=py(up))
        sandbox_dir: Path = sb.private["sandbox_dir"]
        image = sandbox_dir / disk.IMAGE_NAME
        await readline(sb)
        theirs = await asyncio.to_thread(Path(f"/proc/{sb.process.pid}/mountinfo").read_text)
        ours = disk.mounts_below(sandbox_dir)
        loop = loops_of(image)
        await rt.stop(sb)
        return sandbox_dir, image, theirs, ours, loop

    sandbox_dir, image, theirs, ours, loop = asyncio.run(scenario())
    assert loop  # a loop-mounted file system of its own...
    assert f" {sandbox_dir / disk.MOUNT_NAME} " in theirs, theirs
    assert ours == []  # ...in the sandbox's mount table, not the worker's: starts copy that
    assert not sandbox_dir.exists()
    assert gone_within(image)


def test_a_template_sandboxs_disk_is_attached_for_its_overlay_and_unmounted_at_stop(
    rt: BwrapRuntime,
) -> None:
    # the detached and the attached disk go through the same in-process mount
    sandbox_dir = rt.sandboxes_dir / uniq("att")
    sandbox_dir.mkdir(mode=0o711)
    made = disk.create(sandbox_dir, disk_mb=16, uid=os.getuid())
    try:
        assert not made.detached and made.root == made.mount_point
        assert disk.mounts_below(sandbox_dir) == [made.mount_point]
        assert (made.root / "workspace").is_dir() and (made.root / "tmp").is_dir()
    finally:
        disk.remove(sandbox_dir)
        sandbox_dir.rmdir()
    assert disk.mounts_below(sandbox_dir) == []
    assert gone_within(made.image)


def test_a_disk_is_a_sparse_copy_of_the_workers_blank_and_keeps_its_own_quota(
    rt: BwrapRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blank_dir = tmp_path / "blanks"
    made = []
    for i in range(2):
        sandbox_dir = rt.sandboxes_dir / uniq(f"blank{i}")
        sandbox_dir.mkdir(mode=0o711)
        made.append(disk.create(sandbox_dir, disk_mb=24, uid=os.getuid(), blank_dir=blank_dir))
    try:
        (blank,) = blank_dir.iterdir()  # made once, for both
        assert blank == disk.blank_path(blank_dir, 24)
        for one in made:
            assert one.image.stat().st_size == 24 << 20
            assert one.image.stat().st_blocks * 512 < 4 << 20  # its data extents only
            fs = os.statvfs(one.root)
            assert fs.f_blocks * fs.f_frsize <= 24 << 20 and fs.f_files == disk.inodes_for(24)
            assert (one.root / "workspace").stat().st_uid == os.getuid()
        (made[0].root / "workspace" / "mine").write_text("first")
        assert not (made[1].root / "workspace" / "mine").exists()  # one file system each
        # a file system that cannot tell data from holes: made with mkfs, not copied whole
        monkeypatch.setattr(disk, "MAX_BLANK_DATA", 0)
        sandbox_dir = rt.sandboxes_dir / uniq("blank-fallback")
        sandbox_dir.mkdir(mode=0o711)
        made.append(disk.create(sandbox_dir, disk_mb=24, uid=os.getuid(), blank_dir=blank_dir))
        assert made[-1].image.stat().st_blocks * 512 < 4 << 20
        assert os.statvfs(made[-1].root).f_files == disk.inodes_for(24)
        # the sizes are the tenants': past MAX_BLANKS sizes, no new blank is kept
        monkeypatch.setattr(disk, "MAX_BLANK_DATA", 64 << 20)
        monkeypatch.setattr(disk, "MAX_BLANKS", 1)
        sandbox_dir = rt.sandboxes_dir / uniq("blank-other-size")
        sandbox_dir.mkdir(mode=0o711)
        made.append(disk.create(sandbox_dir, disk_mb=20, uid=os.getuid(), blank_dir=blank_dir))
        assert list(blank_dir.iterdir()) == [blank]
        assert os.statvfs(made[-1].root).f_files == disk.inodes_for(20)
    finally:
        for one in made:
            disk.remove(one.image.parent)
            one.image.parent.rmdir()


def test_a_restart_after_a_crash_leaves_no_mount_or_loop_device(env: Env) -> None:
    first = other_runtime(env)
    asyncio.run(first.prepare())

    async def start_and_abandon() -> tuple[Path, Path]:
        sb = await first.start(SandboxSpec(name=uniq("crash")), argv=py("print('up')"))
        await readline(sb)
        # the worker "crashes": never stopped; its pipes close and the sandbox dies with
        # them, and its descriptors (the detached disk's) close with it
        assert isinstance(sb.process, SpawnedProcess)
        sb.process.close_pipes()
        await sb.process.wait()
        os.close(sb.private["disk"].mount_fd)
        sandbox_dir: Path = sb.private["sandbox_dir"]
        return sandbox_dir, sandbox_dir / disk.IMAGE_NAME

    sandbox_dir, image = asyncio.run(start_and_abandon())
    second = env.runtime(first.worker_name)
    asyncio.run(second.prepare())
    assert disk.mounts_below(first.sandboxes_dir) == []
    assert second.features()["disk_quota"] is True  # its probe is not tripped by the first's
    assert not sandbox_dir.exists()
    assert gone_within(image)


def test_every_process_gets_a_descriptor_limit_it_cannot_raise(rt: BwrapRuntime) -> None:
    code = """
    import json, resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard + 1, hard + 1))
        raised = True
    except (ValueError, OSError):
        raised = False
    print(json.dumps({"soft": soft, "hard": hard, "raised": raised}))
    """
    spec = SandboxSpec(name=uniq("fd"), pids=256)
    got = run(rt, py(code), spec).json()
    file_max, nr_open = fds.host_file_limits()
    expected = fds.nofile_for(256, share=rt.fd_share, file_max=file_max, nr_open=nr_open)
    assert got == {"soft": expected, "hard": expected, "raised": False}, got
    # the whole sandbox at its limits holds at most its share of the host's file table
    assert 256 * expected <= rt.fd_share * file_max or expected == fds.MIN_NOFILE
    assert expected < 20_000  # the worker's own (inherited) limit no longer applies
