"""The worker: sandboxes on this host, driven by requests arriving over the tunnel.

Tunnel operations (server → worker):

| op | fields | answer |
|---|---|---|
| `provision` | `name`, `spec` {env, network, memory_mb, cpus, pids, disk_mb} | `sandbox`, idem. |
| `destroy` | `name` | `existed` |
| `list` | | `sandboxes` [names], `tearing_down` [names being destroyed] |
| `agent` | `sandbox`, `call` {op, ...}, payload | the agent's answer, relayed |
| `metrics` | `name` | `timestamp`, `cpu_count`, `cpu_used_pct`, `mem_*`, `disk_*` (`metrics`) |
| `export_root` | `name` | `digest`, `size`, `entries` of its root's changes as a layer |
| `export_read` | `name`, `offset` | up to `BLOB_CHUNK` bytes of that layer (empty at its end) |
| `set_network` | `name`, `network` (false, true or {allow_out, deny_out}) | as `network` |
| `network` | `name` | `network`, `allowed`, `open`, `refused`, `dns_refused`, `recent_refusals` |
| `workspace_create` | `workspace` (its id), `owner`, `quota_mb` | `head` (its first commit) |
| `workspace_delete` | `workspace`, `owner` | `existed` |
| `workspace_git` | `workspace`, `owner`, `fence`, `action` (commit, log, show, restore) | result |

Requests (worker → server): `template` {name} → `image` (null: the built-in) for a pool;
`blob` {digest, offset} → up to 4 MiB of an image
layer from offset, empty past its end (`images.LayerCache` fetches the layers it lacks).

Events (worker → server): `hello` on connect and `heartbeat` (both carry `sandboxes`, what
runs, and `tearing_down`, what is still being destroyed), `sandbox_exited` {name, reason}.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sandgate import log_context
from sandgate.agent.frames import Header
from sandgate.core import placement
from sandgate.core.egress_policy import NetworkPolicy, parse_policy
from sandgate.core.workspaces import ResolvedMount, author_email, check_id, check_mount_path
from sandgate.errors import (
    ConflictError,
    DiskQuotaExceededError,
    InvalidRequestError,
    NoCapacityError,
    NotSupportedError,
    ResourceCapError,
    SandboxTimeoutError,
    StorageFullError,
    TunnelUnavailableError,
    WorkerError,
)
from sandgate.worker import cgroups, disk, export, metrics, pool
from sandgate.worker.agent_link import AgentLink
from sandgate.worker.disk_files import DiskFiles
from sandgate.worker.git_history import Author
from sandgate.worker.git_ops import WORKSPACE_OPS, git_work
from sandgate.worker.images import INCOMING, FetchChunk, LayerCache
from sandgate.worker.runtime.base import ImageSpec, LayerRef, Runtime, SandboxSpec
from sandgate.worker.state import LiveSandbox, Starting, WorkerLocalState, add_granted
from sandgate.worker.workspaces import WorkspaceHost

log = logging.getLogger(__name__)

AGENT_READY_TIMEOUT = 20.0
TEARDOWN_RETRY_MIN = 0.5  # a stop that failed is tried again after this, doubling...
TEARDOWN_RETRY_MAX = 30.0  # ...up to this
TEARDOWN_WAIT = 10.0  # a provision waits this long for a teardown of its name or its slot
SHUTDOWN_TEARDOWN_WAIT = 8.0  # a stopping worker waits this long (at most twice: see run) for
# its teardowns, so it stops within the 20 s `sandgate up` and the tests give it
DEFAULT_AGENT_CALL_TIMEOUT = 120.0
BLOB_CHUNK = 4 << 20  # an exported layer is read this much per export_read
POOL_CHECK = 5.0  # the pool filler looks again this often even unwoken
POOL_RETRY = 5.0  # a pool sandbox that failed to start is tried again after this
BOOT_CONTEXT_READY = 60.0  # a pooled code-interpreter sandbox's kernel must answer within this

Notify = Callable[[str, dict[str, Any]], Awaitable[None]]


class WorkerService:
    def __init__(
        self,
        runtime: Runtime,
        *,
        capacity: int,
        state: WorkerLocalState,
        enforces: dict[str, Any] | None = None,
        faults: frozenset[str] = frozenset(),
        pools: dict[str, int] | None = None,
    ) -> None:
        self.runtime = runtime
        self.capacity = capacity
        # template -> warm sandboxes to keep (worker/pool.py); configuration, never changed
        self.pools: Mapping[str, int] = MappingProxyType(dict(pools or {}))
        # the host's budget and per-sandbox maximum (worker.budget, core.placement)
        self.enforces = enforces or {}
        self.state = state
        self.faults = faults
        self.notify: Notify | None = None  # set while a tunnel is up
        self.fetch_chunk: FetchChunk | None = None  # likewise: reads image layers (`blob`)
        # likewise: a public template's image for a pool (`template`), None for a built-in
        self.fetch_template: Callable[[str], Awaitable[dict[str, Any] | None]] | None = None
        store = getattr(runtime, "layer_store", None)
        self.layers = None if store is None else LayerCache(store, state.layer_fetches)
        self.shutting_down = False  # run() is destroying everything on its way out
        host: WorkspaceHost | None = getattr(runtime, "workspaces", None)
        if host is not None:
            host.freeze = self._freeze_workspace_users
        self._tasks: asyncio.TaskGroup | None = None

    async def run(self, body: Callable[[], Awaitable[None]]) -> None:
        """Own the task group the agents' readers run in; run `body` (the tunnel) inside it.

        On the way out (body returned or we are cancelled) every sandbox is destroyed.
        """
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                filler = tasks.create_task(self._fill_pools()) if self.pools else None
                try:
                    await body()
                finally:
                    if filler is not None:
                        filler.cancel()
                await self.destroy_all()
        finally:
            self.shutting_down = True
            self._tasks = None
            await asyncio.shield(self.destroy_all())
            try:
                await asyncio.shield(self.runtime.close())
            except Exception:
                log.exception("worker.cleanup_failed")

    async def handle(self, header: Header, payload: bytes) -> tuple[Header, bytes]:
        """One tunnel request, in the context of the control plane's request that made it
        (its id on every line logged meanwhile)."""
        with log_context.request(header.get(log_context.FIELD)):
            return await self._handle(header, payload)

    async def _handle(self, header: Header, payload: bytes) -> tuple[Header, bytes]:
        op = header.get("op")
        if op == "agent":
            return await self._relay(header, payload)
        if op == "provision":
            live = await self.provision(_spec(header))
            return {"sandbox": live.info()}, b""
        if op == "destroy":
            existed = await self.destroy(str(header.get("name", "")))
            return {"existed": existed}, b""
        if op == "metrics":
            return await self._metrics(str(header.get("name", ""))), b""
        if op == "set_network":
            live = self._running(str(header.get("name", "")))
            policy = parse_policy(header.get("network"))
            await self._set_network(live, policy)
            return self._network_state(live), b""
        if op == "network":
            return self._network_state(self._running(str(header.get("name", "")))), b""
        if op == "export_root":
            return await self._export_root(str(header.get("name", ""))), b""
        if op == "export_read":
            offset = header.get("offset")
            if not isinstance(offset, int) or offset < 0:
                raise InvalidRequestError("export_read takes an offset >= 0")
            return {}, await self._export_read(str(header.get("name", "")), offset)
        if op in WORKSPACE_OPS:
            reply = await self._workspace(op, header)
            # a diff's patch travels as the payload: as JSON its escapes could outgrow a header
            patch = reply.pop("patch", None)
            if isinstance(patch, str):
                reply["patch_in_payload"] = True
                return reply, patch.encode("utf-8", "surrogateescape")
            return reply, b""
        if op == "list":
            return {
                "sandboxes": sorted(self.state.sandboxes),
                "tearing_down": sorted(self.state.tearing_down),
            }, b""
        if op == "ping":
            return {}, b""
        raise InvalidRequestError(f"unknown tunnel op {op!r}")

    async def provision(self, spec: SandboxSpec) -> LiveSandbox:
        deadline = asyncio.get_running_loop().time() + TEARDOWN_WAIT
        while True:
            live = self.state.sandboxes.get(spec.name)
            if live is not None:
                log.info("sandbox.provision_repeat", extra={"sandbox": spec.name})
                return live
            pending = self.state.provisioning.get(spec.name)
            if pending is not None:
                log.info("sandbox.provision_repeat", extra={"sandbox": spec.name})
                return await _outcome(spec.name, pending.start)
            if not await self._wait_for_teardowns(spec.name, deadline):
                break  # nothing to wait for (any more): a free slot, or at capacity
        held = len(self.state.sandboxes) + len(self.state.provisioning)
        room = self.capacity - pool.reserved(self.pools)  # the pools hold the rest
        if held + len(self.state.tearing_down) >= room:
            raise NoCapacityError(f"worker is at its capacity of {room} sandboxes")
        handed = await self._from_pool(spec)
        if handed is not None:
            return handed
        self._check_budget(spec)
        # the start runs as its own task, so a destroy can abandon it (see destroy)
        start = asyncio.get_running_loop().create_task(self._start_registered(spec))
        self.state.provisioning[spec.name] = Starting(spec, start)
        try:
            return await _outcome(spec.name, start)
        except asyncio.CancelledError:
            start.cancel()  # this request was cancelled: so is the start
            raise
        finally:
            starting = self.state.provisioning.get(spec.name)
            if starting is not None and starting.start is start:
                del self.state.provisioning[spec.name]

    def _check_budget(self, spec: SandboxSpec) -> None:
        """Refuse what this host cannot hold: one sandbox above its maximum (422), or one
        more than what is left of its budget (503, the control plane places elsewhere)."""
        need = spec.resources()
        most = placement.sandbox_max_of(self.enforces)
        if (name := placement.too_large(need, most)) is not None:
            raise ResourceCapError(
                f"{name} {need[name]:g} is more than this worker's host can give one sandbox "
                f"(at most {most[name]:g}); ask for less",
                cap=f"worker_max_{name}",
                value=most[name],
            )
        budget = placement.budget_of(self.enforces)
        if budget:
            # what is running, starting and tearing down is kept summed (GrantTally): a start
            # adds up the few pooled sandboxes only, not every sandbox held
            used = self.state.sandboxes.granted
            for tally in (self.state.provisioning, self.state.tearing_down):
                for name, amount in tally.granted.items():
                    used[name] += amount
            for ready in self.state.pool.values():
                for live in ready:
                    add_granted(used, live.running.spec)
            if (name := placement.short_of(need, used, budget)) is not None:
                raise NoCapacityError(
                    f"worker has {budget[name] - used[name]} of its {budget[name]} {name} left "
                    f"for sandboxes; this one needs {need[name]:g}",
                    retry_after=5.0,
                )

    async def _wait_for_teardowns(self, name: str, deadline: float) -> bool:
        """Wait (until `deadline`) for a teardown of this very name (its directory and
        cgroups are named after it), or for any teardown when only teardowns hold the last
        slots: the control plane counts a deleted sandbox free at once, and it soon is.
        False when there was nothing to wait for."""
        same = self.state.teardowns.get(name)
        held = len(self.state.sandboxes) + len(self.state.provisioning)
        room = self.capacity - pool.reserved(self.pools)  # the pools hold the rest
        full = held < room <= held + len(self.state.tearing_down)
        waiting = [same] if same is not None else list(self.state.teardowns.values())
        if (same is None and not full) or not waiting:
            return False
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            if same is not None:
                raise ConflictError(f"sandbox {name} is still being torn down on this worker")
            return False
        await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        return True

    async def _start_registered(self, spec: SandboxSpec) -> LiveSandbox:
        live = await self._start(spec)
        if spec.template in pool.BOOT_CONTEXT:  # its kernel boots beside the first calls
            try:
                await self._boot_context(live, wait=False)
            except BaseException:
                self._forget(live)
                await asyncio.shield(self._teardown_task(live.name))
                raise
        self.state.sandboxes[spec.name] = live
        log.info("sandbox.started", extra={"sandbox": spec.name})
        return live

    async def destroy(self, name: str) -> bool:
        """Tear the sandbox down. Durable against the caller going away: the teardown is
        recorded (`tearing_down`) before the sandbox is forgotten and runs as its own task,
        so a request cancelled by a link drop never leaves processes, cgroups, the uid lease
        or the directories behind."""
        starting = self.state.provisioning.get(name)
        pending = starting.start if starting is not None else None
        if pending is not None:
            pending.cancel()  # a start still in progress is abandoned (it cleans up after itself)
            await asyncio.wait([pending])  # and if it had just finished, it is registered
        live = self.state.sandboxes.pop(name, None)
        if live is not None:
            self._forget(live)
        if name not in self.state.tearing_down:
            return pending is not None or live is not None
        await asyncio.shield(self._teardown_task(name))
        return True

    def _forget(self, live: LiveSandbox) -> None:
        """Move a sandbox from the running to the tearing-down record (no await between)."""
        live.stopping = True
        self.state.tearing_down[live.name] = live
        self.state.cpu_samples.pop(live.name, None)

    def _teardown_task(self, name: str) -> asyncio.Task[None]:
        """The one task tearing `name` down, started if none runs; it outlives its callers."""
        task = self.state.teardowns.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._teardown(name))
            self.state.teardowns[name] = task
        return task

    async def _teardown(self, name: str) -> None:
        """Stop the sandbox until it is stopped: a failed stop (a process that survives
        SIGKILL for a while) is retried with backoff; it stays reported until done."""
        delay = TEARDOWN_RETRY_MIN
        try:
            while (live := self.state.tearing_down.get(name)) is not None:
                try:
                    await live.link.close()
                    await self.runtime.stop(live.running)
                except Exception:
                    log.exception("sandbox.stop_failed", extra={"sandbox": name, "retry_s": delay})
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, TEARDOWN_RETRY_MAX)
                    continue
                if self.layers is not None:  # a build step's exported layer, if any
                    export_file = self._export_path(name)
                    await asyncio.to_thread(export_file.unlink, missing_ok=True)
                if self.state.tearing_down.get(name) is live:
                    del self.state.tearing_down[name]
                log.info("sandbox.destroyed", extra={"sandbox": name})
        finally:
            self.state.teardowns.pop(name, None)

    async def destroy_all(self) -> None:
        """Destroy everything, waiting at most SHUTDOWN_TEARDOWN_WAIT: what a stuck teardown
        leaves is removed at the worker's next start (`Runtime.prepare`)."""
        for ready in self.state.pool.values():
            while ready:
                self._forget(ready.pop())
        names = {*self.state.sandboxes, *self.state.provisioning, *self.state.tearing_down}
        if not names:
            return
        tasks = [asyncio.ensure_future(self.destroy(n)) for n in names]
        _, stuck = await asyncio.wait(tasks, timeout=SHUTDOWN_TEARDOWN_WAIT)
        if stuck:
            log.error("worker.teardown_unfinished", extra={"sandboxes": len(stuck)})

    async def _start(self, spec: SandboxSpec) -> LiveSandbox:
        if self._tasks is None:
            raise WorkerError("worker is shutting down")
        if "hang-start" in self.faults:
            log.critical("fault.hang_start", extra={"sandbox": spec.name})
            await asyncio.Event().wait()  # never ready; cancelled when the worker stops
        if spec.image is not None:
            if self.layers is None:
                raise NotSupportedError(
                    f"this worker's {self.runtime.name} runtime cannot start a template's own "
                    "root file system; run the worker with the bwrap runtime"
                )
            await self.layers.ensure(spec.image.layers, self.fetch_chunk)
        running = await self.runtime.start(spec)
        live = LiveSandbox(running, AgentLink(spec.name, running.process))
        try:
            link = live.link
            self._tasks.create_task(self._watch(live))
            ready = asyncio.ensure_future(link.ready.wait())
            exited = asyncio.ensure_future(running.process.wait())
            done, _ = await asyncio.wait(
                {ready, exited}, timeout=AGENT_READY_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
            ready.cancel()
            exited.cancel()
            if not link.ready.is_set():
                if exited in done:
                    raise WorkerError(
                        f"sandbox {spec.name} exited during start "
                        f"(code {running.process.returncode}); see the worker log"
                    )
                raise SandboxTimeoutError(
                    f"sandbox {spec.name} agent not ready within {AGENT_READY_TIMEOUT:g} s"
                )
            if spec.image is not None and spec.image.cmd:
                await self._start_image_cmd(live, spec.image.cmd)
            return live
        except BaseException:
            # abandoned (a destroy, a dropped link) or failed: torn down durably, as a destroy
            self._forget(live)
            await asyncio.shield(self._teardown_task(spec.name))
            raise

    async def _watch(self, live: LiveSandbox) -> None:
        """Serve the agent link; if it ends without a destroy, the sandbox died.

        Nothing from here may reach the task group: the agent runs beside tenant code and
        may send anything; a failure is this sandbox's, never the worker's.
        """
        try:
            await live.link.serve()
        except Exception:
            log.exception("sandbox.agent_link_failed", extra={"sandbox": live.name})
        if not live.stopping and self._unpool(live):  # a pooled one died: never handed out
            log.warning("sandbox.pooled_died", extra={"sandbox": live.name})
            self._forget(live)
            self.state.pool_wanted.set()
            await asyncio.shield(self._teardown_task(live.name))
            return
        if live.stopping or self.state.sandboxes.get(live.name) is not live:
            return
        del self.state.sandboxes[live.name]
        self._forget(live)
        code = live.running.process.returncode
        log.warning("sandbox.died", extra={"sandbox": live.name, "code": code})
        teardown = self._teardown_task(live.name)
        try:
            await self._report_exit(live, code)  # told now, not once the teardown is done
        finally:
            await asyncio.shield(teardown)

    async def _report_exit(self, live: LiveSandbox, code: int | None) -> None:
        task = asyncio.current_task()
        if self.notify is None or (task is not None and task.cancelling() > 0):
            return  # shutting down, or no tunnel: the next hello reports it gone
        try:
            await asyncio.wait_for(
                self.notify(
                    "sandbox_exited", {"name": live.name, "reason": f"agent exited (code {code})"}
                ),
                timeout=5.0,
            )
        except Exception:
            log.warning("sandbox.exit_not_reported", extra={"sandbox": live.name})

    # -- warm pools (worker/pool.py) --------------------------------------------------------
    async def _from_pool(self, spec: SandboxSpec) -> LiveSandbox | None:
        """A pooled sandbox for this provision, handed out under its name, or None."""
        if spec.workspaces:  # pooled sandboxes have none bound: this one starts its own
            return None
        ready = self.state.pool.get(spec.template, [])
        # only a sandbox of the very image asked for matches (a tenant's own template of the
        # pool's name is another image); the filler drops the ones of a replaced image
        switches = bool(getattr(self.runtime, "switches_network", False))
        found = next(
            (
                live
                for live in ready
                if pool.matches(live.running.spec, spec, network_switches=switches)
            ),
            None,
        )
        if found is None:
            return None
        live = found
        ready.remove(live)  # no await since the match: one hand-out per pooled sandbox
        self.state.pool_wanted.set()
        try:
            await live.link.channel.request("configure", {"env": spec.env}, b"", wait=10.0)
            if spec.env and spec.template in pool.BOOT_CONTEXT:
                line = json.dumps({"op": "env", "env": spec.env}).encode() + b"\n"
                tag = "ctx:" + pool.BOOT_CONTEXT[spec.template]
                fields = {"tag": tag, "close": False}
                await live.link.channel.request("proc_stdin", fields, line, wait=10.0)
            if spec.network.enabled:
                await self._set_network(live, spec.network)
        except Exception:  # its agent failed: this one goes, the create starts its own
            log.exception("sandbox.pool_handout_failed", extra={"sandbox": live.name})
            self._forget(live)
            await asyncio.shield(self._teardown_task(live.name))
            return None
        live.handed_as = spec.name
        self.state.sandboxes[spec.name] = live
        log.info(
            "sandbox.started",
            extra={"sandbox": spec.name, "pooled": live.running.spec.name},
        )
        return live

    def _unpool(self, live: LiveSandbox) -> bool:
        ready = self.state.pool.get(live.running.spec.template, [])
        if live in ready:
            ready.remove(live)
            return True
        return False

    async def _drop_stale(self) -> None:
        """Tear down pooled sandboxes whose template now names another image (an operator
        replaced it): they would never be handed out."""
        for template, ready in list(self.state.pool.items()):
            if not ready or self.fetch_template is None:
                continue
            try:
                current = await self._pool_image(template)
            except Exception:  # no answer now: asked again at the next check
                continue
            want = None if current is None else current.digest
            for live in [x for x in ready if pool.image_digest(x.running.spec) != want]:
                ready.remove(live)
                self._forget(live)
                self._teardown_task(live.name)
                log.info("sandbox.pool_stale", extra={"sandbox": live.name, "template": template})

    async def _fill_pools(self) -> None:
        """Keep every pool full, as far as capacity and budget allow."""
        while True:
            self.state.pool_wanted.clear()
            await self._drop_stale()
            for template, size in self.pools.items():
                while (
                    len(self.state.pool.get(template, []))
                    + self.state.pool_starting.get(template, 0)
                    < size
                    and self._room_for_pool()
                ):
                    self.state.pool_starting[template] = (
                        self.state.pool_starting.get(template, 0) + 1
                    )
                    assert self._tasks is not None
                    self._tasks.create_task(self._start_pooled(template))
            try:
                await asyncio.wait_for(self.state.pool_wanted.wait(), POOL_CHECK)
            except TimeoutError:
                pass

    def _room_for_pool(self) -> bool:
        pooled = sum(len(ready) for ready in self.state.pool.values())
        starting = sum(self.state.pool_starting.values())
        held = len(self.state.sandboxes) + len(self.state.provisioning)
        if held + len(self.state.tearing_down) + pooled + starting >= self.capacity:
            return False
        try:
            self._check_budget(pool.pooled_spec("default"))
        except (NoCapacityError, ResourceCapError):
            return False
        return True

    async def _pool_image(self, template: str) -> ImageSpec | None:
        """The image a pool of `template` starts from now: None for a built-in the operator
        has not replaced with a public image of that name (asked of the control plane)."""
        if self.fetch_template is None:
            if template in pool.TEMPLATES:
                return None
            raise WorkerError(f"no tunnel to ask for template {template!r}")
        return _image(await self.fetch_template(template))

    async def _start_pooled(self, template: str) -> None:
        try:
            spec = pool.pooled_spec(template, await self._pool_image(template))
            live = await self._start(spec)
            try:
                if template in pool.BOOT_CONTEXT:
                    await self._boot_context(live, wait=True)
            except BaseException:
                self._forget(live)
                await asyncio.shield(self._teardown_task(live.name))
                raise
            if live.stopping:
                return  # died while its kernel started: _watch tore it down
            if self.shutting_down:  # too late for the pool: torn down with the rest
                self._forget(live)
                await asyncio.shield(self._teardown_task(live.name))
                return
            self.state.pool.setdefault(template, []).append(live)
            log.info("sandbox.pooled", extra={"sandbox": spec.name, "template": template})
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("sandbox.pool_start_failed", extra={"template": template})
            await asyncio.sleep(POOL_RETRY)
        finally:
            self.state.pool_starting[template] -= 1
            self.state.pool_wanted.set()

    async def _start_image_cmd(self, live: LiveSandbox, cmd: tuple[str, ...]) -> None:
        """The image's command (OCI `Cmd`), started as a background process of the sandbox
        (tagged `cmd`, stdin closed), as a container would start it; one that cannot start
        is logged, and the sandbox serves commands all the same."""
        fields: dict[str, Any] = {"argv": list(cmd), "tag": "cmd", "stdin": False}
        try:
            await live.link.channel.request("proc_start", fields, b"", wait=10.0)
        except Exception as exc:
            log.warning(
                "sandbox.image_cmd_failed",
                extra={"sandbox": live.name, "cmd": list(cmd), "error": repr(exc)},
            )

    async def _boot_context(self, live: LiveSandbox, *, wait: bool) -> None:
        """Start the template's default code context (its kernel); with `wait`, until the
        kernel answers."""
        context = pool.BOOT_CONTEXT[live.running.spec.template]
        fields: dict[str, Any] = {
            "program": "kernel_bridge",
            "argv": ["--context", context, "--cwd", "/workspace"],
            "cwd": "/workspace",
            "tag": f"ctx:{context}",
        }
        reply, _ = await live.link.channel.request("proc_start", fields, b"", wait=10.0)
        if not wait:
            return
        pid, offset, seen = reply["pid"], 0, b""
        async with asyncio.timeout(BOOT_CONTEXT_READY):
            while b'"type":"ready"' not in seen:
                read: dict[str, Any] = {"pid": pid, "offset": offset, "wait": 10.0}
                page, data = await live.link.channel.request("proc_read", read, b"", wait=15.0)
                if page.get("exited"):
                    raise WorkerError(f"the kernel of {live.name} exited while starting")
                seen = (seen + data)[-4096:]
                offset = int(page.get("next_offset", offset))

    async def _relay(self, header: Header, payload: bytes) -> tuple[Header, bytes]:
        live = self._running(str(header.get("sandbox", "")))
        call = header.get("call")
        if not isinstance(call, dict) or not isinstance(call.get("op"), str):
            raise InvalidRequestError("agent relay needs a call with an op")
        fields = dict(call)
        op = fields.pop("op")
        timeout = float(header.get("timeout_s") or DEFAULT_AGENT_CALL_TIMEOUT) + 2.0
        files = live.running.files
        counter = live.running.oom_counter if op == "exec" else None
        oom_before: list[int | None] = []
        reading = None
        if counter is not None:
            # the memory limit's kill count before the command, read once the call is on its
            # way, while the agent works (read before the send, it cost an echo ~0.1 ms here).
            # A kill can only follow the command's spawn, much later; a read that came late
            # could miss a kill, never make one up.
            reading = asyncio.get_running_loop().call_soon(
                lambda: oom_before.append(metrics.read_oom_kills(counter))
            )
        try:
            # a whole file on the sandbox's own disk: the worker's, without the agent's pipes
            direct = None
            if files is not None and op in DiskFiles.OPS:
                direct = await files.serve(op, fields, payload, wait=timeout)
            if direct is not None:
                return direct
            reply, body = await live.link.channel.request(op, fields, payload, wait=timeout)
        except StorageFullError as exc:
            raise self._storage_full(live.running.spec, exc) from None
        except TunnelUnavailableError:
            if live.stopping:  # torn down meanwhile (a delete, its timeout): as if it came after
                error = f"sandbox {live.name} is not running"
                raise ConflictError(error, code="not_running") from None
            raise
        finally:
            if reading is not None:
                reading.cancel()  # the call ended before the loop ran it (a refusal)
        reply.pop("id", None)
        reply.pop("ok", None)
        if counter is not None and oom_before and oom_before[0] is not None and _killed(reply):
            # SIGKILLed while the kernel killed at the memory limit: the limit killed it (or a
            # process it waited for, which its shell reports the same way)
            oom_after = metrics.read_oom_kills(counter)
            if oom_after is not None and oom_after > oom_before[0]:
                reply["oom_killed"] = True
        return reply, body

    async def _set_network(self, live: LiveSandbox, policy: NetworkPolicy) -> None:
        setter = getattr(self.runtime, "set_network", None)
        if setter is None:
            raise NotSupportedError(
                f"the {self.runtime.name} runtime cannot change a running sandbox's network"
            )
        await setter(live.running, policy)
        log.info("sandbox.network_set", extra={"sandbox": live.name, "network": policy.to_json()})

    def _network_state(self, live: LiveSandbox) -> Header:
        reader = getattr(self.runtime, "network_state", None)
        if reader is None:
            return {"network": live.running.spec.network.to_json()}
        state: Header = reader(live.running)
        return state

    async def _metrics(self, name: str) -> Header:
        """What the sandbox uses now, measured on this host (`worker/metrics.py`)."""
        live = self._running(name)
        try:
            measured, sample = await metrics.measure(live.running, self.state.cpu_samples.get(name))
        except (OSError, ValueError) as exc:
            self._running(name)  # stopped meanwhile: that is the answer
            raise WorkerError(f"cannot measure sandbox {name}: {exc}") from exc
        if self._running(name) is not live:  # figures of a sandbox torn down meanwhile
            raise ConflictError(f"sandbox {name} is not running", code="not_running")
        self.state.cpu_samples[name] = sample
        return measured.header()

    def _export_path(self, name: str) -> Path:
        if self.layers is None:
            raise NotSupportedError(f"this worker's {self.runtime.name} runtime has no image roots")
        return self.layers.store / INCOMING / f"export-{name}.tar"

    async def _export_root(self, name: str) -> Header:
        """Write what the sandbox changed in its image root as a layer (a build's step)."""
        live = self._running(name)
        upper = live.running.upper
        if upper is None:
            raise InvalidRequestError(
                f"sandbox {name} has no image root to export (it runs a built-in template)"
            )
        out = self._export_path(name)
        await asyncio.to_thread(out.parent.mkdir, mode=0o700, exist_ok=True)
        # its processes hold still while their changes are read (a step may leave some)
        frozen = await self._hold_frozen(live, True)
        try:
            digest, size, entries = await asyncio.to_thread(
                export.export_upper, upper, out, max_bytes=live.running.spec.disk_mb << 20
            )
        finally:
            if frozen:
                await self._hold_frozen(live, False)
        return {"digest": digest, "size": size, "entries": entries}

    async def _export_read(self, name: str, offset: int) -> bytes:
        self._running(name)
        path = self._export_path(name)

        def read() -> bytes:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(BLOB_CHUNK)

        try:
            return await asyncio.to_thread(read)
        except FileNotFoundError:
            raise ConflictError(f"sandbox {name} has no exported layer: export it first") from None

    async def _workspace(self, op: str, header: Header) -> Header:
        host: WorkspaceHost | None = getattr(self.runtime, "workspaces", None)
        if host is None or host.problem is not None:
            why = "none configured" if host is None else host.problem
            raise NotSupportedError(f"this worker serves no workspaces ({why})")
        ws_id, owner = str(header.get("workspace", "")), str(header.get("owner", ""))
        if not owner:
            raise InvalidRequestError("a workspace operation names its owner")
        if op == "workspace_create":
            author = Author(owner, author_email(owner))
            head = await host.create(ws_id, owner, int(header.get("quota_mb", 0)), author)
            return {"head": head}
        if op == "workspace_delete":
            return {"existed": await host.delete(ws_id, owner)}
        fence = header.get("fence")
        if fence is None and header.get("action") not in ("log", "show"):
            raise InvalidRequestError("a commit or restore takes the workspace lock's fence")
        if fence is not None and not isinstance(fence, int):
            raise InvalidRequestError("fence must be a number")
        work = git_work(header)
        return await host.run(ws_id, owner, fence, work)

    async def _freeze_workspace_users(self, ws_id: str, frozen: bool) -> int:
        """Freeze (thaw) the running sandboxes that mount the workspace; how many were."""
        users = [
            live
            for live in self.state.sandboxes.values()
            if any(m.id == ws_id for m in live.running.spec.workspaces)
        ]
        done = 0
        for live in users:
            if await self._hold_frozen(live, frozen):
                done += 1
            elif frozen:
                log.warning(
                    "workspace.freeze_unavailable",
                    extra={"workspace": ws_id, "sandbox": live.name},
                )
        if users and frozen:
            log.info("workspace.users_frozen", extra={"workspace": ws_id, "frozen": done})
        return done

    async def _hold_frozen(self, live: LiveSandbox, frozen: bool) -> bool:
        dirs = live.running.cgroup_dirs
        return await cgroups.hold_frozen(self.state.freeze_holds, live.name, dirs, frozen)

    def _running(self, name: str) -> LiveSandbox:
        live = self.state.sandboxes.get(name)
        if live is None:
            raise ConflictError(f"sandbox {name} is not running", code="not_running")
        return live

    def _storage_full(self, spec: SandboxSpec, exc: StorageFullError) -> StorageFullError:
        """The agent's ENOSPC, told as what filled up and what the caller may do."""
        if self.runtime.features().get("disk_quota"):
            return DiskQuotaExceededError(
                f"{exc.message}: the sandbox's disk quota of {spec.disk_mb} MiB "
                f"({disk.inodes_for(spec.disk_mb)} files; /workspace and /tmp together, "
                "resources.disk_mb) is full; delete files, or create the sandbox with a "
                "larger disk_mb"
            )
        return StorageFullError(
            f"{exc.message}: the worker's disk is full (this worker enforces no per-sandbox "
            "quota); delete files, or retry on another worker"
        )


def _killed(reply: Header) -> bool:
    """An exec's answer for a command that SIGKILL ended (128 + 9, as a shell says), not its
    timeout."""
    return reply.get("exit_code") == 128 + signal.SIGKILL and not reply.get("timed_out")


def _spec(header: Header) -> SandboxSpec:
    name = header.get("name")
    spec = header.get("spec") or {}
    if not isinstance(name, str) or not isinstance(spec, dict):
        raise InvalidRequestError("provision needs a name and a spec")
    try:
        return SandboxSpec(
            name=name,
            env={str(k): str(v) for k, v in (spec.get("env") or {}).items()},
            network=parse_policy(spec.get("network", False)),
            memory_mb=int(spec.get("memory_mb", 512)),
            cpus=float(spec.get("cpus", 1.0)),
            pids=int(spec.get("pids", 256)),
            disk_mb=int(spec.get("disk_mb", 1024)),
            template=str(spec.get("template", "default")),
            pool=bool(spec.get("pool", True)),
            image=_image(spec.get("image")),
            workspaces=tuple(
                ResolvedMount(
                    id=check_id(m["id"]),
                    name=str(m["name"]),
                    path=check_mount_path(m["path"]),
                    owner=str(m["owner"]),
                )
                for m in spec.get("workspaces") or ()
            ),
        )
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise InvalidRequestError(f"bad provision spec: {exc}") from None


def _image(raw: Any) -> ImageSpec | None:
    """A provision's `image` (control/templates.py `image_spec`), or None for a built-in."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TypeError("image must be an object")
    return ImageSpec(
        digest=str(raw["digest"]),
        layers=tuple(
            LayerRef(digest=str(x["digest"]), size=int(x["size"]), media=str(x.get("media", "tar")))
            for x in raw.get("layers") or []
        ),
        env=tuple((str(k), str(v)) for k, v in (raw.get("env") or {}).items()),
        workdir=str(raw.get("workdir") or ""),
        user=str(raw.get("user") or ""),
        cmd=tuple(str(x) for x in raw.get("cmd") or ()),
    )


async def _outcome(name: str, start: asyncio.Future[LiveSandbox]) -> LiveSandbox:
    """Wait for a start (shielded: one waiter leaving does not abandon it for the others)."""
    try:
        return await asyncio.shield(start)
    except asyncio.CancelledError:
        if start.cancelled():
            raise WorkerError(f"sandbox {name} was destroyed while it started") from None
        raise
