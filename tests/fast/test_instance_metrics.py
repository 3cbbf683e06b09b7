"""An instance's `/metrics` (api/metrics.py), read back with prometheus-client's own parser:
the series exist, move with what the instance serves, label routes by template, and the
endpoint can sit behind a token."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.fast.conftest import Fast, fast_deployment

pytestmark = pytest.mark.anyio

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "sandgate-dashboard.json"


async def scrape(client: httpx.AsyncClient, **headers: str) -> dict[str, list[Sample]]:
    got = await client.get("/metrics", headers=headers)
    assert got.status_code == 200, got.text
    assert got.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f.samples for f in text_string_to_metric_families(got.text)}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_the_series_move_with_what_the_instance_serves(fast: Fast) -> None:
    before = await scrape(fast.api)
    for family in (
        "sandgate_http_request_duration_seconds",
        "sandgate_sandbox_create_to_running_seconds",
        "sandgate_execute_seconds",
        "sandgate_store_statement_duration_seconds",
        "sandgate_sandboxes",
        "sandgate_worker_capacity",
        "sandgate_worker_sandboxes",
        "sandgate_worker_connected",
        "sandgate_admission_queue_length",
        "sandgate_scheduling_breaker_state",
        "sandgate_tunnels",
        "sandgate_tunnel_attaches",
        "sandgate_tunnel_losses",
        "sandgate_forwarded_requests",
        "process_cpu_seconds",
    ):
        assert family in before, family
    created = await fast.api.post("/api/v1/sandboxes", json={})
    assert created.status_code == 201, created.text
    name = created.json()["name"]
    ran = await fast.api.post(f"/api/v1/sandboxes/{name}/execute", json={"code": "echo ok"})
    assert ran.status_code == 200
    assert (await fast.api.get(f"/api/v1/sandboxes/{name}-nope")).status_code == 404
    after = await scrape(fast.api)

    requests = after["sandgate_http_request_duration_seconds"]
    count = "sandgate_http_request_duration_seconds_count"
    assert value(requests, count, method="POST", route="/api/v1/sandboxes", status="201") == 1
    # the route's template, never the sandbox's name: bounded label values
    assert value(requests, count, route="/api/v1/sandboxes/{name}", status="404") == 1
    assert not any(name in s.labels.get("route", "") for s in requests)
    created_count = "sandgate_sandbox_create_to_running_seconds_count"
    assert value(after["sandgate_sandbox_create_to_running_seconds"], created_count) == 1
    assert (
        value(after["sandgate_execute_seconds"], "sandgate_execute_seconds_count", outcome="ok")
        == 1
    )
    assert value(after["sandgate_sandboxes"], "sandgate_sandboxes", state="running") == 1
    assert value(after["sandgate_worker_sandboxes"], "sandgate_worker_sandboxes") == 1
    assert value(after["sandgate_worker_connected"], "sandgate_worker_connected") == 1
    assert value(after["sandgate_tunnels"], "sandgate_tunnels") == 1
    statements = "sandgate_store_statement_duration_seconds_count"
    assert value(after["sandgate_store_statement_duration_seconds"], statements) > value(
        before["sandgate_store_statement_duration_seconds"], statements
    )


async def test_a_metrics_token_keeps_others_out(tmp_path: Path) -> None:
    async with fast_deployment(tmp_path, metrics_token="s3cret") as fast:
        refused = await fast.api.get("/metrics")  # a tenant's key is not the metrics token
        assert refused.status_code == 401 and "metrics token" in refused.text
        wrong = await fast.api.get("/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert "sandgate_tunnels" in await scrape(fast.api, Authorization="Bearer s3cret")


async def test_the_sample_dashboard_asks_only_for_series_that_exist(fast: Fast) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    asked = {
        re.sub(r"_(bucket|count|sum|total)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\b(?:sandgate|process)_[a-z_]+", target["expr"])
    }
    exported = set(await scrape(fast.api))
    assert asked and asked <= exported, asked - exported
