"""E2B's official JavaScript SDK, unmodified, against a real server and worker (docs/e2b.md).

The scenario is tests/js/e2b_scenario.mjs, run under Node with the SDK pinned in
tests/js/package.json (installed by `scripts/install --dev`). It prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.api.conftest import Deployment

JS = Path(__file__).resolve().parents[2] / "js"


def test_e2b_js_sdk_scenario(deployment: Deployment) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: the E2B JavaScript SDK test needs Node.js 20+")
    if not (JS / "node_modules" / "e2b").is_dir():
        pytest.fail(f"{JS / 'node_modules'} is missing: run `scripts/install --dev`")
    env = {
        **os.environ,
        "SANDGATE_URL": deployment.url,
        "SANDGATE_KEY": deployment.keys["alpha"],
    }
    for name in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN", "E2B_DEBUG"):
        env.pop(name, None)
    ran = subprocess.run(
        [node, str(JS / "e2b_scenario.mjs")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=JS,
    )
    lines = ran.stdout.strip().splitlines()
    assert ran.returncode == 0 and lines, f"rc {ran.returncode}\n{ran.stdout}\n{ran.stderr}"
    result = json.loads(lines[-1])
    assert result["ok"] is True, result
    assert result["commands"] == {"stdout": "hi\n", "exitCode": 0, "envs": "hello-yes\n"}
    assert result["background"] == "tick 1\ntick 2\ntick 3\n"
    assert result["files"] == {"listed": ["a.txt", "big.bin"], "bytes": 1 << 20}
    assert result["pty"] is True and result["killed"] is True
    assert result["listing"] == 2
