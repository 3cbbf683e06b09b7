"""A bwrap sandbox's metrics come from its own cgroups and file system: its limits are the
totals (memory_mb, cpus rounded up, disk_mb less the file system's own metadata), and the
figures move with what runs inside. Real bwrap sandboxes, the real agent, the worker's
`metrics` op as the tunnel asks for it."""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import Any

import pytest

from sandgate.errors import ConflictError
from sandgate.worker import metrics
from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.runtime.bwrap import BwrapRuntime
from sandgate.worker.service import WorkerService
from sandgate.worker.state import WorkerLocalState

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]

MiB = 1 << 20


def test_cgroup_backed_figures_match_the_sandboxs_limits(runtime: BwrapRuntime) -> None:
    service = WorkerService(runtime, capacity=4, state=WorkerLocalState())
    spec = SandboxSpec(name="metrics-1", memory_mb=256, cpus=1.5, disk_mb=64)

    async def measure() -> dict[str, Any]:
        header, _ = await service.handle({"op": "metrics", "name": spec.name}, b"")
        return header

    async def agent(op: str, payload: bytes = b"", **fields: Any) -> dict[str, Any]:
        call = {"op": op, **fields}
        header, _ = await service.handle(
            {"op": "agent", "sandbox": spec.name, "call": call, "timeout_s": 30}, payload
        )
        return header

    async def until(check: Any, within: float = 10.0) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + within
        while True:
            got = await measure()
            if check(got) or asyncio.get_running_loop().time() > deadline:
                return got

    async def body() -> None:
        features = runtime.features()
        await service.provision(spec)
        live = service.state.sandboxes[spec.name].running
        assert live.cgroup_dirs, "a bwrap sandbox has its cgroups"
        idle = await measure()

        if features["limits"]["memory"]:
            assert idle["mem_total"] == 256 * MiB
        else:
            assert idle["mem_total"] == metrics.host_memory()
        assert idle["cpu_count"] == (2 if features["limits"]["cpu"] else os.cpu_count())
        assert 0 < idle["mem_used"] < 256 * MiB
        assert 0 <= idle["mem_cache"] <= idle["mem_used"]
        if features["disk_quota"]:
            # the 64 MiB image, less what ext4 keeps for itself (inode tables, bitmaps)
            assert idle["disk_scope"] == "sandbox"
            assert 0.9 * 64 * MiB < idle["disk_total"] <= 64 * MiB, idle
            assert 0 < idle["disk_used"] < 4 * MiB
        else:
            assert idle["disk_scope"] in ("directories", "file_system")

        # 100 MiB written (so resident) and held, within the 256 MiB limit
        hold = "exec python3 -c 'import time; b = b\"x\" * (100 << 20); time.sleep(60)'"
        await agent("proc_start", command=hold, env={}, timeout=60)
        held = await until(lambda m: m["mem_used"] > idle["mem_used"] + 95 * MiB)
        assert held["mem_used"] > idle["mem_used"] + 95 * MiB, (idle, held)
        assert held["mem_used"] <= held["mem_total"]

        # one spinning process: one CPU of cpu_count 2 (its quota is 1.5), since the last call
        spin = "exec python3 -c 'while True: pass'"
        await agent("proc_start", command=spin, env={}, timeout=60)
        busy = await until(lambda m: m["cpu_used_pct"] > 35.0)
        assert 35.0 < busy["cpu_used_pct"] <= 75.0 + 5.0, busy

        # 10 MB on its disk, /workspace and /tmp together, some of it in the page cache
        code = b"head -c 6000000 /dev/urandom > /workspace/a; head -c 4000000 /dev/urandom > /tmp/b"
        ran = await agent("exec", code, language="bash", timeout=30, env={}, cwd=None)
        assert ran["exit_code"] == 0, ran
        wrote = await measure()
        if features["disk_quota"]:
            assert wrote["disk_used"] >= idle["disk_used"] + 10_000_000, (idle, wrote)
            assert wrote["disk_total"] == idle["disk_total"]
        if features["limits"]["memory"]:
            assert wrote["mem_cache"] >= idle["mem_cache"] + 5_000_000, (idle, wrote)

        await service.destroy(spec.name)
        assert spec.name not in service.state.cpu_samples
        with pytest.raises(ConflictError) as gone:
            await measure()
        assert gone.value.code == "not_running"

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())
