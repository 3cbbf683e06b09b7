"""Delivery of accepted creates: the payload goes down the worker's tunnel (ours, or the
owning instance's through `/internal/provision`), the job completes and the sandbox runs.

Exactly once and never a resurrection: a job is claimed by compare-and-swap before it is
delivered again (a re-attaching worker's `wake`, recovery's `recover`), a sandbox no longer
pending fails its job instead, and one deleted while it started is taken down again. An
unkeyed create whose delivery failed is withdrawn before the client is told.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from datetime import timedelta

from sandgate.config import ServerSettings
from sandgate.control.admission import Admission
from sandgate.control.sandboxes import DESTROY_WAIT, SandboxService
from sandgate.control.workers import WorkerRegistry
from sandgate.core.clock import utcnow
from sandgate.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    SandboxTimeoutError,
    SandgateError,
    TunnelUnavailableError,
    UnavailableError,
    WorkerError,
)
from sandgate.store.base import Job, JobId, Sandbox, Store, WorkerName

log = logging.getLogger(__name__)

WAKE_BATCH = 20  # waiting creates delivered at once when their worker re-attaches


LAYER_FETCH_RATE = 20 << 20  # bytes/s a worker is given to fetch a template's layers it lacks


def fetch_allowance(request: dict[str, object]) -> float:
    """Seconds added to the start timeout of a template sandbox: its worker may have to
    fetch and unpack the image's layers first (at most once per worker)."""
    spec = request.get("spec")
    image = spec.get("image") if isinstance(spec, dict) else None
    if not isinstance(image, dict):
        return 0.0
    size = sum(int(x.get("size", 0)) for x in image.get("layers") or [] if isinstance(x, dict))
    return size / LAYER_FETCH_RATE


class Delivery:
    def __init__(
        self,
        store: Store,
        workers: WorkerRegistry,
        settings: ServerSettings,
        admission: Admission,
        sandboxes: SandboxService,
    ) -> None:
        self.store = store
        self.workers = workers
        self.settings = settings
        self.admission = admission
        self.sandboxes = sandboxes

    async def deliver(self, sandbox: Sandbox, job: Job, *, keyed: bool) -> Sandbox:
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
        wait = self.settings.start_timeout + fetch_allowance(job.request)
        try:
            await self.workers.call(session, "provision", job.request, wait=wait)
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
                    f"({wait:g} s): {reason}; retry later"
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
