"""An API instance's Prometheus metrics (`GET /metrics`), with prometheus-client.

Each instance exports its own: what it served (requests by route and status, creates from
accept to running, executes), what it holds (tunnels, their attaches and losses, requests
it forwarded to a peer), its store's statement latency, its process; and what the store says
for the whole deployment (sandboxes by state, workers' capacity and use, the admission
queue, the breaker), read once per scrape. Prometheus sums the per-instance series; the
deployment-wide gauges are the same on every instance (take `max` of them).

The registry is the app's own (`CollectorRegistry`), not prometheus-client's global one, so
two apps in one process (the tests) never share a series.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.datastructures import State
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandgate.control.admission import Admission
from sandgate.control.state import ServerLocalState
from sandgate.control.workers import WorkerRegistry
from sandgate.store.base import Sandbox, Store

LATENCY_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
STORE_BUCKETS: Final = (0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0)
SANDBOX_STATES: Final = ("pending", "running", "stopped", "error", "deleted")
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"


class ApiMetrics:
    def __init__(self, state: ServerLocalState, statements: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Histogram(
            "sandgate_http_request_duration_seconds",
            "HTTP requests this instance answered, by route template and status, to the end of "
            "the response body.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.create_to_running = Histogram(
            "sandgate_sandbox_create_to_running_seconds",
            "From a create's accept to its sandbox running, for creates answered here.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.execute = Histogram(
            "sandgate_execute_seconds",
            "POST /api/v1/sandboxes/{name}/execute, by outcome (ok, timed_out, error).",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.store_statement = Histogram(
            "sandgate_store_statement_duration_seconds",
            "Statements this instance sent to its store, each from send to result.",
            buckets=STORE_BUCKETS,
            registry=r,
        )
        self.sandboxes = Gauge(
            "sandgate_sandboxes",
            "Sandboxes of the deployment by state (the store's count; the same on every instance).",
            ["state"],
            registry=r,
        )
        self.worker_capacity = Gauge(
            "sandgate_worker_capacity",
            "Each worker's sandbox slots, as it reported them.",
            ["worker"],
            registry=r,
        )
        self.worker_sandboxes = Gauge(
            "sandgate_worker_sandboxes", "Live sandboxes on each worker.", ["worker"], registry=r
        )
        self.worker_connected = Gauge(
            "sandgate_worker_connected",
            "1 when the worker's tunnel is held by some instance.",
            ["worker"],
            registry=r,
        )
        self.queue_length = Gauge(
            "sandgate_admission_queue_length",
            "Creates waiting for capacity, deployment-wide.",
            registry=r,
        )
        self.breaker_open = Gauge(
            "sandgate_scheduling_breaker_state",
            "The scheduling breaker: 0 closed, 1 half-open, 2 open.",
            registry=r,
        )
        r.register(_InstanceCollector(state, statements))
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)

    def created(self, sandbox: Sandbox, *, replayed: bool) -> None:
        """A create answered here: its accept-to-running time (a replay's was counted once)."""
        if not replayed and sandbox.started_at is not None:
            took = (sandbox.started_at - sandbox.created_at).total_seconds()
            self.create_to_running.observe(max(0.0, took))

    async def refresh(self, store: Store, workers: WorkerRegistry, admission: Admission) -> None:
        """Read the deployment-wide figures from the store (once per scrape)."""
        counts = await store.count_sandboxes_by_state()
        for name in SANDBOX_STATES:
            self.sandboxes.labels(name).set(counts.get(name, 0))
        self.worker_capacity.clear()
        self.worker_sandboxes.clear()
        self.worker_connected.clear()
        for worker in await store.list_workers():
            self.worker_capacity.labels(worker.name).set(worker.capacity)
            usage = await store.worker_usage(worker.name)
            self.worker_sandboxes.labels(worker.name).set(usage.sandboxes)
            connected = await workers.is_connected(worker.name)
            self.worker_connected.labels(worker.name).set(1 if connected else 0)
        status = await admission.status(None)
        self.queue_length.set(status["queue"]["length"])
        states = {"closed": 0, "half_open": 1, "open": 2}
        self.breaker_open.set(states.get(status["breaker"]["state"], 0))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _InstanceCollector(Collector):
    """The counters the control plane keeps in `ServerLocalState`, read at scrape time."""

    def __init__(self, state: ServerLocalState, statements: Callable[[], int]) -> None:
        self.state = state
        self.statements = statements

    def collect(self) -> Iterable[Metric]:
        s = self.state
        yield CounterMetricFamily(
            "sandgate_store_statements",
            "Statements this instance sent to its store.",
            value=self.statements(),
        )
        yield GaugeMetricFamily(
            "sandgate_tunnels", "Worker tunnels held by this instance.", value=len(s.tunnels)
        )
        yield CounterMetricFamily(
            "sandgate_tunnel_attaches",
            "Worker tunnels this instance accepted and started serving.",
            value=s.tunnel_attaches,
        )
        yield CounterMetricFamily(
            "sandgate_tunnel_losses",
            "Worker tunnels this instance dropped because they went silent (a partition).",
            value=s.tunnel_losses,
        )
        yield CounterMetricFamily(
            "sandgate_forwarded_requests",
            "Requests for a worker whose tunnel another instance holds, relayed to it.",
            value=s.forwarded,
        )
        left = CounterMetricFamily(
            "sandgate_queue_clients_left",
            "Queued creates whose client left: kept (keyed) or abandoned (unkeyed).",
            labels=["outcome"],
        )
        for outcome, count in sorted(s.queue_clients_left.items()):
            left.add_metric([outcome], count)
        yield left


class RequestMetrics:
    """ASGI middleware: each HTTP request's duration to the end of its body, labelled with
    the route's template (`/api/v1/sandboxes/{name}`, never the name itself: bounded
    cardinality; `unmatched` for paths no route has)."""

    def __init__(self, app: ASGIApp, *, state: State) -> None:
        self.app = app
        self.state = state  # the app's: its services (and metrics) exist once it started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        services = getattr(self.state, "services", None)
        if scope["type"] != "http" or services is None:
            await self.app(scope, receive, send)
            return
        metrics: ApiMetrics = services.metrics
        started = time.perf_counter()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            metrics.requests.labels(scope.get("method", ""), template, str(status)).observe(
                time.perf_counter() - started
            )
