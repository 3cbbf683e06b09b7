"""A long-lived loop of a real server fails: it is logged with its traceback, restarted with
backoff, named in /readyz (503) while it keeps failing, and the instance is ready again once
it runs a healthy iteration.

The fault is the `fail-reaper` fault point (sandgate.faults): the reaper's first 4
iterations raise inside its tick, then it runs normally. No worker is needed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.api.conftest import Deployment, start_deployment, tear_down, wait_until


@pytest.fixture
def failing_reaper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Deployment]:
    monkeypatch.setenv("SANDGATE_FAULTS", "fail-reaper")  # the server inherits it
    dep = start_deployment(tmp_path, worker=False)
    try:
        yield dep
    finally:
        tear_down(dep)


def readyz(dep: Deployment) -> httpx.Response:
    return httpx.get(f"{dep.url}/readyz", timeout=30)


def reaper_problems(answer: httpx.Response) -> list[str]:
    return [p for p in answer.json()["problems"] if p.startswith("loop reaper: ")]


def test_a_failing_loop_is_logged_restarted_with_backoff_and_fails_readyz_until_it_heals(
    failing_reaper: Deployment,
) -> None:
    dep = failing_reaper
    seen: list[httpx.Response] = []

    def degraded() -> bool:
        answer = readyz(dep)
        seen.append(answer)
        return answer.status_code == 503 and bool(reaper_problems(answer))

    wait_until(degraded, timeout=20, what="/readyz 503 naming the reaper")
    answer = seen[-1]
    assert answer.json()["status"] == "degraded", answer.text
    [problem] = reaper_problems(answer)
    assert re.match(r"loop reaper: failing since \d{4}-\d\d-\d\dT[\d:]+\+00:00, [34] ", problem)
    assert "(RuntimeError: fault fail-reaper: " in problem, problem
    assert not [p for p in answer.json()["problems"] if p.startswith("loop recovery")]

    healed_at = time.monotonic()
    wait_until(lambda: readyz(dep).status_code == 200, timeout=30, what="/readyz ok again")
    assert readyz(dep).json()["problems"] == []
    assert time.monotonic() - healed_at < 30

    log = (dep.data_dir / "server.log").read_text(errors="replace")
    for name in ("reaper", "recovery"):
        assert re.search(rf"loop\.started interval=[\d.]+ loop='{name}' tick_timeout=", log), log
    failed = [line for line in log.splitlines() if " loop.failed " in line + " "]
    assert len(failed) == 4, log
    # each failure with its traceback, ending in the error the tick raised
    assert log.count("Traceback (most recent call last):") >= 4, log
    assert "RuntimeError: fault fail-reaper: 0 more failures to come" in log, log
    retries = re.findall(r"loop\.restarting failures=(\d) loop='reaper' retry_in=([\d.]+)", log)
    assert retries == [("1", "0.5"), ("2", "1.0"), ("3", "2.0"), ("4", "4.0")], log
    assert "loop.recovered failures=4 loop='reaper'" in log, log
    assert dep.server is not None and dep.server.poll() is None  # it rode the fault out
