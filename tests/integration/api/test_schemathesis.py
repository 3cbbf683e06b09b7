"""Schemathesis against the real server and worker, from its own `/openapi.json`: every
operation with generated inputs, bounded, and not one answer is a server error.

A deployment of its own: the tenant may hold 3 sandboxes (a generated create beyond them is
a 429, not a queued wait), and the create queue is off (at capacity: a clear 503 at once)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.api.conftest import Deployment, sandgate, start_deployment, tear_down

pytestmark = pytest.mark.bwrap

MAX_EXAMPLES = 3  # per operation, generated inputs only: bounded, so CI stays within time


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = start_deployment(tmp_path_factory.mktemp("schemathesis"), worker=False)
    try:
        sandgate("tenants", "limit", "--db", deployment.db, "alpha", "--max-sandboxes", "3")
        deployment.start_worker()
        yield deployment
    finally:
        tear_down(deployment)


@pytest.mark.timeout(420)
def test_no_generated_request_gets_a_server_error(dep: Deployment, tmp_path: Path) -> None:
    st = Path(sys.executable).with_name("st")  # scripts/install --dev installs it
    assert st.exists(), "schemathesis is missing: run scripts/install --dev"
    done = subprocess.run(
        [
            str(st),
            "run",
            f"{dep.url}/openapi.json",
            "--header",
            f"Authorization: Bearer {dep.keys['alpha']}",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            str(MAX_EXAMPLES),
            "--phases",
            "fuzzing",
            "--workers",
            "1",
            "--request-timeout",
            "30",
            "--generation-deterministic",
            # the proxied servers inside sandboxes answer what they answer
            "--exclude-path-regex",
            "/ports/",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_COLOR": "1"},
        cwd=tmp_path,  # its .schemathesis/ goes there, not into the checkout
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
