"""Every piece of state that lives only in one process, in one place.

Each field says what it holds, its bound and what happens with N instances. A unit test
(`tests/unit/test_local_state_registry.py`) walks `src/` and fails on module-level mutable
state anywhere else, and on a new field here without its row in `STATE_TABLE`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from sandgate.core.loops import LoopHealth
    from sandgate.store.base import ApiKey, Sandbox, TenantLimits
    from sandgate.tunnel.hub import TunnelSession
    from sandgate.tunnel.rpc import RpcChannel
    from sandgate.worker.service import LiveSandbox, Starting


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


@dataclass(frozen=True)
class StateRow:
    holds: str
    bound: str
    under_n_instances: str


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


@dataclass
class WorkerLocalState:
    # sandbox name -> the running sandbox and its agent link. Per-process by nature: the
    # sandboxes are children of this worker process and die with it (bwrap --die-with-parent).
    sandboxes: dict[str, LiveSandbox] = field(default_factory=dict)
    # sandbox name -> the provision in progress (its spec and start), so a redelivered create
    # waits for the first and the budget counts what is starting.
    provisioning: dict[str, Starting] = field(default_factory=dict)
    # sandbox name -> a sandbox being destroyed: recorded before it leaves `sandboxes`, kept
    # until its processes, cgroups, uid lease and directories are gone. Per-process by nature;
    # a worker that dies with entries here removes the leftovers at its next start.
    tearing_down: dict[str, LiveSandbox] = field(default_factory=dict)
    # sandbox name -> the task tearing it down (one per sandbox; it outlives the request that
    # asked for it, so a dropped link never interrupts a destroy).
    teardowns: dict[str, asyncio.Task[None]] = field(default_factory=dict)


STATE_TABLE: dict[str, StateRow] = {
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
    "ServerLocalState.loops": StateRow(
        "the health of each long-lived loop (reaper, recovery, owner renewal per worker): "
        "failures in a row, since when, the last error",
        "two, plus one per attached worker (dropped when it detaches)",
        "per-process by nature: each instance supervises its own loops and /readyz reports them",
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
    "PeerClient._links": StateRow(
        "serve loops of this instance's open peer links",
        "one per peer instance",
        "per-process by nature; cancelled at shutdown",
    ),
    "WorkerLocalState.sandboxes": StateRow(
        "sandboxes running on this worker and their agent pipes",
        "the worker's capacity",
        "per-process by nature; reported to the control plane on every (re)connect",
    ),
    "WorkerLocalState.provisioning": StateRow(
        "provisions in progress by sandbox name",
        "the worker's capacity",
        "per-process by nature; a redelivered create of the same name waits for the first",
    ),
    "WorkerLocalState.tearing_down": StateRow(
        "sandboxes being destroyed, until everything they held on the host is gone",
        "the worker's capacity (they count against it)",
        "per-process by nature; reported in every hello and heartbeat until done, and what a "
        "crashed worker left is removed at its next start",
    ),
    "WorkerLocalState.teardowns": StateRow(
        "the task tearing each of those sandboxes down",
        "one per sandbox being destroyed",
        "per-process by nature; awaited by the worker's shutdown",
    ),
    # state objects keep on `self`, found by the registry test; each lives and dies with its owner
    "MemoryLink._to_server": StateRow(
        "frames from the worker to the server on an in-memory tunnel link (tests/fast)",
        "what one side sent and the other has not read yet: calls wait for their answers",
        "per-process by nature: both ends of the link live in one process",
    ),
    "MemoryLink._to_worker": StateRow(
        "frames from the server to the worker on an in-memory tunnel link (tests/fast)",
        "what one side sent and the other has not read yet: calls wait for their answers",
        "per-process by nature: both ends of the link live in one process",
    ),
    "RpcChannel._pending": StateRow(
        "calls waiting for their answer on one link",
        "the calls in flight on that link",
        "per-process by nature: a link is one process's connection; all fail when it closes",
    ),
    "RpcChannel._running": StateRow(
        "requests from the peer being handled on one link",
        "the requests in flight on that link",
        "per-process by nature; cancelled when the link closes",
    ),
    "RpcChannel._send_lock": StateRow(
        "serialises frames written to one link", "one lock per link", "per-process by nature"
    ),
    "FrameDecoder._buffer": StateRow(
        "bytes of a frame not yet complete on a pipe",
        "one frame (header 1 MiB + payload 8 MiB)",
        "per-process by nature",
    ),
    "AgentLink._buffered": StateRow(
        "frames decoded from an agent's pipe, not yet dispatched",
        "one read (64 KiB) worth of frames",
        "per-process by nature: the agent is this worker's child",
    ),
    "AgentLink.ready": StateRow(
        "set when the sandbox's agent reported ready",
        "one event per sandbox",
        "per-process by nature",
    ),
    "AgentLink.ready_info": StateRow(
        "the agent's ready event (pid, version)",
        "one small dict per sandbox",
        "per-process by nature",
    ),
    "TunnelClient.connected": StateRow(
        "whether the worker's tunnel is up", "one event per worker", "per-process by nature"
    ),
    "UidPool._held": StateRow(
        "host uids leased to this worker's sandboxes (flock held on a file per uid)",
        "the worker's uid range",
        "exact: the flock on the uid's file is the lease across every process on the host, "
        "released when its holder dies",
    ),
    "BwrapRuntime._limits": StateRow(
        "which cgroup limits this host can enforce, found at prepare",
        "3 flags",
        "per-process by nature: facts about this worker's host",
    ),
    "BwrapRuntime._root_args": StateRow(
        "bwrap arguments building the read-only root, computed at prepare",
        "a few dozen strings",
        "per-process by nature: facts about this worker's host",
    ),
    "BwrapRuntime._etc_args": StateRow(
        "bwrap arguments binding the minimal /etc, computed at prepare",
        "a few dozen strings",
        "per-process by nature: facts about this worker's host",
    ),
    "agent": StateRow(
        "the in-sandbox agent's open file handles, exec process groups, background processes "
        "and terminals with their output buffers",
        "64 handles; 256 processes/terminals with at most 1 MiB of output each",
        "per-process by nature: one agent process per sandbox, gone with it",
    ),
}


STATE_DOC_HEADER = """# In-process state

