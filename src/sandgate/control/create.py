"""The idempotent create pipeline, in the design's two steps: *accept* (sandbox row, job
row with the exact provision payload and the idempotency record, in one transaction), then
*deliver* (the payload goes down the worker's tunnel; the job completes and the sandbox
runs). Deliveries that did not happen at once are made by a re-attaching worker's wake-up
or by recovery (`recover`), never twice and never to a sandbox no longer pending."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from dataclasses import dataclass
from typing import Any

from sandgate.config import ServerSettings
from sandgate.control.admission import Admission, Disconnected
from sandgate.control.delivery import Delivery
from sandgate.control.sandboxes import SandboxService
from sandgate.control.state import ServerLocalState
from sandgate.control.workers import Placement, WorkerRegistry
from sandgate.core import idempotency
from sandgate.core.clock import utcnow
from sandgate.core.names import new_sandbox_name
from sandgate.core.workspaces import ResolvedMount
from sandgate.errors import (
    AtCapacityError,
    CapacityConflictError,
    IdempotencyConflictError,
    IdempotencyMismatchError,
    InvalidRequestError,
    NotFoundError,
    SandboxTimeoutError,
    SandgateError,
    UnavailableError,
)
from sandgate.store.base import (
    IdempotencyRecord,
    Job,
    JobId,
    Sandbox,
    SandboxName,
    Store,
    TenantId,
    WorkerName,
)

log = logging.getLogger(__name__)

REPLAY_WAIT = 60.0  # how long a cross-instance replay waits for the first create to finish
STALE_PENDING_GRACE = 30.0  # past start_timeout, a pending create is abandoned


@dataclass(frozen=True)
class CreateRequest:
    template: str
    timeout: float
    metadata: dict[str, str]
    env: dict[str, str]
    network: bool
    resources: dict[str, Any]
    body: dict[str, Any]  # the request as the client sent it (after defaults): fingerprinted
    pool: bool = True  # a worker may hand out a sandbox of its warm pool (worker/pool.py)
    # the network's rules (core/egress_policy), None: `network` alone (on or off)
    network_policy: dict[str, list[str]] | None = None
    image: dict[str, Any] | None = None  # a template's image (control/templates.py); None: built-in
    # the tenant's workspaces it mounts (control/workspaces.py), and the worker they are on
    workspaces: tuple[ResolvedMount, ...] = ()
    worker: str | None = None


@dataclass(frozen=True)
class CreateResult:
    sandbox: Sandbox
    replayed: bool


class CreatePipeline:
    def __init__(
        self,
        store: Store,
        state: ServerLocalState,
        workers: WorkerRegistry,
        settings: ServerSettings,
        admission: Admission,
        sandboxes: SandboxService,
    ) -> None:
        self.store = store
        self.state = state
        self.workers = workers
        self.settings = settings
        self.admission = admission
        self.sandboxes = sandboxes
        self.delivery = Delivery(store, workers, settings, admission, sandboxes)

    # -- create ----------------------------------------------------------------------------
    async def create(
        self,
        tenant: TenantId,
        request: CreateRequest,
        idempotency_key: str | None,
        disconnected: Disconnected | None = None,
    ) -> CreateResult:
        """`disconnected` tells a create waiting in the admission queue that its client left."""
        if idempotency_key is None:
            sandbox = await self._create(tenant, request, None, disconnected)
            return CreateResult(sandbox, replayed=False)
        problem = idempotency.validate_key(idempotency_key)
        if problem is not None:
            raise InvalidRequestError(problem, code="invalid_idempotency_key")
        digest = idempotency.digest(tenant, idempotency_key)
        fingerprint = idempotency.fingerprint(request.body)
        slot = (tenant, digest)
        while (first := self.state.inflight_creates.get(slot)) is not None:
            try:
                sandbox = await asyncio.shield(first)
            except SandgateError:
                continue  # the first attempt failed; this retry makes its own
            return await self._replay(tenant, digest, fingerprint, sandbox)
        # no await between the check above and this registration: one owner per slot
        future: asyncio.Future[Sandbox] = asyncio.get_running_loop().create_future()
        self.state.inflight_creates[slot] = future
        try:
            result = await self._create_once(tenant, request, digest, fingerprint, disconnected)
        except BaseException as exc:
            failure = (
                exc if isinstance(exc, SandgateError) else UnavailableError("create interrupted")
            )
            future.set_exception(failure)
            future.exception()  # waiters read it; do not warn when there are none
            raise
        finally:
            self.state.inflight_creates.pop(slot, None)
        future.set_result(result.sandbox)
        return result

    async def _create_once(
        self,
        tenant: TenantId,
        request: CreateRequest,
        digest: str,
        fingerprint: str,
        disconnected: Disconnected | None,
    ) -> CreateResult:
        existing = await self._lookup(tenant, digest)
        if existing is not None:
            return await self._replay_record(existing, fingerprint)
        claim = IdemClaim(digest=digest, fingerprint=fingerprint)
        try:
            sandbox = await self._create(tenant, request, claim, disconnected)
            return CreateResult(sandbox, replayed=False)
        except _LostRace as race:  # another instance inserted the same key first
            return await self._replay_record(race.record, fingerprint)

    async def _lookup(self, tenant: TenantId, digest: str) -> IdempotencyRecord | None:
        """A failed lookup counts as not found: the unique index is the final word."""
        try:
            record = await self.store.find_idempotency(tenant, digest)
        except Exception:
            log.warning("idempotency.lookup_failed", exc_info=True)
            return None
        # never trust a filter we did not apply ourselves
        if record is None or record.tenant_id != tenant or record.digest != digest:
            return None
        return record

    async def _replay(
        self, tenant: TenantId, digest: str, fingerprint: str, sandbox: Sandbox
    ) -> CreateResult:
        record = await self._lookup(tenant, digest)
        if record is not None and record.fingerprint != fingerprint:
            raise _mismatch()
        if sandbox.tenant_id != tenant:  # cannot happen: the slot includes the tenant
            raise NotFoundError("no such sandbox")
        return CreateResult(sandbox, replayed=True)

    async def _replay_record(self, record: IdempotencyRecord, fingerprint: str) -> CreateResult:
        if record.fingerprint != fingerprint:
            raise _mismatch()
        deadline = asyncio.get_running_loop().time() + REPLAY_WAIT
        while True:
            sandbox = await self.store.get_sandbox(record.sandbox_name)
            if sandbox is None or sandbox.tenant_id != record.tenant_id:
                raise NotFoundError("the sandbox created under this Idempotency-Key is gone")
            if sandbox.metadata.get("idem_owner") != record.tenant_id:
                raise NotFoundError("the sandbox created under this Idempotency-Key is gone")
            if sandbox.state != "pending" or asyncio.get_running_loop().time() > deadline:
                return CreateResult(sandbox, replayed=True)
            await asyncio.sleep(0.05)  # the first create is still in flight on another instance

    async def _create(
        self,
        tenant: TenantId,
        request: CreateRequest,
        claim: IdemClaim | None,
        disconnected: Disconnected | None,
    ) -> Sandbox:
        name = SandboxName(new_sandbox_name())
        # The worker is picked (reads only) while admission reads the breaker and the queue:
        # the common case, admitted at once, waits for one round trip instead of two. A pick
        # that is not used at once is dropped; the worker's row lock in the insert makes any
        # pick safe anyway.
        early: asyncio.Future[Placement] | None = asyncio.ensure_future(self._pick(request))
        picked_at = asyncio.get_running_loop().time()

        async def place() -> tuple[Sandbox, Job]:
            nonlocal early
            ahead, early = early, None
            if ahead is not None and asyncio.get_running_loop().time() - picked_at < 1.0:
                placement = await ahead
            else:
                if ahead is not None:  # picked too long ago (this create queued): pick again
                    ahead.cancel()
                    await asyncio.gather(ahead, return_exceptions=True)
                placement = await self._pick(request)
            return await self._accept(tenant, request, claim, name, placement)

        # A keyed create goes on when its client leaves the queue: the client's retry (same
        # key) takes it over. Without a key nobody could ever claim it, so it is abandoned.
        try:
            admitted = await self.admission.admit_create(
                tenant, name, place, disconnected, keep_on_leave=claim is not None
            )
        finally:
            if early is not None:  # refused before placing, or placed from the queue later
                early.cancel()
                await asyncio.gather(early, return_exceptions=True)
        sandbox, job = admitted.value
        try:
            running = await self.delivery.deliver(sandbox, job, keyed=claim is not None)
        except SandboxTimeoutError:
            raise  # counted where it timed out, which re-opened a half-open breaker
        except BaseException:
            if admitted.trial is not None:
                await asyncio.shield(self.admission.trial_outcome(name, success=False))
            raise
        if admitted.trial is not None:
            await self.admission.trial_outcome(name, success=True)
        return running

    async def _pick(self, request: CreateRequest) -> Placement:
        return await self.workers.pick(
            network=request.network,
            need=request.resources,
            image=request.image is not None,
            workspaces=bool(request.workspaces),
            only=request.worker,
        )

    async def _accept(
        self,
        tenant: TenantId,
        request: CreateRequest,
        claim: IdemClaim | None,
        name: SandboxName,
        placement: Placement,
    ) -> tuple[Sandbox, Job]:
        """Commit the sandbox, its create job and its key (the tenant's quota checked)."""
        now = utcnow()
        metadata = dict(request.metadata)
        if claim is not None:
            metadata["idem"] = idempotency.short_digest(claim.digest)
            metadata["idem_owner"] = tenant
        sandbox = Sandbox(
            name=name,
            tenant_id=tenant,
            state="pending",
            template=request.template,
            timeout=request.timeout,
            metadata=metadata,
            env=request.env,
            network=request.network,
            network_policy=request.network_policy,
            workspaces=[m.to_json() for m in request.workspaces] or None,
            resources=request.resources,
            created_at=now,
            updated_at=now,
            worker=placement.worker,
        )
        payload = {
            "name": name,
            "spec": {
                "env": request.env,
                "network": request.network_policy or request.network,
                **request.resources,
                "template": request.template,
                "pool": request.pool,
                **({"image": request.image} if request.image is not None else {}),
                **(
                    {"workspaces": [m.to_json() for m in request.workspaces]}
                    if request.workspaces
                    else {}
                ),
            },
        }
        job = Job(
            id=JobId(uuid.uuid4().hex),
            kind="create",
            sandbox_name=name,
            state="pending",
            request=payload,
            attempt=0,
            created_at=now,
            updated_at=now,
        )
        record = None
        if claim is not None:
            record = IdempotencyRecord(
                tenant_id=tenant,
                digest=claim.digest,
                fingerprint=claim.fingerprint,
                sandbox_name=name,
                created_at=now,
            )

        async def insert(max_live: int | None) -> None:
            await self.store.insert_sandbox(
                sandbox,
                job,
                record,
                max_live=max_live,
                worker_capacity=placement.capacity,
                worker_budget=placement.budget,
            )

        try:
            await self.admission.within_quota(tenant, insert, exec_jobs=False)
        except CapacityConflictError:  # another instance took the worker's last slot first
            raise AtCapacityError(
                "every connected worker is at capacity", retry_after=5.0
            ) from None
        except IdempotencyConflictError:
            assert claim is not None
            winner = await self.store.find_idempotency(tenant, claim.digest)
            if winner is None:
                raise UnavailableError("create raced and lost its record; retry") from None
            raise _LostRace(winner) from None
        log.info("sandbox.accepted", extra={"sandbox": name, "worker": placement.worker})
        if "exit-after-accept" in self.settings.faults:
            log.critical("fault.exit_after_accept", extra={"sandbox": name})
            os.kill(os.getpid(), signal.SIGKILL)
        if "skip-delivery" in self.settings.faults:
            log.critical("fault.skip_delivery", extra={"sandbox": name})
            raise UnavailableError(
                "fault skip-delivery: accepted and not delivered; recovery will deliver it",
                code="delivery_skipped",
                retry_after=5.0,
            )
        return sandbox, job

    # -- delivery (control/delivery.py), also reached from outside the pipeline -----------
    async def wake(self, worker: WorkerName) -> int:
        return await self.delivery.wake(worker)

    async def deliver_job(self, job_id: str, *, forwarded: bool) -> Sandbox:
        return await self.delivery.deliver_job(job_id, forwarded=forwarded)

    async def recover(self, job: Job, *, capped: bool = True) -> None:
        await self.delivery.recover(job, capped=capped)


@dataclass(frozen=True)
class IdemClaim:
    digest: str
    fingerprint: str


class _LostRace(Exception):
    def __init__(self, record: IdempotencyRecord) -> None:
        super().__init__("another create holds this idempotency key")
        self.record = record


def _mismatch() -> IdempotencyMismatchError:
    return IdempotencyMismatchError(
        "this Idempotency-Key was used with a different request body; "
        "use a new key for a different request"
    )
