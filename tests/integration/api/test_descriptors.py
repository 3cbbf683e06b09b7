"""A descriptor the worker inherited never reaches a sandbox."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.api.conftest import RUNTIME, Deployment

pytestmark = pytest.mark.skipif(RUNTIME != "bwrap", reason="needs the bwrap runtime")


def test_inherited_descriptor_is_not_in_the_sandbox(deployment: Deployment) -> None:
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    marker = f"pipe:[{os.fstat(write_end).st_ino}]"
    marker_fd = write_end
    log = open(deployment.data_dir / "worker-leak.log", "ab")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sandgate",
            "worker",
            "--server",
            deployment.url,
            "--name",
            "w1",
            "--runtime",
            RUNTIME,
            "--state-dir",
            str(deployment.state_dir / "leak"),
        ],
        env={**os.environ, "SANDGATE_TOKEN": deployment.worker_token},
        stdout=log,
        stderr=subprocess.STDOUT,
        pass_fds=(marker_fd,),
        start_new_session=True,
    )
    log.close()
    os.close(write_end)
    os.close(read_end)
    try:
        deployment.stop_worker()  # the session worker steps aside; this one takes its name
        deployment.worker = worker
        deployment.wait_worker("w1", connected=True)
        with deployment.client() as alpha:
            name = alpha.post("/api/v1/sandboxes", json={}).json()["name"]
            # every process of the sandbox (bwrap, its init, the agent), seen from the host
            holders = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if f"/{name}" not in Path(f"/proc/{pid}/cgroup").read_text():
                        continue
                    for fd in os.listdir(f"/proc/{pid}/fd"):
                        if os.readlink(f"/proc/{pid}/fd/{fd}") == marker:
                            holders.append(pid)
                except OSError:
                    continue
            assert holders == []
            alpha.delete(f"/api/v1/sandboxes/{name}")
    finally:
        deployment.stop_worker()
        deployment.start_worker()