Generated by `sandgate state-table` from `src/sandgate/local_state.py`; a test fails when this
file or the code drifts. Every dict, set, lock, future or cache that lives only in one process
has a row: what it holds, its bound, and what it becomes with N API instances.

"""


# What grows inside one process and is not a field above: the in-sandbox agent's collections
# (standard library only, it cannot import this module; all of it hangs off its one
# AgentState, sandgate/agent/state.py; a test checks that every name below is in the agent).
# Everything the agent holds is also inside the sandbox's memory cgroup: only its own sandbox
# pays for it.
AGENT_GROWTH: tuple[tuple[str, str, str], ...] = (
    (
        "agent `AgentState.handles`",
        "open file handles (uploads, downloads)",
        "64 (`MAX_HANDLES`); closed by the worker's call or dropped at exit",
    ),
    (
        "agent `Registry._entries`",
        "background processes and terminals",
        "256 (`MAX_PROCESSES`): the oldest exited one is forgotten to make room; a start with "
        "256 still running is refused",
    ),
    (
        "agent output ring (`Output.chunks`)",
        "the recent output of one process or terminal",
        "1 MiB (`PROCESS_BUFFER_BYTES`) and 4,096 chunks (`MAX_CHUNKS`) per process: the "
        "oldest output is dropped first",
    ),
    (
        "agent exec output",
        "stdout and stderr of one `execute`",
        "1 MiB each (`EXEC_OUTPUT_CAP`), the rest dropped and reported truncated",
    ),
    (
        "agent `AgentState.groups`, `Registry._orphans`",
        "process groups that may still be alive, to kill at exit",
        "pruned of dead groups at every start: the live groups, at most the sandbox's `pids`",
    ),
    (
        "agent `AgentState.queues`",
        "requests waiting for one handle or process, in arrival order",
        "the worker's requests in flight to this agent",
    ),
    (
        "agent `AgentState.which_cache`",
        "executables found on PATH, by name",
        "one per executable that exists in the sandbox (bounded by its disk quota)",
    ),
)


GROWTH_DOC_HEADER = """
## What grows and what bounds it

Generated with the table above, from `src/sandgate/store/sql/retention.py` (`STORE_GROWTH`) and
`src/sandgate/local_state.py` (`AGENT_GROWTH`); a test fails when a store table has no row.
Every table of the store and every buffer that grows with use, and what stops it. The sweepers
run in every instance's recovery tick (`sandgate.control.recovery`, every
`--recovery-interval`, 5 s), each deleting at most 500 rows per tick. The in-process state
above says its bound in its `bound` column.

"""


def growth_table_markdown() -> str:
    from sandgate.store.sql.retention import STORE_GROWTH  # the store needs SQLAlchemy

    lines = ["| what | grows by | bounded by |", "|---|---|---|"]
    for name, grows, bound in STORE_GROWTH:
        lines.append(f"| store `{name}` | {grows} | {bound} |")
    for name, grows, bound in AGENT_GROWTH:
        lines.append(f"| {name} | {grows} | {bound} |")
    return "\n".join(lines) + "\n"


def state_doc() -> str:
    """docs/state.md, as `sandgate state-table` prints it."""
    return STATE_DOC_HEADER + state_table_markdown() + GROWTH_DOC_HEADER + growth_table_markdown()


def state_table_markdown() -> str:
    lines = ["| state | holds | bound | under N instances |", "|---|---|---|---|"]
    for name, row in STATE_TABLE.items():
        lines.append(f"| `{name}` | {row.holds} | {row.bound} | {row.under_n_instances} |")
    return "\n".join(lines) + "\n"


def registered_fields() -> dict[str, Any]:
    return {
        f"{cls.__name__}.{name}": cls
        for cls in (ServerLocalState, WorkerLocalState)
        for name in cls.__dataclass_fields__
    }
