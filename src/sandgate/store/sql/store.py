"""`SqlStore`: the `Store` Protocol, composed of one object per domain over one `Database`.

Each method of the Protocol is the bound method of the domain that owns it, assigned once in
`__init__`: a call costs no extra frame, the table below is the map of which domain answers
what, and mypy checks every signature against the Protocol (`_implements_protocol`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from sandgate.store.base import Store
from sandgate.store.sql.admission import Admission
from sandgate.store.sql.breaker import Breaker
from sandgate.store.sql.engine import Database, open_engines
from sandgate.store.sql.exec_jobs import ExecJobs
from sandgate.store.sql.fleet import Fleet
from sandgate.store.sql.jobs import Jobs
from sandgate.store.sql.retention import Retention
from sandgate.store.sql.sandboxes import MetadataCondition, Sandboxes
from sandgate.store.sql.templates import Templates
from sandgate.store.sql.tenants import Tenants
from sandgate.store.sql.workspaces import Workspaces


class SqlStore:
    """The Store Protocol on one SQLAlchemy async engine (SQLite or PostgreSQL)."""

    def __init__(self, engine: AsyncEngine, counters: AsyncEngine | None = None) -> None:
        db = self._db = Database(engine, counters)
        self.dialect: Final[str] = db.dialect
        self.aclose = db.aclose

        tenants = Tenants(db)
        self.ensure_tenant = tenants.ensure_tenant
        self.get_tenant = tenants.get_tenant
        self.add_api_key = tenants.add_api_key
        self.find_api_key = tenants.find_api_key
        self.bind_worker_key = tenants.bind_worker_key

        sandboxes = self._sandboxes = Sandboxes(db)
        self.insert_sandbox = sandboxes.insert_sandbox
        self.find_idempotency = sandboxes.find_idempotency
        self.release_idempotency = sandboxes.release_idempotency
        self.get_sandbox = sandboxes.get_sandbox
        self.get_tenant_sandbox = sandboxes.get_tenant_sandbox
        self.list_sandboxes = sandboxes.list_sandboxes
        self.list_worker_sandboxes = sandboxes.list_worker_sandboxes
        self.list_stale_pending = sandboxes.list_stale_pending
        self.list_expired = sandboxes.list_expired
        self.count_sandboxes_by_state = sandboxes.count_sandboxes_by_state
        self.mark_running = sandboxes.mark_running
        self.set_sandbox_state = sandboxes.set_sandbox_state
        self.set_expiry = sandboxes.set_expiry
        self.set_network = sandboxes.set_network
        self.assign_worker = sandboxes.assign_worker

        jobs = Jobs(db)
        self.get_job = jobs.get_job
        self.finish_job = jobs.finish_job
        self.fail_sandbox_jobs = jobs.fail_sandbox_jobs
        self.claim_stale_jobs = jobs.claim_stale_jobs

        workspaces = Workspaces(db)
        self.insert_workspace = workspaces.insert_workspace
        self.get_workspace = workspaces.get_workspace
        self.get_workspace_by_id = workspaces.get_workspace_by_id
        self.list_workspaces = workspaces.list_workspaces
        self.set_workspace_state = workspaces.set_workspace_state
        self.move_workspace = workspaces.move_workspace
        self.next_workspace_fence = workspaces.next_workspace_fence
        self.set_workspace_head = workspaces.set_workspace_head
        self.delete_workspace = workspaces.delete_workspace
        self.workspace_users = workspaces.workspace_users

        fleet = Fleet(db)
        self.upsert_worker = fleet.upsert_worker
        self.set_worker_connected = fleet.set_worker_connected
        self.list_workers = fleet.list_workers
        self.worker_usage = fleet.worker_usage
        self.count_live_sandboxes = fleet.count_live_sandboxes
        self.live_sandboxes_per_worker = fleet.live_sandboxes_per_worker
        self.claim_tunnel = fleet.claim_tunnel
        self.renew_tunnel = fleet.renew_tunnel
        self.release_tunnel = fleet.release_tunnel
        self.release_node_tunnels = fleet.release_node_tunnels
        self.tunnel_owner = fleet.tunnel_owner
        self.heartbeat_instance = fleet.heartbeat_instance
        self.probe_write = fleet.probe_write

        exec_jobs = ExecJobs(db)
        self.insert_exec_job = exec_jobs.insert_exec_job
        self.get_exec_job = exec_jobs.get_exec_job
        self.list_exec_jobs = exec_jobs.list_exec_jobs
        self.find_exec_job_by_digest = exec_jobs.find_exec_job_by_digest
        self.start_exec_job = exec_jobs.start_exec_job
        self.finish_exec_job = exec_jobs.finish_exec_job
        self.fail_orphaned_exec_jobs = exec_jobs.fail_orphaned_exec_jobs
        self.list_overdue_exec_jobs = exec_jobs.list_overdue_exec_jobs
        self.fail_exec_job_as_seen = exec_jobs.fail_exec_job_as_seen
        self.fail_instance_exec_jobs = exec_jobs.fail_instance_exec_jobs
        self.sweep_exec_jobs = exec_jobs.sweep_exec_jobs

        admission = Admission(db)
        self.set_tenant_limits = admission.set_tenant_limits
        self.get_tenant_limits = admission.get_tenant_limits
        self.count_tenant_live_sandboxes = admission.count_tenant_live_sandboxes
        self.take_rate_token = admission.take_rate_token
        self.admission_snapshot = admission.admission_snapshot
        self.enqueue_create = admission.enqueue_create
        self.queue_position = admission.queue_position
        self.renew_ticket = admission.renew_ticket
        self.leave_queue = admission.leave_queue
        self.count_tenant_queued = admission.count_tenant_queued

        scheduling = Breaker(db)
        self.record_scheduling_timeout = scheduling.record_scheduling_timeout
        self.list_scheduling_timeouts = scheduling.list_scheduling_timeouts
        self.list_tenant_scheduling_timeouts = scheduling.list_tenant_scheduling_timeouts
        self.claim_breaker_trial = scheduling.claim_breaker_trial
        self.conclude_breaker_trial = scheduling.conclude_breaker_trial

        templates = Templates(db)
        self.blob_complete = templates.blob_complete
        self.begin_blob = templates.begin_blob
        self.write_blob_chunk = templates.write_blob_chunk
        self.complete_blob = templates.complete_blob
        self.touch_blob = templates.touch_blob
        self.read_blob = templates.read_blob
        self.put_template = templates.put_template
        self.get_template = templates.get_template
        self.list_templates = templates.list_templates
        self.delete_template = templates.delete_template
        self.sweep_blobs = templates.sweep_blobs
        self.insert_build = templates.insert_build
        self.update_build = templates.update_build
        self.get_build = templates.get_build
        self.get_cached_step = templates.get_cached_step
        self.put_cached_step = templates.put_cached_step

        retention = Retention(db)
        self.sweep_sandboxes = retention.sweep_sandboxes
        self.sweep_tunnel_owners = retention.sweep_tunnel_owners
        self.sweep_instances = retention.sweep_instances
        self.sweep_admission_tickets = retention.sweep_admission_tickets
        self.sweep_scheduling_timeouts = retention.sweep_scheduling_timeouts

    @property
    def engine(self) -> AsyncEngine:
        return self._db.engine

    @property
    def statements(self) -> int:
        """Statements sent to the database by this process (exported on /metrics)."""
        return self._db.statements

    @property
    def observe_statement(self) -> Callable[[float], None] | None:
        return self._db.observe_statement

    @observe_statement.setter
    def observe_statement(self, observe: Callable[[float], None] | None) -> None:
        """Give each statement's duration (seconds) to `observe` (a histogram's)."""
        self._db.observe_statement = observe

    # --- white-box seams of the store's contract tests (tests/integration/store)

    async def _fetch_all(self, stmt: Any, params: Mapping[str, Any]) -> list[Row[Any]]:
        return await self._db.fetch_all(stmt, params)

    @property
    def _metadata_condition(self) -> MetadataCondition:
        return self._sandboxes.metadata_condition

    @_metadata_condition.setter
    def _metadata_condition(self, condition: MetadataCondition) -> None:
        self._sandboxes.metadata_condition = condition


async def open_store(url: str) -> SqlStore:
    """Open (not migrate) the store at `url`. See `migrate.async_url` for URL forms."""
    return SqlStore(*open_engines(url))


if TYPE_CHECKING:

    def _implements_protocol(store: SqlStore) -> Store:
        return store  # mypy checks every method signature against the Protocol here
