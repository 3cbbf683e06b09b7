"""The unisolated development runtime: runs a probe, stop kills everything it started."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import textwrap
import time
from pathlib import Path

import pytest

from sandgate.errors import InvalidRequestError, WorkerError
from sandgate.worker.runtime.base import SandboxSpec
from sandgate.worker.runtime.process import ProcessRuntime

PY = ["/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3", "-I", "-S", "-c"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_features_claim_no_protection(tmp_path: Path) -> None:
    f = ProcessRuntime(tmp_path, tmp_path, worker_name="dev").features()
    assert f["runtime"] == "process"
    assert f["isolation"] is False
    assert not any(v for k, v in f.items() if isinstance(v, bool))
    assert not any(f["limits"].values())


def test_probe_runs_and_stop_kills_its_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rt = ProcessRuntime(tmp_path / "state", tmp_path / "agent", worker_name="dev")
    probe = textwrap.dedent(
        """
        import json, os, sys, time
        kids = []
        for i in range(2):
            pid = os.fork()
            if pid == 0:
                if i == 1:
                    os.setsid()  # leaves the process group, like the agent's exec children
                time.sleep(1000)
                os._exit(0)
            kids.append(pid)
        print(json.dumps({"cwd": os.getcwd(), "env": dict(os.environ), "kids": kids,
                          "pgid": os.getpgid(0), "pid": os.getpid()}), flush=True)
        sys.stdin.read()
        time.sleep(1000)
        """
    )

    async def main() -> list[int]:
        with caplog.at_level(logging.WARNING):
            await rt.prepare()
            sb = await rt.start(SandboxSpec(name="p1", env={"FOO": "bar"}), argv=[*PY, probe])
        assert any("runtime.unisolated" in r.getMessage() for r in caplog.records)
        assert sb.process.stdout is not None
        line = await asyncio.wait_for(sb.process.stdout.readline(), 30)
        r = json.loads(line)
        assert r["cwd"] == str(sb.workspace)
        assert r["env"]["FOO"] == "bar"
        assert r["env"]["HOME"] == str(sb.workspace)
        assert r["pgid"] == r["pid"] == sb.process.pid  # its own session/group
        assert all(_alive(k) for k in r["kids"])
        sandbox_dir = sb.private["sandbox_dir"]
        await rt.stop(sb)
        assert sb.process.returncode is not None
        assert not sandbox_dir.exists()
        await rt.stop(sb)  # idempotent
        kids: list[int] = r["kids"]
        return kids

    kids = asyncio.run(main())
    deadline = time.monotonic() + 3
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(k) for k in kids)


def test_default_argv_is_the_agent(tmp_path: Path) -> None:
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "agent.py").write_text("import sys\nprint(' '.join(sys.argv[1:]), flush=True)\n")
    rt = ProcessRuntime(tmp_path / "state", agent_dir, worker_name="dev")

    async def main() -> str:
        await rt.prepare()
        sb = await rt.start(SandboxSpec(name=f"a-{secrets.token_hex(2)}"))
        try:
            out, _ = await asyncio.wait_for(sb.process.communicate(), 30)
            return out.decode().strip()
        finally:
            await rt.stop(sb)

    out = asyncio.run(main())
    assert out.startswith("--workspace /") and "/workspace --tmp /" in out


def test_bad_names_and_duplicates(tmp_path: Path) -> None:
    rt = ProcessRuntime(tmp_path / "state", tmp_path, worker_name="dev")

    async def main() -> None:
        await rt.prepare()
        with pytest.raises(InvalidRequestError):
            await rt.start(SandboxSpec(name="../x"), argv=["/bin/true"])
        sb = await rt.start(SandboxSpec(name="dup"), argv=["/bin/sleep", "100"])
        try:
            with pytest.raises(WorkerError, match="already exists"):
                await rt.start(SandboxSpec(name="dup"), argv=["/bin/true"])
        finally:
            await rt.stop(sb)

    asyncio.run(main())
