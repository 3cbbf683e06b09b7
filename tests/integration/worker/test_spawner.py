"""Processes started from the spawner's thread (worker/spawner.py): what the child gets (only
the descriptors it is given, at their numbers; `/`; no environment; a session of its own;
default SIGPIPE), what stays behind (nothing in the thread's table, nothing in the worker's),
how a failure, a cancelled start and the thread's end are handled."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandgate.worker import spawner
from sandgate.worker.spawner import Spawner

REPORT = """
import json, os, signal
print(json.dumps({
    "fds": sorted(int(n) for n in os.listdir("/proc/self/fd")),
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "session": os.getsid(0) == os.getpid(),
    "three": os.read(3, 100).decode(),
}), flush=True)
"""


@pytest.fixture
def made() -> Iterator[Spawner]:
    one = Spawner()
    try:
        yield one
    finally:
        one.close()


def reaped(pid: int) -> bool:
    """Is `pid` no child of this process any more (exited and waited for)?"""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def hold_spawns(one: Spawner) -> tuple[threading.Event, list[int]]:
    """Make the thread wait inside each spawn until the event is set: (the event, the pids
    it started once let go)."""
    gate, started = threading.Event(), []
    real = one._spawn

    def held(leader: int, job: object) -> int:
        gate.wait(5)
        started.append(real(leader, job))  # type: ignore[arg-type]
        return started[-1]

    one._spawn = held  # type: ignore[method-assign]
    return gate, started


async def until_reaped(started: list[int]) -> None:
    """Wait until the one process `started` holds exists and is gone and reaped."""
    for _ in range(100):
        await asyncio.sleep(0.05)
        if started and reaped(started[0]):
            return
    raise AssertionError(f"the process of a cancelled start ({started}) is still there")


def thread_fds(one: Spawner) -> list[str]:
    tid = one._thread.native_id
    return sorted(os.listdir(f"/proc/self/task/{tid}/fd"), key=int)


def test_the_child_gets_only_what_it_is_given(made: Spawner, tmp_path: Path) -> None:
    extra = tmp_path / "three"
    extra.write_text("the third")

    async def main() -> dict[str, Any]:
        fd = os.open(extra, os.O_RDONLY | os.O_CLOEXEC)
        try:
            child = await spawner.start(
                made, [sys.executable, "-c", REPORT], stderr=2, pass_fds={3: fd}, limit=1 << 16
            )
        finally:
            os.close(fd)
        out, _ = await child.communicate()
        assert child.returncode == 0
        # Python ignores SIGPIPE itself: a shell shows what the spawn left
        shell = await spawner.start(
            made, ["/bin/sh", "-c", "grep SigIgn /proc/self/status"], stderr=2, pass_fds={}, limit=1
        )
        ignored, _ = await shell.communicate()
        return {**json.loads(out), "ignored": int(ignored.split()[1], 16)}

    before = len(os.listdir("/proc/self/fd"))
    seen = asyncio.run(main())
    # 0-2 and 3, and the directory listing's own descriptor
    assert seen["fds"][:4] == [0, 1, 2, 3] and len(seen["fds"]) == 5, seen["fds"]
    assert seen["cwd"] == "/"
    assert seen["env"] in ({}, {"LC_CTYPE": "C.UTF-8"})  # Python may set its own locale
    assert seen["session"] is True
    assert seen["ignored"] & (1 << (signal.SIGPIPE - 1)) == 0  # the worker's SIG_IGN is not
    assert seen["three"] == "the third"
    assert len(os.listdir("/proc/self/fd")) == before  # the pipes are closed once done
    # between jobs the thread holds nothing of its own (0-2 aside)
    assert thread_fds(made) == ["0", "1", "2"]


def test_a_failed_spawn_is_the_callers_and_the_thread_serves_on(made: Spawner) -> None:
    async def main() -> int:
        with pytest.raises(FileNotFoundError):
            await spawner.start(made, ["/no/such/program"], stderr=2, pass_fds={}, limit=1 << 16)
        child = await spawner.start(
            made, ["/bin/sh", "-c", "exit 7"], stderr=2, pass_fds={}, limit=1 << 16
        )
        return await child.wait()

    assert asyncio.run(main()) == 7
    with pytest.raises(ValueError, match="is not in"):
        asyncio.run(made.spawn(["/bin/true"], {100: 0}))


def test_exit_codes_kill_and_a_second_kill(made: Spawner) -> None:
    async def main() -> None:
        child = await spawner.start(
            made, ["/bin/sleep", "30"], stderr=2, pass_fds={}, limit=1 << 16
        )
        assert child.returncode is None
        child.kill()
        assert await child.wait() == -signal.SIGKILL
        assert child.returncode == -signal.SIGKILL
        with pytest.raises(ProcessLookupError):
            child.kill()
        assert reaped(child.pid)  # no zombie left with its pid

    asyncio.run(main())


def test_a_cancelled_start_leaves_no_process(made: Spawner, tmp_path: Path) -> None:
    gate, started = hold_spawns(made)

    async def main() -> None:
        starting = asyncio.ensure_future(
            spawner.start(made, ["/bin/sleep", "30"], stderr=2, pass_fds={}, limit=1)
        )
        await asyncio.sleep(0.1)  # the thread is inside the spawn
        starting.cancel()
        await asyncio.sleep(0)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await starting
        await until_reaped(started)  # it is started all the same, then killed and reaped

    asyncio.run(main())


def test_what_it_started_dies_with_its_thread() -> None:
    """A child that asked for its parent's death signal (bwrap --die-with-parent does) dies
    when the spawner's thread ends: it is the thread's, not the worker's main thread's."""
    one = Spawner()
    code = (
        "import ctypes, signal, time; ctypes.CDLL(None).prctl(1, int(signal.SIGKILL)); "
        "print('armed', flush=True); time.sleep(60)"
    )

    async def main() -> int:
        child = await spawner.start(
            one, [sys.executable, "-c", code], stderr=2, pass_fds={}, limit=1 << 16
        )
        assert child.stdout is not None
        assert await child.stdout.readline() == b"armed\n"
        assert child.returncode is None
        one.close()
        return await asyncio.wait_for(child.wait(), 10)

    assert asyncio.run(main()) == -signal.SIGKILL
    with pytest.raises(OSError, match="closed"):
        asyncio.run(one.spawn(["/bin/true"], {}))


def test_a_start_cancelled_twice_leaves_no_process_and_no_descriptor(made: Spawner) -> None:
    """Each cancel while the thread is inside the spawn; the caller's descriptors are closed
    at once (the job has its own copies), the child is killed and reaped once it exists."""
    gate, started = hold_spawns(made)

    async def main() -> None:
        before = len(os.listdir("/proc/self/fd"))
        starting = asyncio.ensure_future(
            spawner.start(made, ["/bin/sleep", "30"], stderr=2, pass_fds={}, limit=1)
        )
        await asyncio.sleep(0.05)
        starting.cancel()
        await asyncio.sleep(0.05)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        gate.set()
        await until_reaped(started)
        assert len(os.listdir("/proc/self/fd")) == before  # the job's copies are closed too

    asyncio.run(main())


def test_the_thread_takes_no_signal(made: Spawner) -> None:
    """Python's handler would write the loop's wake-up byte into the thread's own table."""
    tid = made._thread.native_id
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    blocked = int(
        next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16
    )
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
        assert blocked & (1 << (signum - 1)), signum
