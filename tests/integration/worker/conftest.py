"""Fixtures of the bwrap runtime tests: a state root, an agent dir and uid range of their own."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandgate.worker import cgroups
from sandgate.worker.main import install_agent
from sandgate.worker.runtime.bwrap import BwrapRuntime
from tests.statedirs import held_as_live

UID_BASE = 281000  # away from the default range of a real worker on this host
UID_COUNT = 500
SRC = Path(__file__).resolve().parents[3] / "src" / "sandgate" / "agent"


@dataclass
class Env:
    root: Path
    agent_dir: Path
    lock_dir: Path
    worker: str
    workers: list[str]

    def runtime(self, worker: str | None = None, **kw: Any) -> BwrapRuntime:
        return BwrapRuntime(
            self.root / "state" / (worker or self.worker),
            self.agent_dir,
            worker_name=worker or self.worker,
            uid_base=UID_BASE,
            uid_count=UID_COUNT,
            uid_lock_dir=self.lock_dir,
            **kw,
        )


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    root = Path(f"/var/lib/sandgate-test-{secrets.token_hex(4)}")
    root.mkdir(mode=0o711)
    os.chmod(root, 0o711)
    agent_dir = root / "agent"
    agent_dir.mkdir()
    os.chmod(agent_dir, 0o755)
    (agent_dir / "agent.py").write_text("import sys\nsys.exit(0)\n")
    shutil.copy(SRC / "frames.py", agent_dir / "frames.py")
    for f in agent_dir.iterdir():
        os.chmod(f, 0o644)
    e = Env(root, agent_dir, root / "uids", f"t-{secrets.token_hex(3)}", [])
    try:
        with held_as_live(root):
            yield e
    finally:
        host = cgroups.CgroupHost.detect()
        for w in {e.worker, *e.workers}:
            asyncio.run(cgroups.cleanup_worker(host, w))
            cgroups.remove_worker_groups(host, w)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def rt(env: Env) -> BwrapRuntime:
    runtime = env.runtime()
    asyncio.run(runtime.prepare())
    return runtime


def other_runtime(env: Env, **kw: Any) -> BwrapRuntime:
    worker = f"t-{secrets.token_hex(3)}"
    env.workers.append(worker)
    return env.runtime(worker, **kw)


SERVICE_UID_BASE = 283000  # away from the ranges of real workers and other tests on this host
SERVICE_UID_COUNT = 100


@pytest.fixture
def runtime() -> Iterator[BwrapRuntime]:
    """A bwrap runtime with the real agent installed, not yet prepared."""
    root = Path(f"/var/lib/sandgate-test-{secrets.token_hex(4)}")
    root.mkdir(mode=0o711)
    os.chmod(root, 0o711)
    install_agent(root / "agent")
    worker = f"d-{secrets.token_hex(3)}"
    rt = BwrapRuntime(
        root / "state",
        root / "agent",
        worker_name=worker,
        uid_base=SERVICE_UID_BASE,
        uid_count=SERVICE_UID_COUNT,
        uid_lock_dir=root / "uids",
        # a shell started ahead of each command whatever the host's load (agent/pressure.py):
        # what the tests see must not depend on what else runs on the machine
        cpu_pressure="off",
    )
    try:
        with held_as_live(root):
            yield rt
    finally:
        host = cgroups.CgroupHost.detect()
        asyncio.run(cgroups.cleanup_worker(host, worker))
        cgroups.remove_worker_groups(host, worker)
        shutil.rmtree(root, ignore_errors=True)
