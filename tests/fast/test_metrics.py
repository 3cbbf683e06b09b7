"""A sandbox's metrics, measured by its worker (`worker/metrics.py`) and read through the seam
(`Toolbox.metrics`): real figures of the real agent's process tree under the process runtime
(no cgroups: its PSS, its CPU time in /proc, the directories it writes to), which move when
the sandbox allocates memory, burns CPU or writes a file."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from sandgate.control.toolbox import SandboxMetrics
from sandgate.errors import ConflictError, NotFoundError
from sandgate.store.base import SandboxName, TenantId
from sandgate.worker import metrics
from tests.fast.conftest import Fast

pytestmark = pytest.mark.anyio

MiB = 1 << 20


async def _sandbox(fast: Fast) -> tuple[TenantId, str]:
    created = await fast.api.post("/api/v1/sandboxes", json={})
    assert created.status_code == 201, created.text
    name = created.json()["name"]
    record = await fast.services.store.get_sandbox(SandboxName(name))
    assert record is not None
    return record.tenant_id, name


async def _start(fast: Fast, tenant: TenantId, name: str, command: str) -> int:
    return await fast.services.toolbox.start_process(
        tenant, name, command, cwd=None, env={}, time_limit=60.0
    )


async def _until(
    fast: Fast,
    tenant: TenantId,
    name: str,
    check: Callable[[SandboxMetrics], bool],
    within: float = 10.0,
) -> SandboxMetrics:
    """Measure until `check(metrics)` holds (a process needs a moment to allocate or spin)."""
    deadline = time.monotonic() + within
    while True:
        got = await fast.services.toolbox.metrics(tenant, name)
        if check(got) or time.monotonic() > deadline:
            return got


async def test_the_figures_of_a_fresh_sandbox_are_its_own_and_the_hosts(fast: Fast) -> None:
    tenant, name = await _sandbox(fast)
    before = time.time()
    got = await fast.services.toolbox.metrics(tenant, name)
    assert isinstance(got, SandboxMetrics)
    assert before - 1 <= got.timestamp <= time.time() + 1
    # the process runtime sets no limits: the host's CPUs and memory
    assert got.cpu_count == os.cpu_count()
    assert got.mem_total == metrics.host_memory()
    assert 0.0 <= got.cpu_used_pct <= 100.0
    # the agent (a Python process) is resident: a few MiB of it, some of them file-backed
    assert 2 * MiB < got.mem_used < 200 * MiB, got
    assert 0 < got.mem_cache <= got.mem_used
    # its workspace is on the worker's file system: that file system's size, and what the
    # sandbox's directories hold (nearly nothing yet)
    live = fast.worker.state.sandboxes[name].running
    st = os.statvfs(live.workspace)
    assert got.disk_total == st.f_blocks * st.f_frsize
    assert 0 < got.disk_used < MiB
    assert fast.worker.state.cpu_samples[name].usec >= 0  # kept for the next measurement


async def test_memory_cpu_and_disk_move_with_what_the_sandbox_does(fast: Fast) -> None:
    tenant, name = await _sandbox(fast)
    idle = await fast.services.toolbox.metrics(tenant, name)
    assert idle.cpu_used_pct < 50.0  # an idle agent: nothing near a whole CPU per CPU

    # 96 MiB written (so resident), held
    await _start(
        fast, tenant, name, "exec python3 -c 'import time; b = b\"x\" * (96 << 20); time.sleep(60)'"
    )
    held = await _until(fast, tenant, name, lambda m: m.mem_used > idle.mem_used + 90 * MiB)
    assert held.mem_used > idle.mem_used + 90 * MiB, (idle, held)

    # one process spinning: one CPU of the host's (cpu_count), measured since the last call
    await _start(fast, tenant, name, "exec python3 -c 'while True: pass'")
    expected = 100.0 / held.cpu_count
    busy = await _until(fast, tenant, name, lambda m: m.cpu_used_pct > 0.6 * expected)
    assert 0.6 * expected < busy.cpu_used_pct <= 100.0, busy

    # a 5 MB file in the workspace, one in its /tmp
    ran = await fast.services.toolbox.execute(
        tenant,
        name,
        'head -c 5000000 /dev/urandom > big && head -c 3000000 /dev/urandom > "$TMPDIR/t"',
        time_limit=30.0,
    )
    assert ran.exit_code == 0, ran
    wrote = await fast.services.toolbox.metrics(tenant, name)
    assert wrote.disk_used >= idle.disk_used + 8_000_000, (idle, wrote)
    assert wrote.disk_used < idle.disk_used + 9 * MiB
    await fast.services.toolbox.remove(tenant, name, "/workspace/big", recursive=False)
    removed = await fast.services.toolbox.metrics(tenant, name)
    assert removed.disk_used <= wrote.disk_used - 5_000_000


async def test_a_sandbox_not_running_or_not_the_tenants(fast: Fast) -> None:
    tenant, name = await _sandbox(fast)
    await fast.services.toolbox.metrics(tenant, name)
    # another tenant's sandbox does not exist for it
    other = TenantId(f"{tenant}-other")
    with pytest.raises(NotFoundError):
        await fast.services.toolbox.metrics(other, name)
    # the worker stopped it behind the control plane's back: the relay's own answer
    await fast.worker.destroy(name)
    assert name not in fast.worker.state.cpu_samples  # dropped with the sandbox
    with pytest.raises(ConflictError) as gone:
        await fast.services.toolbox.metrics(tenant, name)
    assert gone.value.code == "not_running"
    with pytest.raises(ConflictError) as unknown:
        await fast.worker.handle({"op": "metrics", "name": "no-such-sandbox"}, b"")
    assert unknown.value.code == "not_running"


def test_cgroup_files_are_read_as_the_kernel_writes_them() -> None:
    assert metrics.parse_keyed("usage_usec 1200\nuser_usec 1000\nsystem_usec 200\n") == {
        "usage_usec": 1200,
        "user_usec": 1000,
        "system_usec": 200,
    }
    assert metrics.parse_cpu_max("max 100000\n") is None
    assert metrics.parse_cpu_max("150000 100000\n") == 1.5
    assert metrics.cpu_limit(-1, 100000) is None  # v1 cpu.cfs_quota_us without a limit
    assert metrics.parse_memory_max("max\n") is None
    assert metrics.parse_memory_max("536870912\n") == 512 * MiB
    assert metrics.parse_memory_max("9223372036854771712\n") is None  # v1 without a limit
    assert metrics.cpu_count_of(1.5, 8) == 2
    assert metrics.cpu_count_of(0.25, 8) == 1
    assert metrics.cpu_count_of(2.0, 8) == 2
    assert metrics.cpu_count_of(None, 8) == 8
    assert metrics.cpu_percent(50_000, 0.1, 1) == 50.0
    assert metrics.cpu_percent(50_000, 0.1, 2) == 25.0
    assert metrics.parse_proc_stat(b"12 (a (b) c) S 7 12 12 0 -1 0 0 0 0 0 3 4 5 6 20 0") == (7, 18)
    rollup = "Rss:  100 kB\nPss:  80 kB\nPss_Anon:  60 kB\nPss_File:  20 kB\n"
    assert metrics.parse_smaps_rollup(rollup) == (80 * 1024, 20 * 1024)
    assert sorted(metrics.descendants({1: 0, 2: 1, 3: 2, 4: 1, 5: 9}, 1)) == [1, 2, 3, 4]
    assert metrics.descendants({1: 0}, 42) == []  # gone: nothing of it
