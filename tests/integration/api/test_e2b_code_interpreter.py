"""E2B's code interpreter SDK (`e2b_code_interpreter`, pinned), unmodified, against sandgate.

`Sandbox.create()` with no template asks for `code-interpreter-v1`; `run_code` goes to port
49999 of the sandbox (api/e2b/interpreter.py), over the sandbox's code contexts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from e2b_code_interpreter import AsyncSandbox, Sandbox

from tests.integration.api.conftest import Deployment


@pytest.fixture
def sbx(deployment: Deployment) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(
        api_key=deployment.keys["alpha"], api_url=deployment.url, sandbox_url=deployment.url
    )
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_run_code_state_logs_errors_results(sbx: Sandbox) -> None:
    assert sbx.run_code("x = 1").error is None
    assert sbx.run_code("x + 1").text == "2"
    seen: list[str] = []
    logged = sbx.run_code(
        "import sys\nprint('to out')\nprint('to err', file=sys.stderr)",
        on_stdout=lambda message: seen.append(message.line),
    )
    assert logged.logs.stdout == ["to out\n"] and logged.logs.stderr == ["to err\n"]
    assert seen == ["to out\n"]
    failed = sbx.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    plotted = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.show()")
    (figure,) = plotted.results
    assert "png" in figure.formats() and figure.png and len(figure.png) > 1000
    frame = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    assert frame.results[0].html and "<table" in frame.results[0].html
    assert sbx.run_code("x", envs={"E": "1"}).text == "1"
    assert sbx.run_code("import os; os.environ['E']", envs={"E": "only here"}).text == (
        "'only here'"
    )


def test_a_second_context_is_isolated(sbx: Sandbox) -> None:
    sbx.run_code("secret = 42")
    other = sbx.create_code_context()
    isolated = sbx.run_code("secret", context=other)
    assert isolated.error is not None and isolated.error.name == "NameError"
    assert sbx.run_code("secret").text == "42"
    ids = {context.id for context in sbx.list_code_contexts()}
    assert other.id in ids
    sbx.restart_code_context(other)
    sbx.remove_code_context(other)


def test_async_sdk(deployment: Deployment) -> None:
    async def scenario() -> None:
        sbx = await AsyncSandbox.create(
            api_key=deployment.keys["alpha"], api_url=deployment.url, sandbox_url=deployment.url
        )
        try:
            await sbx.run_code("y = 20")
            assert (await sbx.run_code("y * 2 + 2")).text == "42"
        finally:
            await sbx.kill()

    asyncio.run(scenario())


def test_bash_through_the_sdk(sbx: Sandbox) -> None:
    assert sbx.run_code("x=41; cd /tmp", language="bash").error is None
    ran = sbx.run_code("echo $((x + 1)) $(pwd)", language="bash")
    assert ran.logs.stdout == ["42 /tmp\n"], ran
    shell = sbx.create_code_context(language="bash")
    assert shell.language == "bash"
    apart = sbx.run_code("echo [$x]", context=shell)
    assert apart.logs.stdout == ["[]\n"], "a second bash context is another shell"
    failed = sbx.run_code("false", context=shell)
    assert failed.error is not None and failed.error.name == "CommandExitError"


def test_a_quiet_run_beats_and_the_sdk_reads_past_the_beats(
    sbx: Sandbox, deployment: Deployment
) -> None:
    """A cell quiet for longer than 5 s gets `keepalive` lines, as E2B's own server sends
    (a client's read timeout, or a proxy, would take silence for a dead stream)."""
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49999",
        "X-Access-Token": str(sbx._envd_access_token),
    }
    body = {"code": "import time; time.sleep(6); 6 * 7"}
    with httpx.stream(
        "POST", f"{deployment.url}/execute", json=body, headers=headers, timeout=60
    ) as answer:
        assert answer.status_code == 200, answer.read()
        kinds = [json.loads(line)["type"] for line in answer.iter_lines() if line]
    assert "keepalive" in kinds and kinds[-1] == "end_of_execution", kinds
    assert sbx.run_code("import time; time.sleep(6); 6 * 7").text == "42"
