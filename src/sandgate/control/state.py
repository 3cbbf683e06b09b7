"""What an API instance keeps only in memory, and the rows of its in-process state.

`ServerLocalState` is every piece of state the server holds outside the store, created by the
app's lifespan (`api/app.py`) and passed to the services. Each field says what it holds, its
bound and what happens with N instances; `SERVER_STATE` is its rows (with the state the
control plane's objects keep on `self`) in the one table `sandgate state-table` prints
(`cli/state_table.py`, docs/state.md). The worker's are in `worker/state.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeVar

from sandgate.local_state import StateRow

if TYPE_CHECKING:
    from sandgate.core.loops import LoopHealth
    from sandgate.store.base import ApiKey, Sandbox, TenantLimits
    from sandgate.tunnel.hub import TunnelSession
    from sandgate.tunnel.rpc import RpcChannel


K = TypeVar("K")
V = TypeVar("V")

RUNNING_CACHE_TTL = 1.0  # seconds a running sandbox's record is reused by this instance
OWNER_CACHE_TTL = 1.0  # seconds a tunnel owner read from the store is reused


def _fresh(entries: dict[K, tuple[V, float]], key: K, ttl: float) -> tuple[V, float] | None:
    """A cache entry (value, stored at monotonic) no older than `ttl` seconds."""
    hit = entries.get(key)
    return None if hit is None or time.monotonic() - hit[1] > ttl else hit


def _remember(entries: dict[K, tuple[V, float]], key: K, value: V, limit: int) -> None:
    """Store an entry; a cache at its bound starts over (every entry is short-lived)."""
    if len(entries) >= limit:
        entries.clear()
    entries[key] = (value, time.monotonic())


@dataclass
class ServerLocalState:
    # worker name -> its live tunnel. Per-process by nature: a WebSocket lives in the process
    # it dialed; other instances find the owner through the store's tunnel_owners.
    tunnels: dict[str, TunnelSession] = field(default_factory=dict)
    # (tenant, idempotency digest) -> the first create's result. Same-instance retries wait on
    # it; across instances the store's unique (tenant, digest) index is the final word.
    inflight_creates: dict[tuple[str, str], asyncio.Future[Sandbox]] = field(default_factory=dict)
    # key hash -> (key, fetched at monotonic): avoids a store read per request. A revoked key
    # keeps working on an instance for at most `auth_cache_ttl`.
    auth_cache: dict[str, tuple[ApiKey, float]] = field(default_factory=dict)
    # (tenant, sandbox) -> (its running record, read at monotonic): spares the store read on
    # every execute and toolbox call. Trusted for RUNNING_CACHE_TTL; cleared here on stop,
    # delete and extend. Under N instances a sandbox stopped elsewhere is gone from its worker,
    # which then answers 409: the cache never lets a call reach a stopped sandbox.
    running_sandboxes: dict[tuple[str, str], tuple[Sandbox, float]] = field(default_factory=dict)
    # worker -> (node_url of the instance holding its tunnel, read at monotonic): spares the
    # store read on every forwarded call. Trusted for OWNER_CACHE_TTL and dropped when that
    # instance answers that it no longer holds the tunnel (which it never forwards: hop guard).
    owner_cache: dict[str, tuple[str, float]] = field(default_factory=dict)
    # peer node_url -> (what is wrong with it, when seen, monotonic): it answered HTML or
    # refused our signature. Per-process by nature: what this instance saw; /readyz shows the
    # ones seen in the last 15 s (each failed call renews it), so a fixed peer stops counting.
    peer_problems: dict[str, tuple[str, float]] = field(default_factory=dict)
    # (why the store took no write or "" when it took one, probed at monotonic): /readyz
    # writes to the store at most once a second per instance and reuses the answer meanwhile.
    store_probe: tuple[str, float] | None = None
    # tunnels this instance gave up on because they went silent (a partition): a counter
    # for /metrics, kept apart from scheduling timeouts.
    tunnel_losses: int = 0
    # tunnels this instance accepted and served, and requests it relayed to the instance
    # holding a worker's tunnel: counters for /metrics
    tunnel_attaches: int = 0
    forwarded: int = 0
    # queued creates whose client left, by what became of them: "kept" (keyed: it goes on
    # and the retry with the key takes it over) or "abandoned" (unkeyed): for /metrics.
    queue_clients_left: dict[str, int] = field(default_factory=lambda: {"kept": 0, "abandoned": 0})
    # loop name -> its health as the supervisor and the heartbeat handler record it (the
    # reaper, recovery, the owner renewal of each attached worker): /readyz names the ones
    # failing. Per-process by nature: each instance runs its own loops and reports them.
    loops: dict[str, LoopHealth] = field(default_factory=dict)

    def cached_running(self, tenant: str, name: str) -> Sandbox | None:
        hit = _fresh(self.running_sandboxes, (tenant, name), RUNNING_CACHE_TTL)
        return None if hit is None else hit[0]

    def cache_running(self, tenant: str, sandbox: Sandbox, limit: int = 10_000) -> None:
        _remember(self.running_sandboxes, (tenant, sandbox.name), sandbox, limit)

    def forget_running(self, tenant: str, name: str) -> None:
        self.running_sandboxes.pop((tenant, name), None)

    def cached_owner(self, worker: str) -> str | None:
        hit = _fresh(self.owner_cache, worker, OWNER_CACHE_TTL)
        return None if hit is None else hit[0]

    def cache_owner(self, worker: str, node_url: str, limit: int = 10_000) -> None:
        _remember(self.owner_cache, worker, node_url, limit)

    def forget_owner(self, worker: str) -> None:
        self.owner_cache.pop(worker, None)

    def recent_peer_problems(self, within: float = 15.0) -> list[str]:
        now = time.monotonic()
        for url, (_, seen) in list(self.peer_problems.items()):
            if now - seen > within:
                del self.peer_problems[url]
        return [problem for problem, _ in self.peer_problems.values()]

    # exec jobs this instance is running now (background tasks owned by the app's lifespan,
    # cancelled at shutdown). Per-process by nature: a job runs in the instance that accepted
    # it; its state is in the store, and recovery fails it (never re-runs it) if we die.
    exec_job_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # peer node_url -> the open link to it (a signed WebSocket carrying tunnel requests).
    # Per-process by nature: a connection; redialed when it drops.
    peer_links: dict[str, asyncio.Future[RpcChannel]] = field(default_factory=dict)

    # tenant -> (its limits or None for none, read at monotonic): spares a store read per
    # request. Only the configuration is cached; what the limits count is in the store.
    limits_cache: dict[str, tuple[TenantLimits | None, float]] = field(default_factory=dict)

    # sandbox name -> its tenant, for E2B's envd requests (which name a sandbox and carry no
    # API key). Never stale: a name is its tenant's for good (names are random and unique).
    sandbox_tenants: dict[str, tuple[str, float]] = field(default_factory=dict)

    def tenant_of_sandbox(self, name: str) -> str | None:
        hit = self.sandbox_tenants.get(name)
        return None if hit is None else hit[0]

    def remember_tenant_of_sandbox(self, name: str, tenant: str, limit: int = 10_000) -> None:
        _remember(self.sandbox_tenants, name, tenant, limit)

    def cached_limits(self, tenant: str, ttl: float) -> tuple[bool, TenantLimits | None]:
        """(found, limits): None is a valid cached answer (the tenant has no limits)."""
        hit = _fresh(self.limits_cache, tenant, ttl)
        return (False, None) if hit is None else (True, hit[0])

    def cache_limits(self, tenant: str, limits: TenantLimits | None, limit: int = 10_000) -> None:
        _remember(self.limits_cache, tenant, limits, limit)

    def cached_key(self, key_hash: str, ttl: float) -> ApiKey | None:
        hit = _fresh(self.auth_cache, key_hash, ttl)
        return None if hit is None else hit[0]

    def cache_key(self, key: ApiKey, limit: int = 10_000) -> None:
        _remember(self.auth_cache, key.key_hash, key, limit)


SERVER_STATE: Mapping[str, StateRow] = MappingProxyType(
    {
        "ServerLocalState.tunnels": StateRow(
            "live worker tunnels (WebSocket sessions)",
            "one per connected worker",
            "per-process by nature; ownership recorded in the store's tunnel_owners",
        ),
        "ServerLocalState.inflight_creates": StateRow(
            "in-flight creates per (tenant, Idempotency-Key digest)",
            "one per concurrent keyed create; removed when it finishes",
            "exact: same-instance retries wait here; across instances the unique (tenant, digest) "
            "index in the store decides",
        ),
        "ServerLocalState.auth_cache": StateRow(
            "API key records by hash",
            "10,000 entries, each trusted for auth_cache_ttl (5 s)",
            "exact via store after the TTL: a revoked key stops on every instance within 5 s",
        ),
        "ServerLocalState.running_sandboxes": StateRow(
            "records of running sandboxes, by (tenant, name)",
            "10,000 entries, each trusted for 1 s",
            "exact via store after 1 s; a sandbox stopped by another instance within that second "
            "is already gone from its worker, which answers 409",
        ),
        "ServerLocalState.owner_cache": StateRow(
            "which instance holds each worker's tunnel, as last read from tunnel_owners",
            "one per worker, each trusted for 1 s",
            "exact via store after 1 s, or at once when that instance answers that it no longer "
            "holds the tunnel",
        ),
        "ServerLocalState.peer_problems": StateRow(
            "configuration problems seen when calling other instances",
            "one per peer instance",
            "per-process by nature: each instance reports in /readyz what it saw itself",
        ),
        "ServerLocalState.store_probe": StateRow(
            "the last /readyz write probe of the store: its problem (or none) and when",
            "one entry, reused for 1 s",
            "per-process by nature: each instance probes the shared store itself, at most once "
            "a second",
        ),
        "ServerLocalState.tunnel_losses": StateRow(
            "how many worker tunnels this instance dropped because they went silent",
            "one counter",
            "per-process by nature: a Prometheus counter; the scraper sums the instances",
        ),
        "ServerLocalState.tunnel_attaches": StateRow(
            "how many worker tunnels this instance accepted and served",
            "one counter",
            "per-process by nature: a Prometheus counter; the scraper sums the instances",
        ),
        "ServerLocalState.forwarded": StateRow(
            "how many requests this instance relayed to the instance holding a worker's tunnel",
            "one counter",
            "per-process by nature: a Prometheus counter; the scraper sums the instances",
        ),
        "ApiMetrics.registry": StateRow(
            "this instance's Prometheus series: request, create, execute and store-statement "
            "histograms, the store's deployment-wide gauges (refreshed per scrape)",
            "the routes × statuses seen (route templates, never paths), the workers",
            "per-process by nature: each instance exports its own; Prometheus sums the "
            "counters, and the store-read gauges are the same on every instance",
        ),
        "ServerLocalState.queue_clients_left": StateRow(
            "how many queued creates this instance saw their client leave: kept (keyed) or "
            "abandoned (unkeyed)",
            "two counters",
            "per-process by nature: a Prometheus counter; the scraper sums the instances",
        ),
        "ServerLocalState.loops": StateRow(
            "the health of each long-lived loop (reaper, recovery, owner renewal per worker): "
            "failures in a row, since when, the last error",
            "two, plus one per attached worker (dropped when it detaches)",
            "per-process by nature: each instance supervises its own loops and /readyz "
            "reports them",
        ),
        "Supervisor._running": StateRow(
            "the tasks of the loops this instance started, by name",
            "one per loop (two)",
            "per-process by nature; cancelled at shutdown",
        ),
        "ServerLocalState.peer_links": StateRow(
            "open WebSocket links to other instances, for forwarded tunnel requests",
            "one per peer instance",
            "per-process by nature: connections, redialed on demand",
        ),
        "ServerLocalState.exec_job_tasks": StateRow(
            "background tasks running the exec jobs this instance accepted",
            "one per running exec job; removed when it finishes",
            "per-process by nature: the job's state and idempotency key are in the store (unique "
            "(tenant, digest)); if this instance dies, recovery elsewhere fails its jobs and never "
            "re-runs them",
        ),
        "ServerLocalState.limits_cache": StateRow(
            "each tenant's configured limits (rate, quotas), as last read from tenant_limits",
            "10,000 entries, each trusted for auth_cache_ttl (5 s)",
            "exact via store: only the configuration is cached (a change applies on every instance "
            "within 5 s); tokens, live sandboxes, running exec jobs, the create queue and the "
            "breaker are counted in the store on every use",
        ),
        "ServerLocalState.sandbox_tenants": StateRow(
            "the tenant of each sandbox E2B's envd requests named (they carry no API key)",
            "10,000 entries (the map starts over when full)",
            "exact: a sandbox name belongs to one tenant for good; whether it still runs is "
            "read through running_sandboxes (1 s) and its worker",
        ),
        "WorkspaceLocks._local": StateRow(
            "workspace git lock (SQLite): one asyncio lock per workspace",
            "one per workspace committed or restored since the instance started",
            "exact: SQLite serves one instance, so this lock is the deployment's; on "
            "PostgreSQL it is unused: a session advisory lock per workspace on a connection of "
            "its own, with a fence from the store the worker checks before each git step",
        ),
        "PeerClient._links": StateRow(
            "serve loops of this instance's open peer links",
            "one per peer instance",
            "per-process by nature; cancelled at shutdown",
        ),
        "Chunker._parts": StateRow(
            "the pieces of one upload's body not yet sent as a chunk (control/transfers.py)",
            "less than one chunk (file_chunk_bytes) plus the piece that completed it",
            "per-process by nature: lives as long as the request",
        ),
        "Writes._under_way": StateRow(
            "one upload's chunk writes in flight to its sandbox",
            "transfers.WINDOW (4) chunks per upload",
            "per-process by nature: lives as long as the request; cancelled and awaited on a "
            "failure, before the partial file is discarded",
        ),
        "Writes._failed": StateRow(
            "whether one of an upload's writes in flight failed (ends its wait for the body)",
            "one flag per upload",
            "per-process by nature: lives as long as the request",
        ),
        "ReadAhead._under_way": StateRow(
            "one download's chunk reads in flight ahead of its client",
            "transfers.WINDOW (4) chunks per download",
            "per-process by nature: lives as long as the response; cancelled and awaited "
            "when it ends",
        ),
    }
)
