"""E2B's official JavaScript SDK, unmodified, against a real server and worker (docs/e2b.md).

The scenario is tests/js/e2b_scenario.mjs, run under Node with the SDK pinned in
tests/js/package.json (installed by `scripts/install --dev`). It prints one JSON line.
"""

from __future__ import annotations

from tests.integration.api.conftest import Deployment
from tests.js_scenarios import run_scenario


def test_e2b_js_sdk_scenario(deployment: Deployment) -> None:
    result = run_scenario(
        "e2b_scenario.mjs",
        url=deployment.url,
        key=deployment.keys["alpha"],
        package="e2b",
        timeout=120,
    )
    assert result["commands"] == {"stdout": "hi\n", "exitCode": 0, "envs": "hello-yes\n"}
    assert result["background"] == "tick 1\ntick 2\ntick 3\n"
    assert result["files"] == {"listed": ["a.txt", "big.bin"], "bytes": 1 << 20}
    assert result["pty"] is True and result["killed"] is True
    assert result["listing"] == 2
