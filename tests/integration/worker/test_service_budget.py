"""A worker never starts more than its host can hold (issue 10): one sandbox above the host's
per-sandbox maximum is refused naming it, and one more than what is left of the memory or
disk budget is refused while the ones it holds (running, starting or still being torn down)
are counted. Real bwrap sandboxes, the real agent."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sandgate.errors import NoCapacityError, ResourceCapError
from sandgate.worker import budget, fds
from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.runtime.bwrap import BwrapRuntime
from sandgate.worker.service import WorkerService
from sandgate.worker.state import WorkerLocalState

pytestmark = [pytest.mark.bwrap, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

ENFORCES = {
    "budget": {"memory_mb": 600, "disk_mb": 10_000},
    "sandbox_max": {"memory_mb": 600, "cpus": 2.0, "pids": 4096, "disk_mb": 10_000},
}


def test_the_budget_counts_what_runs_and_refuses_what_does_not_fit(runtime: BwrapRuntime) -> None:
    service = WorkerService(runtime, capacity=16, state=WorkerLocalState(), enforces=ENFORCES)

    async def body() -> None:
        await service.provision(SandboxSpec(name="b-1", memory_mb=256, disk_mb=64))
        await service.provision(SandboxSpec(name="b-2", memory_mb=256, disk_mb=64))
        with pytest.raises(NoCapacityError, match="memory_mb") as full:
            await service.provision(SandboxSpec(name="b-3", memory_mb=256, disk_mb=64))
        assert "88 of its 600" in full.value.message
        with pytest.raises(ResourceCapError) as large:
            await service.provision(SandboxSpec(name="b-4", cpus=8.0, disk_mb=64))
        assert large.value.cap == "worker_max_cpus" and large.value.value == 2.0
        assert sorted(service.state.sandboxes) == ["b-1", "b-2"]  # nothing half-made
        assert not (runtime.sandboxes_dir / "b-3").exists()
        await service.destroy("b-2")
        await service.provision(SandboxSpec(name="b-5", memory_mb=256, disk_mb=64))

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())


def test_a_sandbox_starting_or_being_torn_down_still_counts(runtime: BwrapRuntime) -> None:
    """Each check runs before the provision's first wait: one sandbox caught while it starts,
    then while it is torn down, holds its memory (the worker keeps the sums: GrantTally)."""
    service = WorkerService(runtime, capacity=16, state=WorkerLocalState(), enforces=ENFORCES)
    state = service.state

    async def until(reached: Callable[[], bool]) -> None:
        for _ in range(100_000):  # turns of the loop: the start and the teardown run in it
            if reached():
                return
            await asyncio.sleep(0)
        raise AssertionError("the sandbox never got there")

    async def body() -> None:
        starting = asyncio.ensure_future(service.provision(SandboxSpec(name="c-1", memory_mb=256)))
        await until(lambda: "c-1" in state.provisioning)
        with pytest.raises(NoCapacityError, match="344 of its 600"):
            await service.provision(SandboxSpec(name="c-2", memory_mb=400))
        await starting
        stopping = asyncio.ensure_future(service.destroy("c-1"))
        await until(lambda: "c-1" in state.tearing_down and "c-1" not in state.sandboxes)
        with pytest.raises(NoCapacityError, match="344 of its 600"):
            await service.provision(SandboxSpec(name="c-3", memory_mb=400))
        await stopping
        assert (
            state.sandboxes.granted
            == state.tearing_down.granted
            == {
                "memory_mb": 0,
                "disk_mb": 0,
            }
        )
        await service.provision(SandboxSpec(name="c-4", memory_mb=400))
        assert state.sandboxes.granted["memory_mb"] == 400

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())


def test_the_host_budget_is_measured_from_the_host(tmp_path: Path) -> None:
    measured = budget.measure(tmp_path, memory_overcommit=1.5, disk_overcommit=2.0)
    total = budget.mem_total_mb()
    st = os.statvfs(tmp_path)
    free_mb = (st.f_bavail * st.f_frsize) >> 20
    reserve = max(budget.MEMORY_RESERVE_MIN_MB, int(total * budget.MEMORY_RESERVE_SHARE))
    assert measured["budget"]["memory_mb"] == int((total - reserve) * 1.5)
    assert 0 < measured["budget"]["disk_mb"] <= free_mb * 2
    assert measured["sandbox_max"]["cpus"] == os.cpu_count()
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    file_max, _ = fds.host_file_limits()
    fd_bound = int(fds.DEFAULT_FD_SHARE * file_max) // fds.MIN_NOFILE
    assert measured["sandbox_max"]["pids"] == min(pid_max // 4, fd_bound)
    tight = budget.measure(tmp_path, fd_share=0.001)  # the probe's case: 0.1 % of file-max
    assert tight["sandbox_max"]["pids"] * fds.MIN_NOFILE <= 0.001 * file_max
    assert measured["overcommit"] == {"memory": 1.5, "disk": 2.0}
    without = budget.measure(tmp_path, disk_quota=False)
    assert "disk_mb" not in without["budget"] and "disk_mb" not in without["sandbox_max"]
