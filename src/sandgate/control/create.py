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
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from sandgate.config import ServerSettings
from sandgate.control.admission import Admission, Disconnected
from sandgate.control.sandboxes import DESTROY_WAIT, SandboxService
from sandgate.control.workers import Placement, WorkerRegistry, utcnow
from sandgate.core import idempotency
from sandgate.core.names import new_sandbox_name
from sandgate.errors import (
    AtCapacityError,
    CapacityConflictError,
    ConflictError,
    IdempotencyConflictError,
    IdempotencyMismatchError,
    InvalidRequestError,
    NotFoundError,
    SandboxTimeoutError,
    SandgateError,
    TunnelUnavailableError,
    UnavailableError,
    WorkerError,
)
from sandgate.local_state import ServerLocalState
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
WAKE_BATCH = 20  # waiting creates delivered at once when their worker re-attaches


@dataclass(frozen=True)
class CreateRequest:
    template: str
    timeout: float
    metadata: dict[str, str]
    env: dict[str, str]
    network: bool
    resources: dict[str, Any]
    body: dict[str, Any]  # the request as the client sent it (after defaults): fingerprinted


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
        early: asyncio.Future[Placement] | None = asyncio.ensure_future(
            self.workers.pick(network=request.network, need=request.resources)
        )
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
                placement = await self.workers.pick(network=request.network, need=request.resources)
            return await self._accept(tenant, request, claim, name, placement)

        # A keyed create goes on when its client leaves the queue: the client's retry (same
        # key) takes it over. Without a key nobody could ever claim it, so it is abandoned.
        left = None if claim is not None else disconnected
        try:
            admitted = await self.admission.admit_create(tenant, name, place, left)
        finally:
            if early is not None:  # refused before placing, or placed from the queue later
                early.cancel()
                await asyncio.gather(early, return_exceptions=True)
        sandbox, job = admitted.value
        try:
            running = await self._deliver(sandbox, job, keyed=claim is not None)
        except SandboxTimeoutError:
            raise  # counted where it timed out, which re-opened a half-open breaker
        except BaseException:
            if admitted.trial is not None:
                await asyncio.shield(self.admission.trial_outcome(name, success=False))
            raise
        if admitted.trial is not None:
            await self.admission.trial_outcome(name, success=True)
        return running

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
            resources=request.resources,
            created_at=now,
            updated_at=now,
            worker=placement.worker,
        )
        payload = {
            "name": name,
            "spec": {"env": request.env, "network": request.network, **request.resources},
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

    async def _deliver(self, sandbox: Sandbox, job: Job, *, keyed: bool) -> Sandbox:
        """Push an accepted create down the worker's tunnel: ours, or the owner's instance.

        If the tunnel cannot be reached: a keyed create stays pending, is delivered when the
        worker re-attaches (or by recovery), and the client's retry with the same key
        returns it. An unkeyed one is withdrawn before answering, since no retry could ever
        find it: the client is told it was not made, and it never is.
        """
        try:
            if self.workers.local(sandbox.worker) is not None:
                return await self.deliver_job(job.id, forwarded=False)
            node_url = await self.workers.owner(sandbox.worker)
            if node_url is None or node_url == self.workers.node_url:
                raise TunnelUnavailableError("sandbox tunnel not available", retry_after=2.0)
            await self.workers.peers.provision(node_url, job.id, wait=self._provision_wait)
        except BaseException as exc:
            tunnel = exc if isinstance(exc, TunnelUnavailableError) else None
            if not keyed:
                # nobody could ever retry it: it must not stay pending for a later delivery
                reason = exc.message if isinstance(exc, SandgateError) else type(exc).__name__
                made = await asyncio.shield(self._withdraw(sandbox, reason))
                if made is not None and isinstance(exc, Exception):
                    return made  # delivered meanwhile (the worker came back): it exists
                if tunnel is not None:
                    raise UnavailableError(
                        f"the sandbox was not created: its worker's tunnel is not reachable "
                        f"now ({tunnel.message}); retry (send an Idempotency-Key to make "
                        "retries safe)",
                        code="tunnel_unavailable",
                        retry_after=tunnel.retry_after,
                    ) from exc
                raise
            if tunnel is None:
                raise
            log.warning("sandbox.delivery_deferred", extra={"sandbox": sandbox.name})
            raise UnavailableError(
                f"sandbox {sandbox.name} is accepted but its worker's tunnel is not reachable "
                f"now ({tunnel.message}); it will be delivered when it is: retry with the same "
                "Idempotency-Key",
                code="tunnel_unavailable",
                retry_after=tunnel.retry_after,
            ) from exc
        running = await self.store.get_sandbox(sandbox.name)
        if running is None:
            raise NotFoundError(f"sandbox {sandbox.name} vanished while it started")
        return running

    async def _withdraw(self, sandbox: Sandbox, reason: str) -> Sandbox | None:
        """Take back an accepted create nobody can retry: `error` from `pending`, its job
        failed, so no delivery (wake-up, recovery) makes it later. None when withdrawn; the
        sandbox when a delivery won the race and it runs."""
        now = utcnow()
        error = f"not created: its delivery failed and the client was told so ({reason})"
        if await self.store.set_sandbox_state(
            sandbox.name, "error", from_states=("pending",), error=error, now=now
        ):
            await self.store.fail_sandbox_jobs(sandbox.name, error, now)
            log.warning("sandbox.withdrawn", extra={"sandbox": sandbox.name})
            # it may have reached the worker before the link dropped: take it down there
            await self.sandboxes.destroy_on_worker(sandbox)
            return None
        current = await self.store.get_sandbox(sandbox.name)
        if current is not None and current.state == "running":
            return current
        return None

    async def wake(self, worker: WorkerName) -> int:
        """Deliver now the creates waiting for `worker`, whose tunnel just started serving
        here (recovery would find them only after `recovery_after`). Each job is claimed by
        compare-and-swap, so a recovery tick or another instance never delivers it twice."""
        woken = 0
        before = utcnow()  # a job claimed here is touched after it: never claimed twice
        while True:
            now = utcnow()
            claimed = await self.store.claim_stale_jobs(
                before, self.workers.node_url, now, WAKE_BATCH, worker=worker
            )
            if not claimed:  # a job claimed elsewhere meanwhile was touched after `before`
                return woken
            log.info("jobs.woken", extra={"worker": worker, "jobs": len(claimed)})
            # a wake-up is not a failed delivery: it does not count toward the attempt cap
            await asyncio.gather(*(self.recover(job, capped=False) for job in claimed))
            woken += len(claimed)

    @property
    def _provision_wait(self) -> float:
        """How long a delivery through the owner instance may take: the start timeout, plus
        the undo of a failed start, plus a margin."""
        return self.settings.start_timeout + DESTROY_WAIT + 5.0

    async def deliver_job(self, job_id: str, *, forwarded: bool) -> Sandbox:
        """On the instance holding the worker's tunnel: provision, then record it running.

        Used by a local create, by `/internal/provision` for a create another instance
        accepted, and by recovery. Never resurrects: a sandbox no longer pending fails its job.
        """
        job = await self.store.get_job(JobId(job_id))
        if job is None:
            raise NotFoundError(f"no job {job_id}")
        sandbox = await self.store.get_sandbox(job.sandbox_name)
        if sandbox is None or sandbox.state != "pending":
            state = "gone" if sandbox is None else sandbox.state
            await self.store.finish_job(
                job.id, "failed", error=f"sandbox {state}; not delivered", now=utcnow()
            )
            if sandbox is not None and sandbox.state == "running":
                return sandbox  # delivered already (an earlier attempt won)
            raise ConflictError(f"sandbox {job.sandbox_name} is {state}; its create is dropped")
        session = self.workers.local(sandbox.worker)
        if session is None:
            raise TunnelUnavailableError("sandbox tunnel not available", retry_after=2.0)
        try:
            await self.workers.call(
                session, "provision", job.request, wait=self.settings.start_timeout
            )
        except TunnelUnavailableError:
            raise  # the link dropped or went silent: the job stays pending, not a timeout
        except BaseException as exc:
            reason = exc.message if isinstance(exc, SandgateError) else f"{type(exc).__name__}"
            if isinstance(exc, SandboxTimeoutError):  # counted first: the undo below may wait
                shown = reason.replace(sandbox.name, "the sandbox")  # reasons reach all tenants
                await asyncio.shield(self.admission.scheduling_timeout(sandbox, shown))
            await asyncio.shield(self._start_failed(sandbox, job, reason))
            current = await self.store.get_sandbox(sandbox.name)
            if current is not None and current.state in ("deleted", "stopped"):
                raise ConflictError(
                    f"sandbox {sandbox.name} was {current.state} while it started"
                ) from exc
            if isinstance(exc, SandboxTimeoutError):
                raise SandboxTimeoutError(
                    f"sandbox {sandbox.name} was not ready within the start timeout "
                    f"({self.settings.start_timeout:g} s): {reason}; retry later"
                ) from exc
            if isinstance(exc, InvalidRequestError):
                raise
            if not isinstance(exc, Exception):
                raise
            raise WorkerError(f"sandbox {sandbox.name} failed to start: {reason}") from exc
        now = utcnow()
        expires_at = now + timedelta(seconds=sandbox.timeout)
        await self.store.finish_job(job.id, "completed", now=now)
        if not await self.store.mark_running(
            sandbox.name, WorkerName(session.worker), now, expires_at
        ):
            current = await self.store.get_sandbox(sandbox.name)
            if current is not None and current.state == "running":
                return current  # a concurrent delivery recorded it first
            # deleted while it started: do not resurrect it, take it down again
            await self.sandboxes.destroy_on_worker(sandbox)
            raise ConflictError(f"sandbox {sandbox.name} was deleted while it started")
        log.info("sandbox.running", extra={"sandbox": sandbox.name, "forwarded": forwarded})
        return replace(
            sandbox, state="running", started_at=now, expires_at=expires_at, updated_at=now
        )

    async def recover(self, job: Job, *, capped: bool = True) -> None:
        """Deliver a create job nobody finished (claimed by compare-and-swap). `capped`: a
        job past `max_delivery_attempts` fails instead (recovery's poison-job guard)."""
        sandbox = await self.store.get_sandbox(job.sandbox_name)
        if (
            capped
            and sandbox is not None
            and sandbox.state == "pending"
            and (job.attempt > self.settings.max_delivery_attempts)
        ):
            reason = f"not delivered after {job.attempt - 1} attempts"
            await self._start_failed(sandbox, job, reason)
            return
        try:
            if sandbox is None or sandbox.state != "pending" or self.workers.local(sandbox.worker):
                await self.deliver_job(job.id, forwarded=False)
            else:
                node_url = await self.workers.owner(sandbox.worker)
                if node_url is None or node_url == self.workers.node_url:
                    return  # nobody holds the tunnel now; the next claim tries again
                await self.workers.peers.provision(node_url, job.id, wait=self._provision_wait)
            log.info("job.recovered", extra={"job": job.id, "attempt": job.attempt})
        except SandgateError as exc:
            log.warning("job.recovery_failed", extra={"job": job.id, "error": exc.message})

    async def _start_failed(self, sandbox: Sandbox, job: Job, reason: str) -> None:
        """Record the failure, free the key for a retry, and undo a half-done start."""
        now = utcnow()
        log.warning("sandbox.start_failed", extra={"sandbox": sandbox.name, "error": reason})
        try:
            await self.store.finish_job(job.id, "failed", error=reason, now=now)
            await self.store.set_sandbox_state(
                sandbox.name, "error", from_states=("pending",), error=reason, now=now
            )
            await self.store.release_idempotency(sandbox.tenant_id, sandbox.name)
        except SandgateError:
            log.exception("sandbox.start_failure_not_recorded", extra={"sandbox": sandbox.name})
        # the worker may have finished the start after we stopped waiting
        await self.sandboxes.destroy_on_worker(sandbox)


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
