"""A destroy the worker was asked for finishes even when the request behind it is cancelled
(the tunnel dropped, the worker is stopping): real bwrap sandboxes, the real agent."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import shutil
from pathlib import Path

import pytest

from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.runtime.bwrap import BwrapRuntime
from sandgate.worker.service import WorkerService
from sandgate.worker.state import WorkerLocalState

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]


def leftovers(rt: BwrapRuntime, names: list[str]) -> dict[str, object]:
    found: dict[str, object] = {}
    dirs = [p.name for p in rt.sandboxes_dir.iterdir()]
    if dirs:
        found["dirs"] = dirs
    if rt.uids.held():
        found["uid_leases"] = sorted(rt.uids.held())
    groups = [
        str(p)
        for p in Path("/sys/fs/cgroup").glob(f"*/sandgate/{rt.worker_name}/*")
        if p.name in names
    ]
    if groups:
        found["cgroups"] = groups
    return found


def test_a_destroy_cancelled_at_any_point_still_finishes(runtime: BwrapRuntime) -> None:
    rng = random.Random(2)
    names = [f"sb-{i}-{secrets.token_hex(2)}" for i in range(10)]
    service = WorkerService(runtime, capacity=16, state=WorkerLocalState())

    async def body() -> None:
        for name in names:
            await service.provision(SandboxSpec(name=name))
            (service.state.sandboxes[name].running.workspace / "upload.txt").write_text("tenant")
            request = asyncio.create_task(service.destroy(name))  # as the tunnel handler does
            await asyncio.sleep(rng.uniform(0.0, 0.03))
            request.cancel()  # the link dropped: the handler is cancelled
            await asyncio.gather(request, return_exceptions=True)
            assert name not in service.state.sandboxes
        for _ in range(200):  # the teardowns go on by themselves
            if not service.state.tearing_down:
                break
            await asyncio.sleep(0.05)
        assert not service.state.tearing_down

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())
    assert leftovers(runtime, names) == {}


def test_a_stopping_worker_finishes_the_destroys_it_had_begun(runtime: BwrapRuntime) -> None:
    names = [f"sb-{i}-{secrets.token_hex(2)}" for i in range(4)]
    service = WorkerService(runtime, capacity=16, state=WorkerLocalState())

    async def body() -> None:
        for name in names:
            await service.provision(SandboxSpec(name=name))
        requests = [asyncio.create_task(service.destroy(n)) for n in names]
        await asyncio.sleep(0.005)
        for request in requests:
            request.cancel()  # the shutdown cancels the handlers...
        await asyncio.gather(*requests, return_exceptions=True)
        # ...and the worker stops: service.run destroys what is left

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())
    assert leftovers(runtime, names) == {}


def test_a_provision_waits_for_the_teardown_holding_its_slot_or_its_name(
    runtime: BwrapRuntime,
) -> None:
    """The control plane counts a deleted sandbox free at once; the worker frees it a moment
    later. A create in that moment waits for it instead of answering no_capacity, and a
    redelivered name waits for its own teardown instead of sharing its directory."""
    service = WorkerService(runtime, capacity=1, state=WorkerLocalState())
    first, second = f"sb-a-{secrets.token_hex(2)}", f"sb-b-{secrets.token_hex(2)}"

    async def body() -> None:
        await service.provision(SandboxSpec(name=first))
        request = asyncio.create_task(service.destroy(first))
        await asyncio.sleep(0)  # the teardown has begun
        live = await service.provision(SandboxSpec(name=second))  # the only slot: waited for
        assert live.name == second
        assert not service.state.tearing_down
        await request
        request = asyncio.create_task(service.destroy(second))
        await asyncio.sleep(0)
        again = await service.provision(SandboxSpec(name=second))  # the same name, fresh
        await request
        assert service.state.sandboxes[second] is again
        assert again.running.workspace.is_dir()
        assert await service.destroy(second)

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())
    assert leftovers(runtime, [first, second]) == {}


def test_a_call_in_flight_when_its_sandbox_goes_is_told_it_is_not_running(
    runtime: BwrapRuntime,
) -> None:
    """A delete (or the sandbox's timeout) closes the agent's link under a call still waiting
    for its answer: the call is answered as one that came just after, 409 `not_running`,
    not as a broken tunnel (503, which tells the client to retry what cannot succeed)."""
    from sandgate.errors import ConflictError

    service = WorkerService(runtime, capacity=4, state=WorkerLocalState())
    spec = SandboxSpec(name=f"inflight-{secrets.token_hex(3)}")

    async def body() -> None:
        await service.provision(spec)
        call = {"op": "exec", "language": "sh", "code": "sleep 30", "timeout": 60, "env": {}}
        waiting = asyncio.ensure_future(
            service.handle({"op": "agent", "sandbox": spec.name, "call": call}, b"")
        )
        await asyncio.sleep(0.3)  # the command runs
        await service.destroy(spec.name)
        with pytest.raises(ConflictError) as told:
            await waiting
        assert told.value.code == "not_running"

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())
