"""A worker's workspaces on a real host (root, loop devices, idmapped mounts): the probe
leaves nothing mounted, the owner is checked, one host mounts an image at a time, binds map
the storage uid to the sandbox's, and a lower fence stops before touching git."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sandgate.core.workspaces import new_workspace_id
from sandgate.errors import ConflictError, NotFoundError
from sandgate.worker import cgroups, disk, git_history, idmap
from sandgate.worker.git_history import Author, GitHistory
from sandgate.worker.workspaces import STORAGE_UID, WorkspaceHost
from tests.statedirs import held_as_live

pytestmark = pytest.mark.anyio

AUTHOR = Author("alpha", "alpha@tenants.sandgate")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def base() -> Iterator[Path]:
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("workspaces need root and e2fsprogs")
    where = Path("/var/lib/sandgate-test") / f"wshost-{os.getpid()}-{new_workspace_id()[3:11]}"
    where.mkdir(parents=True)
    try:
        with held_as_live(where):
            yield where
    finally:
        disk.unmount_leftovers(where)
        shutil.rmtree(where, ignore_errors=True)


def host(base: Path, name: str) -> WorkspaceHost:
    ws = WorkspaceHost(base / "root", base / name / "mounts")
    ws.prepare(disk_problem=None)
    assert ws.problem is None, ws.problem
    return ws


def mounted_below(path: Path) -> list[Path]:
    return disk.mounts_below(path)


async def test_probe_create_attach_bind_release(base: Path) -> None:
    one = host(base, "w1")
    assert mounted_below(base) == []  # the probe's bind is gone
    ws_id = new_workspace_id()
    head = await one.create(ws_id, "alpha", 16, AUTHOR)
    assert head["message"].startswith("Workspace created")
    assert (await one.create(ws_id, "alpha", 16, AUTHOR))["sha"] == head["sha"]  # a retry
    with pytest.raises(ConflictError):
        await one.create(ws_id, "beta", 16, AUTHOR)
    assert mounted_below(base) == []  # mounted only while in use

    with pytest.raises(NotFoundError):
        await one.attach(ws_id, "beta")  # the owner recorded with it is checked
    files = await one.attach(ws_id, "alpha")
    assert await one.attach(ws_id, "alpha") == files  # one mount, counted twice
    target = base / "sandbox-ws0"
    target.mkdir()
    one.bind(files, target, 201234)
    as_sandbox = ["setpriv", "--reuid=201234", "--regid=201234", "--clear-groups"]
    subprocess.run([*as_sandbox, "sh", "-c", f"echo x > {target}/f"], check=True)  # noqa: ASYNC221
    assert os.stat(target / "f").st_uid == 201234  # its own, seen through its bind
    with pytest.raises(OSError):  # an uid the bind does not map (root here) writes nothing
        (target / "g").write_text("x")
    assert os.stat(files / "f").st_uid == STORAGE_UID  # stored as the storage uid
    idmap.unbind(target)
    assert not idmap.is_mount(target)

    # a second worker on the same root cannot mount it while the first has it
    two = host(base, "w2")
    with pytest.raises(ConflictError) as busy:
        await two.attach(ws_id, "alpha")
    assert busy.value.code == "workspace_busy"
    with pytest.raises(ConflictError):
        await two.delete(ws_id, "alpha")
    await one.release(ws_id)
    assert idmap.is_mount(files.parent)
    await one.release(ws_id)
    assert mounted_below(base) == []
    assert await two.attach(ws_id, "alpha") == base / "w2" / "mounts" / ws_id / "files"
    await two.release(ws_id)
    assert await two.delete(ws_id, "alpha")
    assert not (base / "root" / ws_id).exists()


def devices_backing(image: Path) -> list[str]:
    return [
        entry.parent.parent.name
        for entry in Path("/sys/block").glob("loop*/loop/backing_file")
        if entry.read_text().strip() == os.path.realpath(image)
    ]


@contextlib.contextmanager
def mount_table_copied(inside: Path) -> Iterator[None]:
    """A process in a private copy of this mount table, its working directory `inside` a
    mount (as a sandbox's last process, or a git jail's, while its namespace goes): an
    unmount here leaves that file system alive there."""
    holder = subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'cd "$0" && echo up; exec sleep 600',
            str(inside),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"up\n"
        yield
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


async def until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not within 10 s")


async def test_a_file_system_outliving_its_unmount_is_mounted_again_not_made_twice(
    base: Path,
) -> None:
    """A mount right after an unmount once made a second file system on the image while a
    copy of the mount table kept the first alive: it read the image without the last
    changes (a test's fresh `files/` was not there), and the first one would write them over
    it when it went."""
    one, two = host(base, "w1"), host(base, "w2")
    ws_id = new_workspace_id()
    image = base / "root" / ws_id / "disk.img"
    await one.create(ws_id, "alpha", 16, AUTHOR)
    files = await one.attach(ws_id, "alpha")
    (files / "a").write_text("fresh")  # written back by nothing before the unmount
    with mount_table_copied(files):
        await one.release(ws_id)
        assert ws_id in one.lingering and len(devices_backing(image)) == 1
        with pytest.raises(ConflictError) as busy:  # the flock stays while it lives
            await two.attach(ws_id, "alpha")
        assert busy.value.code == "workspace_busy"
        files = await one.attach(ws_id, "alpha")
        assert (files / "a").read_text() == "fresh"  # the same file system, again
        assert len(devices_backing(image)) == 1
        await one.release(ws_id)
        assert ws_id in one.lingering
    await until(lambda: ws_id not in one.lingering)  # gone with its holder: flock let go
    assert devices_backing(image) == []
    files = await two.attach(ws_id, "alpha")
    assert (files / "a").read_text() == "fresh"
    await two.release(ws_id)


async def test_a_worker_starting_finds_a_file_system_an_earlier_one_left_alive(
    base: Path,
) -> None:
    one = host(base, "w1")
    ws_id = new_workspace_id()
    image = base / "root" / ws_id / "disk.img"
    await one.create(ws_id, "alpha", 16, AUTHOR)
    files = await one.attach(ws_id, "alpha")
    (files / "a").write_text("fresh")
    with mount_table_copied(files):
        await one.release(ws_id)
        os.close(one.lingering.pop(ws_id).lock_fd)  # the worker died: the kernel lets go
        again = host(base, "w1")
        assert again.lingering[ws_id].lock_fd >= 0  # found, its flock taken again
        again.watch_lingering()
        with pytest.raises(ConflictError):  # so no other worker mounts it meanwhile
            await host(base, "w2").attach(ws_id, "alpha")
        files = await again.attach(ws_id, "alpha")
        assert (files / "a").read_text() == "fresh"
        assert len(devices_backing(image)) == 1
        await again.release(ws_id)
    await until(lambda: ws_id not in again.lingering)
    assert devices_backing(image) == []


async def test_a_cancelled_release_still_lets_the_flock_go_once_the_file_system_is_gone(
    base: Path,
) -> None:
    """A release cancelled while its unmount ran in a thread once left its lingering flock
    with nothing to let it go: no other worker could mount the workspace again."""
    one = host(base, "w1")
    ws_id = new_workspace_id()
    await one.create(ws_id, "alpha", 16, AUTHOR)
    files = await one.attach(ws_id, "alpha")
    with mount_table_copied(files):
        release = asyncio.ensure_future(one.release(ws_id))
        await asyncio.sleep(0.001)  # its unmount under way in a thread
        release.cancel()
        with pytest.raises(asyncio.CancelledError):
            await release
        assert ws_id in one.lingering
    await until(lambda: ws_id not in one.lingering)
    two = host(base, "w2")
    await two.attach(ws_id, "alpha")
    await two.release(ws_id)


async def test_a_lower_fence_stops_before_git(base: Path) -> None:
    one = host(base, "w1")
    ws_id = new_workspace_id()
    await one.create(ws_id, "alpha", 16, AUTHOR)
    started = asyncio.Event()
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow(git: GitHistory) -> str:
        loop.call_soon_threadsafe(started.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result()
        return git.commit("late", AUTHOR).commit.sha

    first = asyncio.ensure_future(one.run(ws_id, "alpha", 1, slow))
    await started.wait()
    second = asyncio.ensure_future(
        one.run(ws_id, "alpha", 2, lambda git: git.commit("newer", AUTHOR).created)
    )
    await asyncio.sleep(0.05)  # the newer fence has arrived and waits its turn
    release.set()
    with pytest.raises(ConflictError) as lost:
        await first
    assert lost.value.code == "workspace_lock_lost"
    assert await second is False  # nothing changed; and it ran
    with pytest.raises(ConflictError):
        await one.run(ws_id, "alpha", 1, lambda git: None)  # an old fence never runs again
    log = await one.run(ws_id, "alpha", None, lambda git: git.log(limit=10)[0])
    assert [c.message.splitlines()[0] for c in log] == ["Workspace created"]
    assert mounted_below(base) == []


async def test_git_runs_in_a_jail_holding_this_workspace_alone(base: Path) -> None:
    one = host(base, "w1")
    ws_id, other = new_workspace_id(), new_workspace_id()
    await one.create(ws_id, "alpha", 16, AUTHOR)
    await one.create(other, "beta", 16, AUTHOR)
    await one.attach(other, "beta")  # mounted on the host meanwhile, like a neighbour's
    seen = await one.run(
        ws_id,
        "alpha",
        None,
        lambda git: git._sh(
            'echo "uid=$(id -u) ws=$(ls -A /ws | tr "\\n" ,) top=$(ls -A / | tr "\\n" ,)"'
        ).decode(),
    )
    fields = dict(part.split("=", 1) for part in seen.split())
    assert fields["uid"] == str(STORAGE_UID)
    assert fields["ws"] == "files,git,"
    top = set(fields["top"].strip(",").split(",")) - {"lib64"}
    assert top == {"bin", "dev", "lib", "tmp", "usr", "ws"}  # nothing of the host's
    assert other not in seen and str(base) not in seen
    await one.release(other)


async def test_a_planted_repository_config_never_runs(base: Path) -> None:
    """What a restore racing a link could leave in git/ (a filter in its config, attributes
    naming it) is written over by the worker before the next commit: nothing runs."""
    one = host(base, "w1")
    ws_id = new_workspace_id()
    await one.create(ws_id, "alpha", 16, AUTHOR)
    files = await one.attach(ws_id, "alpha")
    git_dir = files.parent / "git"
    marker = files / "ran"  # inside the jail's view: only the worker's rewrite stops it
    (git_dir / "config").write_text(
        "[core]\n\trepositoryformatversion = 0\n"
        '[filter "evil"]\n\tclean = touch /ws/files/ran; cat\n'
    )
    (git_dir / "info" / "attributes").write_text("* filter=evil\n")
    (files / "f").write_text("data")
    os.chown(files / "f", STORAGE_UID, STORAGE_UID)
    made = await one.run(ws_id, "alpha", 1, lambda git: git.commit("c", AUTHOR))
    assert made.created and not marker.exists()
    assert "evil" not in (git_dir / "config").read_text()
    await one.release(ws_id)


async def test_a_cancelled_operation_holds_the_workspace_until_its_git_ends(base: Path) -> None:
    """Its caller went away (an instance died): the next operation must not run git beside
    the one still running in its thread."""
    one = host(base, "w1")
    ws_id = new_workspace_id()
    await one.create(ws_id, "alpha", 16, AUTHOR)
    started, finish = threading.Event(), threading.Event()
    order: list[str] = []

    def slow(git: GitHistory) -> None:
        started.set()
        finish.wait(10)
        order.append("first ended")

    def second(git: GitHistory) -> None:
        order.append("second ran")

    first = asyncio.ensure_future(one.run(ws_id, "alpha", 1, slow))
    await asyncio.to_thread(started.wait, 10)
    first.cancel()
    after = asyncio.ensure_future(one.run(ws_id, "alpha", 2, second))
    await asyncio.sleep(0.2)
    assert order == []  # the second waits: the first's git is still running
    finish.set()
    await after
    with pytest.raises(asyncio.CancelledError):
        await first
    assert order == ["first ended", "second ran"]
    assert mounted_below(base) == []


async def test_a_diff_too_slow_to_count_gets_names_only(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree made to be slow to diff (files just under the binary threshold, every line
    changed) once cost a minute of the worker's CPU per request: past its budget, a diff
    answers the changed paths without line counts or patch."""
    one = host(base, "w1")
    ws_id = new_workspace_id()
    await one.create(ws_id, "alpha", 16, AUTHOR)
    files = await one.attach(ws_id, "alpha")
    (files / "a").write_text("x\n" * 1000)
    os.chown(files / "a", STORAGE_UID, STORAGE_UID)
    made = await one.run(ws_id, "alpha", 1, lambda git: git.commit("c", AUTHOR))
    monkeypatch.setattr(git_history, "SHOW_BUDGET", 0.0)  # every count is over budget
    shown = await one.run(ws_id, "alpha", None, lambda git: git.show(made.commit.sha))
    assert [f.path for f in shown.files] == ["a"]
    assert shown.files[0].added is None and shown.patch == "" and shown.truncated
    monkeypatch.undo()
    shown = await one.run(ws_id, "alpha", None, lambda git: git.show(made.commit.sha))
    assert shown.files[0].added == 1000 and "+x" in shown.patch
    await one.release(ws_id)


async def test_freeze_holds_thaw_only_at_the_last(base: Path) -> None:
    """A sandbox mounting two workspaces was thawed by one commit's end while the other's
    still ran, so it could race the second commit's git."""
    unified = Path("/sys/fs/cgroup/unified")
    if not (unified / "cgroup.procs").exists():
        unified = Path("/sys/fs/cgroup")
    group = unified / f"sandgate-test-freeze-{os.getpid()}"
    group.mkdir()
    if not (group / "cgroup.freeze").exists():
        group.rmdir()
        pytest.skip("no cgroup v2 freezer here")
    sleeper = subprocess.Popen(["sleep", "30"])  # noqa: ASYNC220
    try:
        (group / "cgroup.procs").write_text(str(sleeper.pid))
        holds: dict[str, int] = {}

        def frozen() -> bool:
            return "frozen 1" in (group / "cgroup.events").read_text().splitlines()

        assert await cgroups.hold_frozen(holds, "s", [group], True) and frozen()
        assert await cgroups.hold_frozen(holds, "s", [group], True) and holds == {"s": 2}
        assert await cgroups.hold_frozen(holds, "s", [group], False)
        assert frozen()  # one hold left: still frozen
        assert await cgroups.hold_frozen(holds, "s", [group], False)
        assert not frozen() and holds == {}
        assert not await cgroups.hold_frozen(holds, "s", [group], False)  # none to give back
    finally:
        sleeper.kill()
        sleeper.wait()
        group.rmdir()
