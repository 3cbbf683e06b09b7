"""Run one of tests/js's scenarios (E2B's JavaScript SDKs, pinned in tests/js/package.json and
installed by `scripts/install --dev`) under Node against a deployment: its JSON result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

JS = Path(__file__).resolve().parent / "js"


def run_scenario(script: str, *, url: str, key: str, package: str, timeout: float) -> Any:
    """`package`: the npm package the scenario needs (the test fails, never skips, without:
    CI installs it)."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: the E2B JavaScript SDK tests need Node.js 20+")
    if not (JS / "node_modules" / package).is_dir():
        pytest.fail(f"{JS / 'node_modules' / package} is missing: run `scripts/install --dev`")
    env = {**os.environ, "SANDGATE_URL": url, "SANDGATE_KEY": key}
    for name in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DOMAIN", "E2B_DEBUG"):
        env.pop(name, None)  # nothing of the caller's environment may redirect the SDK
    ran = subprocess.run(
        [node, str(JS / script)], capture_output=True, text=True, env=env, timeout=timeout, cwd=JS
    )
    lines = ran.stdout.strip().splitlines()
    assert ran.returncode == 0 and lines, f"rc {ran.returncode}\n{ran.stdout}\n{ran.stderr}"
    result = json.loads(lines[-1])
    assert result["ok"] is True, result
    return result
