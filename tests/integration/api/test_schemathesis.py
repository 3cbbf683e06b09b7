"""Schemathesis against the real server and worker, from its own `/openapi.json`: every
operation with generated inputs, bounded; not one answer is a server error, and every answer
conforms to the document (the statuses each route lists: api/responses.py).

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

# generated inputs per operation: bounded, so CI stays within time (more, locally:
# SANDGATE_SCHEMATHESIS_EXAMPLES=25)
MAX_EXAMPLES = int(os.environ.get("SANDGATE_SCHEMATHESIS_EXAMPLES", "3"))
# no server error, and every answer is one the document lists: its status, its content type,
# its body's schema, its documented headers (Retry-After on 429 and 503)
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
)


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # generated code runs for at most 10 s (a generated `timeout` above it is a 400): a run
    # once held a context for 90 s, and its stream (then without a beat) outlived the client
    deployment = start_deployment(
        tmp_path_factory.mktemp("schemathesis"),
        worker=False,
        server_args=("--max-exec-timeout", "10"),
    )
    try:
        sandgate("tenants", "limit", "--db", deployment.db, "alpha", "--max-sandboxes", "3")
        deployment.start_worker()
        yield deployment
    finally:
        tear_down(deployment)


@pytest.mark.timeout(420)
def test_generated_requests_get_no_server_error_and_documented_answers(
    dep: Deployment, tmp_path: Path
) -> None:
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
            ",".join(CHECKS),
            "--max-examples",
            str(MAX_EXAMPLES),
            "--phases",
            # the schema's examples, then its boundaries and each value it must refuse
            # (deterministic: this found the undocumented 200 of an idempotent replay), then
            # MAX_EXAMPLES generated inputs
            "examples,coverage,fuzzing",
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
    # its report: the failures first (the warnings that follow them can be long)
    start = done.stdout.find("FAILURES")
    report = done.stdout[start : start + 8000] if start >= 0 else done.stdout[-8000:]
    assert done.returncode == 0, report + done.stderr[-2000:]
