"""Every piece of state that lives only in one process, in one place.

Each field says what it holds, its bound and what happens with N instances. A unit test
(`tests/unit/test_local_state_registry.py`) walks `src/` and fails on module-level mutable
state anywhere else, and on a new field here without its row in `STATE_TABLE`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandgate.store.base import ApiKey, Sandbox
    from sandgate.tunnel.hub import TunnelSession
    from sandgate.worker.service import LiveSandbox


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

    def cached_key(self, key_hash: str, ttl: float) -> ApiKey | None:
        hit = self.auth_cache.get(key_hash)
        if hit is None or time.monotonic() - hit[1] > ttl:
            return None
        return hit[0]

    def cache_key(self, key: ApiKey, limit: int = 10_000) -> None:
        if len(self.auth_cache) >= limit:
            self.auth_cache.clear()
        self.auth_cache[key.key_hash] = (key, time.monotonic())


@dataclass
class WorkerLocalState:
    # sandbox name -> the running sandbox and its agent link. Per-process by nature: the
    # sandboxes are children of this worker process and die with it (bwrap --die-with-parent).
    sandboxes: dict[str, LiveSandbox] = field(default_factory=dict)
    # sandbox name -> the provision in progress, so a redelivered create waits for the first.
    provisioning: dict[str, asyncio.Future[LiveSandbox]] = field(default_factory=dict)


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
}


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
