"""Retention in SQL: the sweepers that keep every growing table bounded.

Each is one or a few `DELETE`s of at most `limit` rows, run by every instance's recovery tick
(`sandgate.control.recovery`); they are idempotent, so two instances sweeping at once only
delete the same rows once. What each table is bounded by, swept or not, is the table
`STORE_GROWTH` below, rendered into `docs/state.md` ("What grows and what bounds it"); a unit
test fails when a table of `schema.metadata` has no row there. (Finished exec jobs are swept
by `exec_jobs.ExecJobs.sweep_exec_jobs`, beside their other statements.)
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

from sqlalchemy import Integer, Row, bindparam, delete, select, tuple_

from sandgate.store.ops import store_op
from sandgate.store.schema import (
    admission_tickets,
    idempotency_keys,
    instances,
    jobs,
    sandboxes,
    scheduling_timeouts,
    tunnel_owners,
)
from sandgate.store.sql.engine import Database

# states a sandbox never leaves: its row (and its create job and idempotency record) is
# deleted `sandbox_retention` after it entered one of them
ENDED_SANDBOX_STATES: Final = ("stopped", "error", "deleted")

_ENDED_SANDBOXES = (
    select(sandboxes.c.name, sandboxes.c.tenant_id)
    .where(
        sandboxes.c.state.in_(ENDED_SANDBOX_STATES),
        sandboxes.c.updated_at < bindparam("b_ended_before"),
    )
    .order_by(sandboxes.c.updated_at, sandboxes.c.name)
    .limit(bindparam("b_limit", type_=Integer))
)
_DELETE_SANDBOX_JOBS = delete(jobs).where(
    jobs.c.sandbox_name.in_(bindparam("b_names", expanding=True))
)
_DELETE_SANDBOX_IDEMPOTENCY = delete(idempotency_keys).where(
    tuple_(idempotency_keys.c.tenant_id, idempotency_keys.c.sandbox_name).in_(
        bindparam("b_owned", expanding=True)
    )
)
_DELETE_ENDED_SANDBOXES = delete(sandboxes).where(  # conditions checked again
    sandboxes.c.name.in_(bindparam("b_names", expanding=True)),
    sandboxes.c.state.in_(ENDED_SANDBOX_STATES),
    sandboxes.c.updated_at < bindparam("b_ended_before"),
)

_STALE_OWNERS = delete(tunnel_owners).where(
    tunnel_owners.c.tunnel_key.in_(
        select(tunnel_owners.c.tunnel_key)
        .where(tunnel_owners.c.updated_at < bindparam("b_before"))
        .limit(bindparam("b_limit", type_=Integer))
        .scalar_subquery()
    )
)
_DEAD_INSTANCES = delete(instances).where(
    instances.c.node_url.in_(
        select(instances.c.node_url)
        .where(instances.c.heartbeat_at < bindparam("b_before"))
        .limit(bindparam("b_limit", type_=Integer))
        .scalar_subquery()
    )
)
_EXPIRED_TICKETS = delete(admission_tickets).where(
    admission_tickets.c.id.in_(
        select(admission_tickets.c.id)
        .where(admission_tickets.c.expires_at < bindparam("b_now"))
        .limit(bindparam("b_limit", type_=Integer))
        .scalar_subquery()
    )
)
# the newest `keep` rows stay: everything at or below the id of the (keep+1)-th newest goes
_OLDEST_KEPT_TIMEOUT = (
    select(scheduling_timeouts.c.id)
    .order_by(scheduling_timeouts.c.id.desc())
    .offset(bindparam("b_keep", type_=Integer))
    .limit(1)
    .scalar_subquery()
)
_SURPLUS_TIMEOUTS = delete(scheduling_timeouts).where(
    scheduling_timeouts.c.id.in_(
        select(scheduling_timeouts.c.id)
        .where(scheduling_timeouts.c.id <= _OLDEST_KEPT_TIMEOUT)
        .limit(bindparam("b_limit", type_=Integer))
        .scalar_subquery()
    )
)


class Retention:
    def __init__(self, db: Database) -> None:
        self._db = db

    @store_op
    async def sweep_sandboxes(self, ended_before: datetime, limit: int) -> int:
        """Delete sandboxes that ended (stopped, error, deleted) before `ended_before`, with
        their create jobs and idempotency records; at most `limit` per call. Returns how many
        sandboxes. Their exec jobs went already (`sweep_exec_jobs`: a sandbox not live)."""
        if limit <= 0:
            return 0
        async with self._db.begin() as conn:
            found: list[Row[Any]] = list(
                await conn.execute(
                    _ENDED_SANDBOXES, {"b_ended_before": ended_before, "b_limit": limit}
                )
            )
            if not found:
                return 0
            names = [r.name for r in found]
            owned = [(r.tenant_id, r.name) for r in found]
            deleted = await conn.execute(
                _DELETE_ENDED_SANDBOXES, {"b_names": names, "b_ended_before": ended_before}
            )
            await conn.execute(_DELETE_SANDBOX_JOBS, {"b_names": names})
            await conn.execute(_DELETE_SANDBOX_IDEMPOTENCY, {"b_owned": owned})
            return int(deleted.rowcount)

    @store_op
    async def sweep_tunnel_owners(self, before: datetime, limit: int) -> int:
        """Delete tunnel owner records not renewed since `before` (long past the owner TTL,
        where a record and no record mean the same: nobody holds that tunnel)."""
        return await self._db.write(_STALE_OWNERS, {"b_before": before, "b_limit": limit})

    @store_op
    async def sweep_instances(self, before: datetime, limit: int) -> int:
        """Delete the heartbeat rows of instances silent since `before` (dead: a missing row
        counts as dead too, so their unfinished exec jobs are failed all the same)."""
        return await self._db.write(_DEAD_INSTANCES, {"b_before": before, "b_limit": limit})

    @store_op
    async def sweep_admission_tickets(self, now: datetime, limit: int) -> int:
        """Delete queue tickets whose lease ran out (they no longer count or place)."""
        return await self._db.write(_EXPIRED_TICKETS, {"b_now": now, "b_limit": limit})

    @store_op
    async def sweep_scheduling_timeouts(self, keep: int, limit: int) -> int:
        """Keep only the newest `keep` scheduling timeouts (the breaker counts at most its
        threshold of them, within its window); delete at most `limit` older ones."""
        return await self._db.write(_SURPLUS_TIMEOUTS, {"b_keep": keep, "b_limit": limit})


# What each store table is bounded by; rendered into docs/state.md.
STORE_GROWTH: Final[tuple[tuple[str, str, str], ...]] = (
    (
        "workspaces",
        "one row per workspace a tenant creates",
        "made and deleted by the tenants explicitly, at most `--max-workspaces` per tenant "
        "(default 100); the tree and history are files on the workspace root, bounded by "
        "each one's quota_mb",
    ),
    (
        "templates",
        "one row per imported template",
        "made and deleted by the tenants (and admins, for public ones) explicitly; an import "
        "of an existing name replaces its row",
    ),
    (
        "blobs",
        "one row per distinct image layer (content-addressed: stored once)",
        "the layers the templates name; one no template names (a deleted template's, an "
        "import that failed half-way) goes at the next import or delete, once 10 min old "
        "(`Templates.sweep_blobs`)",
    ),
    (
        "template_builds",
        "one row per build, its log capped at 1 MiB",
        "the newest 100 per owner: older ones are deleted as a new build starts "
        "(`Templates.insert_build`)",
    ),
    (
        "build_cache",
        "one row per build step that ran (per owner)",
        "the distinct steps built per owner (a key and a layer reference each); the layers "
        "they name are kept from the blob sweep; not swept yet",
    ),
    (
        "blob_chunks",
        "the layers' bytes, 1 MiB per row",
        "those of the rows of `blobs`, deleted with them",
    ),
    (
        "tenants",
        "one row per tenant",
        "created by the operator only (`sandgate keys create`, `sandgate up`)",
    ),
    (
        "api_keys",
        "one row per key",
        "created by the operator only (`sandgate keys create`); a worker key binds one "
        "worker name at its first use",
    ),
    (
        "sandboxes",
        "one row per sandbox",
        "live ones: the tenants' quotas and the workers' capacity; ended ones (stopped, "
        "error, deleted): `sweep_sandboxes`, `--sandbox-retention` (default 24 h) after they "
        "ended",
    ),
    (
        "jobs",
        "one create job per sandbox",
        "deleted with its sandbox (`sweep_sandboxes`)",
    ),
    (
        "idempotency_keys",
        "one record per keyed create",
        "deleted with its sandbox (`sweep_sandboxes`) or at once when its create failed; "
        "after that the same key creates a new sandbox",
    ),
    (
        "exec_jobs",
        "one row per exec job, with its output (1 MiB each of stdout and stderr at most)",
        "running ones: the tenant's `max_exec_jobs`; finished ones: `sweep_exec_jobs`, "
        "`--exec-job-retention` (default 24 h) after they ended, or at once when their "
        "sandbox is no longer live",
    ),
    (
        "workers",
        "one row per worker name",
        "one name per worker key (operator-created); kept while the key exists",
    ),
    (
        "worker_usage",
        "one row per worker that held a sandbox (kept by triggers on sandboxes)",
        "one per worker name, as `workers`; its counts are its live sandboxes'",
    ),
    (
        "tunnel_owners",
        "one row per worker tunnel",
        "released when its tunnel closes; one not renewed for 1 h (its instance died): "
        "`sweep_tunnel_owners`",
    ),
    (
        "instances",
        "one heartbeat row per API instance",
        "one silent for 1 h (and 10 times the orphan period at least): `sweep_instances`",
    ),
    (
        "tenant_limits",
        "one row per tenant with limits",
        "set by the operator only (`sandgate tenants limit`)",
    ),
    (
        "rate_buckets",
        "one row per rate-limited tenant",
        "bounded by tenant_limits",
    ),
    (
        "admission_tickets",
        "one row per queued create",
        "live ones: `--queue-limit` (default 500); expired ones are purged by every enqueue "
        "and by `sweep_admission_tickets`",
    ),
    (
        "admission_locks",
        "one row per lock name",
        "a fixed set of names",
    ),
    (
        "breakers",
        "one row per breaker",
        "a fixed set of names (the scheduling breaker)",
    ),
    (
        "scheduling_timeouts",
        "one row per scheduling timeout",
        "older than the breaker window: purged by every new timeout; the newest 1,000 (or the "
        "breaker threshold, if higher) at most: `sweep_scheduling_timeouts`",
    ),
)
