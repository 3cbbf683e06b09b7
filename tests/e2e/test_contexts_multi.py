"""Code contexts through an instance that does not hold the worker's tunnel.

Worker w1 dials instance A; these tests talk to instance B, so every context call (the
kernel_bridge process's start, stdin writes and output follows: control/contexts.py) is
forwarded by B to A, the tunnel owner. Nothing about a context is kept in the control plane,
so the default context asked for by A and B at once must still be one kernel: the agent keeps
the `ctx:default` tag unique among the sandbox's running processes.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b_code_interpreter import Sandbox

from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def running_sandbox(client: httpx.Client, **metadata: str) -> str:
    created = client.post("/api/v1/sandboxes", json={"metadata": metadata, "timeout": 900})
    assert created.status_code == 201, created.text
    assert created.json()["state"] == "running", created.text
    return str(created.json()["name"])


def run(client: httpx.Client, path: str, code: str) -> list[tuple[str, Any, float]]:
    """A run's server-sent events, each with the time it arrived."""
    events: list[tuple[str, Any, float]] = []
    with client.stream("POST", path, json={"code": code}) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        kind = "message"
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[len("data: ") :]), time.time()))
    assert events and events[-1][0] == "end", events
    return events


def of(events: list[tuple[str, Any, float]], kind: str) -> list[Any]:
    return [body for name, body, _ in events if name == kind]


@pytest.fixture
def sbx(clean: Cluster) -> Iterator[Sandbox]:
    b = clean.instances["B"].url
    sandbox = Sandbox.create(api_key=clean.key, api_url=b, sandbox_url=b, timeout=600)
    try:
        yield sandbox
    finally:
        sandbox.kill()


@pytest.mark.timeout(180)
def test_the_code_interpreter_sdk_through_the_other_instance(sbx: Sandbox) -> None:
    assert sbx.run_code("x = 1").error is None
    assert sbx.run_code("x + 1").text == "2"
    logged = sbx.run_code("import sys\nprint('to out')\nprint('to err', file=sys.stderr)")
    assert logged.logs.stdout == ["to out\n"] and logged.logs.stderr == ["to err\n"]
    failed = sbx.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    plotted = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 4, 9])\nplt.show()")
    (figure,) = plotted.results
    assert "png" in figure.formats() and figure.png and len(figure.png) > 1000
    # a second context is another interpreter
    sbx.run_code("secret = 42")
    other = sbx.create_code_context()
    isolated = sbx.run_code("secret", context=other)
    assert isolated.error is not None and isolated.error.name == "NameError"
    assert sbx.run_code("secret").text == "42"
    assert {c.id for c in sbx.list_code_contexts()} == {"default", other.id}
    sbx.remove_code_context(other)


@pytest.mark.timeout(180)
def test_a_context_run_streams_live_through_the_other_instance(clean: Cluster) -> None:
    with clean.client(clean.instances["B"]) as b:
        name = running_sandbox(b, t="contexts-sse")
        base = f"/api/v1/sandboxes/{name}"
        created = b.post(f"{base}/contexts", json={"language": "python"})
        assert created.status_code == 201, created.text
        ctx = created.json()["id"]
        assert ctx in {c["id"] for c in b.get(f"{base}/contexts").json()}
        run(b, f"{base}/contexts/{ctx}/run", "import time\nkept = 41")
        code = (
            "for i in range(4):\n    print(i, time.time(), flush=True)\n    time.sleep(0.4)\n"
            "kept + 1"
        )
        events = run(b, f"{base}/contexts/{ctx}/run", code)
        lags = [
            arrived - float(body["text"].split()[1])
            for kind, body, arrived in events
            if kind == "stdout"
        ]
        assert len(lags) == 4, events
        # relayed live: each line arrives while the code runs, not all at its end 1.6 s later
        assert sorted(lags)[2] < 0.6, lags
        (main,) = of(events, "result")
        assert main["is_main_result"] is True and main["text"] == "42"
        assert events[-1][1]["context"] == ctx
        assert b.delete(f"{base}/contexts/{ctx}").status_code == 204


def first_runs_at_once(clients: tuple[httpx.Client, ...], path: str, code: str) -> list[Any]:
    """The same run posted by each client at the same moment (one thread each)."""
    barrier = threading.Barrier(len(clients))

    def one(client: httpx.Client) -> list[tuple[str, Any]]:
        barrier.wait(timeout=30)
        return [(kind, body) for kind, body, _ in run(client, path, code)]

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(clients)) as pool:
        return list(pool.map(one, clients))


@pytest.mark.timeout(240)
def test_the_default_context_asked_for_by_both_instances_at_once_is_one(clean: Cluster) -> None:
    with clean.client("A") as a, clean.client("B") as b:
        for round_ in range(3):  # a fresh sandbox each time: each one's first run races
            name = running_sandbox(b, t="contexts-default", round=str(round_))
            path = f"/api/v1/sandboxes/{name}/run-code"
            pids = set()
            for events in first_runs_at_once((a, b), path, "import os; os.getpid()"):
                assert [body for kind, body in events if kind == "error"] == [], events
                results = [body for kind, body in events if kind == "result"]
                assert len(results) == 1 and results[0]["is_main_result"] is True, events
                assert events[-1][0] == "end" and events[-1][1]["context"] == "default"
                pids.add(results[0]["text"])
            assert len(pids) == 1, f"two kernels answered the default context: {pids}"
            for client in (a, b):
                listed = client.get(f"/api/v1/sandboxes/{name}/contexts")
                assert listed.status_code == 200, listed.text
                assert [c["id"] for c in listed.json()] == ["default"], listed.json()
