"""E2B's code interpreter JavaScript SDK, unmodified, against a real server and worker.

The scenario is tests/js/code_interpreter_scenario.mjs, run under Node with
`@e2b/code-interpreter` pinned in tests/js/package.json (installed by `scripts/install --dev`):
`Sandbox.create()` asks for `code-interpreter-v1`, `runCode` and the context calls go to port
49999 of the sandbox (api/e2b/interpreter.py). It prints one JSON line.
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


def test_e2b_js_code_interpreter_scenario(deployment: Deployment) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: the E2B JavaScript SDK test needs Node.js 20+")
    if not (JS / "node_modules" / "@e2b" / "code-interpreter").is_dir():
        pytest.fail(f"{JS / 'node_modules'} is missing: run `scripts/install --dev`")
    env = {
        **os.environ,
        "SANDGATE_URL": deployment.url,
        "SANDGATE_KEY": deployment.keys["alpha"],
    }
    for name in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN", "E2B_DEBUG"):
        env.pop(name, None)
    ran = subprocess.run(
        [node, str(JS / "code_interpreter_scenario.mjs")],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=JS,
    )
    lines = ran.stdout.strip().splitlines()
    assert ran.returncode == 0 and lines, f"rc {ran.returncode}\n{ran.stdout}\n{ran.stderr}"
    result = json.loads(lines[-1])
    assert result["ok"] is True, result
    assert result["state"] == "2"
    assert result["logs"] == {"stdout": ["to out\n"], "stderr": ["to err\n"]}
    assert result["executionError"] == "ZeroDivisionError"
    assert result["png"] is True
    assert result["contexts"] == {"isolated": "NameError", "removed": True}
    assert result["removedAfter"] == ["default"]
    assert result["killed"] is True
