"""The agent is its sandbox's pid 1 (bwrap --as-pid-1): it reaps the orphans that commands
leave behind, and never a child of its own, whose exit code its caller must get. Real bwrap
sandboxes, the real agent, the worker's `agent` op as the tunnel sends it."""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import Any

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

# every process of the sandbox: "pid ppid state name", from its own /proc
PROCESSES = """
for d in /proc/[0-9]*; do
  read -r line < "$d/stat" 2>/dev/null || continue
  rest=${line##*) }; set -- $rest
  name=${line#*(}; name=${name%%)*}
  echo "${d#/proc/} $2 $1 $name"
done
"""


def run_in(service: WorkerService, name: str) -> Any:
    async def run(code: str) -> tuple[int, str]:
        call = {"op": "exec", "language": "sh", "timeout": 30, "env": {}, "cwd": None}
        header, payload = await service.handle(
            {"op": "agent", "sandbox": name, "call": {**call, "code": code}, "timeout_s": 60},
            b"",
        )
        assert "exit_code" in header, header
        return int(header["exit_code"]), payload[: header["stdout_bytes"]].decode()

    return run


def test_the_agent_is_pid_1_and_reaps_what_commands_orphan(runtime: BwrapRuntime) -> None:
    service = WorkerService(runtime, capacity=4, state=WorkerLocalState())
    spec = SandboxSpec(name="orphans-1")
    run = run_in(service, spec.name)

    async def zombies() -> list[str]:
        _, listing = await run(PROCESSES)
        return [line for line in listing.splitlines() if line.split()[2] == "Z"]

    async def body() -> None:
        await service.provision(spec)
        _, listing = await run(PROCESSES)
        table = [line.split() for line in listing.splitlines()]
        assert table[0][:2] == ["1", "0"] and table[0][3].startswith("python3"), listing
        assert all(row[1] != "0" for row in table[1:]), "no other process of bwrap's: " + listing

        # each subshell exits at once: its sleeps are orphans, the agent's children now
        code, _ = await run("for i in 1 2 3 4 5; do (sleep 0.2 &); done; exit 7")
        assert code == 7
        await asyncio.sleep(0.6)  # the sleeps have exited, and the reaper has run
        assert await zombies() == []

        # an orphan still running is left alone, and reaped once it ends
        await run("(sleep 1.5 &)")
        _, listing = await run(PROCESSES)
        assert any(line.split()[1:] == ["1", "S", "sleep"] for line in listing.splitlines())
        await asyncio.sleep(2.0)
        assert await zombies() == []
        await service.destroy(spec.name)

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())


def test_exit_codes_stay_exact_while_orphans_come_and_go(runtime: BwrapRuntime) -> None:
    """A background process orphans a process every few ms (each one's exit wakes the
    reaper) while 240 commands run, four at a time: each gets its own exit code, none the 0
    a child whose status the reaper took would give."""
    service = WorkerService(runtime, capacity=4, state=WorkerLocalState())
    spec = SandboxSpec(name="orphans-2")
    run = run_in(service, spec.name)

    async def agent(op: str, **fields: Any) -> dict[str, Any]:
        call = {"op": op, **fields}
        header, _ = await service.handle(
            {"op": "agent", "sandbox": spec.name, "call": call, "timeout_s": 30}, b""
        )
        return header

    async def body() -> None:
        await service.provision(spec)
        churn = "while :; do (sleep 0.001 &); sleep 0.002; done"
        started = await agent("proc_start", command=churn, env={}, timeout=60)
        assert "pid" in started, started

        async def one(i: int) -> tuple[int, int]:
            code, _ = await run(f"exit {i % 50 + 1}")
            return i % 50 + 1, code

        for first in range(0, 240, 4):
            for want, got in await asyncio.gather(*(one(i) for i in range(first, first + 4))):
                assert got == want
        listed = await agent("proc_list")
        assert [p["state"] for p in listed["processes"] if p["pid"] == started["pid"]] == [
            "running"
        ]
        await service.destroy(spec.name)

    async def main() -> None:
        await runtime.prepare()
        await service.run(body)

    asyncio.run(main())
