"""E2B's code interpreter JavaScript SDK, unmodified, against a real server and worker.

The scenario is tests/js/code_interpreter_scenario.mjs, run under Node with
`@e2b/code-interpreter` pinned in tests/js/package.json (installed by `scripts/install --dev`):
`Sandbox.create()` asks for `code-interpreter-v1`, `runCode` and the context calls go to port
49999 of the sandbox (api/e2b/interpreter.py). It prints one JSON line.
"""

from __future__ import annotations

from tests.integration.api.conftest import Deployment
from tests.js_scenarios import run_scenario


def test_e2b_js_code_interpreter_scenario(deployment: Deployment) -> None:
    result = run_scenario(
        "code_interpreter_scenario.mjs",
        url=deployment.url,
        key=deployment.keys["alpha"],
        package="@e2b/code-interpreter",
        timeout=180,
    )
    assert result["state"] == "2"
    assert result["logs"] == {"stdout": ["to out\n"], "stderr": ["to err\n"]}
    assert result["executionError"] == "ZeroDivisionError"
    assert result["png"] is True
    assert result["contexts"] == {"isolated": "NameError", "removed": True}
    assert result["removedAfter"] == ["default"]
    assert result["killed"] is True
