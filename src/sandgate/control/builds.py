"""Template builds: a base image plus steps, each step a layer, built in real sandboxes.

A `run` step runs in a fresh sandbox of the image so far (the tenant's own, counted in its
quota, isolated like any other; network only if the build asks and a worker allows it);
its output is streamed as it comes; what it changed in the root is exported by the worker
as a layer (worker/export.py) and stored like an imported one. A `copy` step's layer is made
here from the build context, with no sandbox. `env`, `workdir` and `user` change the config.
Every step has a cache key (core/build_spec.step_key): a step already built by the same
owner reuses its layer.

Nothing is half-registered: the template is recorded only when every step succeeded. A
failed step ends the build with its log kept (`GET /api/v1/templates/builds/{id}`), and the
step's sandbox is deleted whatever happens (the client leaving cancels the build).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import posixpath
import shlex
import tarfile
import tempfile
import time
import uuid
import zlib
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from sandgate.config import ServerSettings
from sandgate.control.create import CreatePipeline, CreateRequest
from sandgate.control.image_archive import MAX_LAYERS, ArchiveLayer, file_digest
from sandgate.control.sandboxes import SandboxService
from sandgate.control.templates import TemplateService, check_name, image_digest
from sandgate.control.toolbox import Toolbox
from sandgate.core import caps
from sandgate.core.build_spec import BuildSpec, BuildSpecError, Config, Step, step_key
from sandgate.core.clock import utcnow
from sandgate.core.layer_rules import LayerRuleError, Tally, max_unpacked
from sandgate.core.output import decode_output
from sandgate.errors import (
    InvalidRequestError,
    NotFoundError,
    SandgateError,
    WorkerError,
)
from sandgate.store.base import BuildRecord, Store, TemplateRecord, TenantId

log = logging.getLogger(__name__)

BUILDER_TENANT = "sandgate-builder"  # runs the steps of public builds (an admin key's)
MAX_BUILD_LOG = 1 << 20  # characters of a build's log kept (the last ones)
BUILDS_KEPT = 100  # per owner
STEP_SANDBOX_GRACE = 300.0  # a step's sandbox outlives its command's timeout by this
OUTPUT_WAIT = 5.0  # a follow of the step's output waits this long per read

Event = dict[str, Any]


class _Log:
    def __init__(self) -> None:
        self.text = ""

    def add(self, text: str) -> None:
        self.text = (self.text + text)[-MAX_BUILD_LOG:]


class BuildService:
    def __init__(
        self,
        store: Store,
        settings: ServerSettings,
        templates: TemplateService,
        creates: CreatePipeline,
        toolbox: Toolbox,
        sandboxes: SandboxService,
    ) -> None:
        self.store = store
        self.settings = settings
        self.templates = templates
        self.creates = creates
        self.toolbox = toolbox
        self.sandboxes = sandboxes

    async def get(self, tenant: TenantId | None, build_id: str) -> BuildRecord:
        record = await self.store.get_build(self.templates.owner_of(tenant), build_id)
        if record is None:
            raise NotFoundError(f"build {build_id!r} not found", code="build_not_found")
        return record

    async def build(
        self, tenant: TenantId | None, name: str, spec: BuildSpec, context: Path | None
    ) -> AsyncGenerator[Event, None]:
        """Run the build, yielding its events: `build` {id, steps}, then per step `step`
        {index, step} and `log` {text} lines and `step_done` {index, cached, layer}, and at
        the end `done` {template} or `error` {message, step}."""
        owner = self.templates.owner_of(tenant)  # an admin's build is public
        check_name(name)
        self.templates.check_builtin(tenant, name)
        if tenant is None:  # its steps run as the builder's own tenant, counted like any
            tenant = (await self.store.ensure_tenant(BUILDER_TENANT)).id
        base = await self.templates.resolve(tenant, spec.base)
        if base.image is None:
            raise BuildSpecError(
                f"a build starts from an image template, and {spec.base!r} is the host's own "
                "root: import an image first (sandgate templates import)"
            )
        if any(step.kind == "copy" for step in spec.steps) and context is None:
            raise BuildSpecError("the build has copy steps but no build context was sent")
        making = sum(1 for step in spec.steps if step.kind in ("run", "copy"))
        if len(base.image["layers"]) + making > MAX_LAYERS:
            raise BuildSpecError(
                f"{spec.base} has {len(base.image['layers'])} layers and the build adds up to "
                f"{making}: at most {MAX_LAYERS} in all (merge run steps)"
            )
        if context is not None:
            await asyncio.to_thread(check_context, context)
        record = BuildRecord(
            id=uuid.uuid4().hex,
            owner=owner,
            name=name,
            state="running",
            log="",
            error=None,
            digest=None,
            created_at=utcnow(),
            finished_at=None,
        )
        await self.store.insert_build(record, keep=BUILDS_KEPT)
        out = _Log()
        index = 0
        try:
            yield {"event": "build", "id": record.id, "steps": len(spec.steps)}
            layers: list[dict[str, Any]] = list(base.image["layers"])
            config = Config.of(base.image)
            key = str(base.image["digest"])
            for index, step in enumerate(spec.steps, 1):
                began = time.monotonic()
                out.add(f"#{index} {step.describe()}\n")
                yield {"event": "step", "index": index, "step": step.describe()}
                cached = False
                layer: dict[str, Any] | None = None
                if step.kind in ("env", "workdir", "user"):
                    key = step_key(key, step, config, network=False)
                    config = config.after(step)
                elif step.kind == "copy":
                    assert context is not None
                    layer, cached = await self._copy_layer(step, context)
                    key = step_key(key, step, config, network=False, content=layer["digest"])
                else:
                    key = step_key(key, step, config, network=spec.network)
                    found, layer = await self.store.get_cached_step(owner, key)
                    if found and (layer is None or await self.store.touch_blob(layer["digest"])):
                        cached = True
                    else:
                        run = self._run(tenant, record.id, layers, config, spec, step)
                        async with contextlib.aclosing(run) as items:  # its sandbox goes
                            async for item in items:
                                if isinstance(item, str):
                                    out.add(item)
                                    yield {"event": "log", "index": index, "text": item}
                                else:
                                    layer = item.get("layer")
                        await self.store.put_cached_step(owner, key, layer)
                if layer is not None:
                    layers.append(layer)
                seconds = round(time.monotonic() - began, 3)
                out.add(f"#{index} {'CACHED' if cached else 'DONE'} {seconds} s\n")
                yield {
                    "event": "step_done",
                    "index": index,
                    "cached": cached,
                    "layer": layer["digest"] if layer else None,
                    "seconds": seconds,
                }
            image = {
                "layers": layers,
                "env": config.env,
                "workdir": config.workdir,
                "user": config.user,
                "cmd": list(spec.cmd) if spec.cmd is not None else list(config.cmd),
            }
            await self.templates.verify_layers(layers)
            await self.templates.check_quota(owner, name, sum(int(x["size"]) for x in layers))
            template = TemplateRecord(
                owner=owner,
                name=name,
                digest=image_digest(image),
                source="build",
                image=image,
                size=sum(int(x["size"]) for x in layers),
                created_at=utcnow(),
            )
            await self.store.put_template(template)
            await self.store.update_build(
                record.id,
                state="succeeded",
                log=out.text,
                error=None,
                digest=template.digest,
                finished_at=utcnow(),
            )
            log.info("template.built", extra={"template": name, "build": record.id})
            yield {"event": "done", "template": template}
        except BaseException as exc:
            if isinstance(exc, SandgateError):
                message = exc.message
            elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
                message = "cancelled: the client went away"
            else:
                log.exception("template.build_failed", extra={"build": record.id})
                message = f"internal error: {type(exc).__name__}"
            out.add(f"#{index} ERROR {message}\n")
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self.store.update_build(
                        record.id,
                        state="failed",
                        log=out.text,
                        error=message,
                        digest=None,
                        finished_at=utcnow(),
                    )
                )
            if isinstance(exc, SandgateError):
                yield {"event": "error", "step": index, "message": message, "build": record.id}
                return
            raise

    async def _run(
        self,
        tenant: TenantId,
        build_id: str,
        layers: list[dict[str, Any]],
        config: Config,
        spec: BuildSpec,
        step: Step,
    ) -> AsyncGenerator[str | dict[str, Any], None]:
        """Run a `run` step in a fresh sandbox of `layers`: its output as str items, then
        {"layer": the layer it made, or None when it changed nothing}."""
        image = {
            "layers": layers,
            "env": config.env,
            "workdir": config.workdir,
            "user": config.user,
            "cmd": [],
        }
        image["digest"] = image_digest(image)
        resources = caps.resolve(dict(spec.resources), self.settings.caps)
        request = CreateRequest(
            template=f"build-step:{build_id[:12]}",
            timeout=step.timeout + STEP_SANDBOX_GRACE,
            metadata={"sandgate-build": build_id},
            env={},
            network=spec.network,
            resources=resources,
            body={"build": build_id, "step": step.canonical()},
            pool=False,
            image=image,
        )
        creating = asyncio.ensure_future(self.creates.create(tenant, request, None))
        try:  # a build cancelled while its step's sandbox starts still deletes that sandbox
            sandbox = (await asyncio.shield(creating)).sandbox
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                made = await creating
                await asyncio.shield(self.sandboxes.delete(tenant, made.sandbox.name))
            raise
        try:
            command = step.run
            if config.workdir:
                where = shlex.quote(config.workdir)
                command = f"mkdir -p {where} && cd {where} && {command}"
            pid = await self.toolbox.start_process(
                tenant,
                sandbox.name,
                ["/bin/sh", "-c", command],
                cwd=None,
                env={},
                time_limit=step.timeout,
                stdin=False,
            )
            offset = 0
            while True:
                page = await self.toolbox.process_output(
                    tenant, sandbox.name, pid, offset, wait=OUTPUT_WAIT, linger=0.05
                )
                for chunk in page.chunks:
                    yield decode_output(chunk.data, False)
                offset = page.next_offset
                if page.exited:
                    break
            if page.exit_code != 0:
                raise BuildStepFailed(
                    f"the step exited with code {page.exit_code}: {step.describe()}"
                )
            exported = await self.toolbox.export_root(tenant, sandbox.name)
            if exported.entries == 0:
                yield {"layer": None}
                return
            path = await self._pull(tenant, sandbox.name, exported.digest, exported.size)
            try:
                await self.templates.store_file_layer(
                    path, ArchiveLayer(None, exported.digest, exported.size, "tar")
                )
            finally:
                _unlink(path)
            yield {"layer": {"digest": exported.digest, "size": exported.size, "media": "tar"}}
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.sandboxes.delete(tenant, sandbox.name))

    async def _pull(self, tenant: TenantId, name: str, digest: str, size: int) -> Path:
        """The exported layer, read from the worker into a temporary file, its digest checked."""
        fd, raw = tempfile.mkstemp(prefix="sandgate-layer-", suffix=".tar")
        path = Path(raw)
        hasher = hashlib.sha256()
        got = 0
        try:
            with os.fdopen(fd, "wb") as f:
                while got < size:
                    chunk = await self.toolbox.exported_chunk(tenant, name, got)
                    if not chunk:
                        break
                    hasher.update(chunk)
                    got += len(chunk)
                    await asyncio.to_thread(f.write, chunk)
            if got != size or "sha256:" + hasher.hexdigest() != digest:
                raise WorkerError(
                    f"the step's layer arrived as {got} bytes, not {size} of {digest}"
                )
        except BaseException:
            _unlink(path)
            raise
        return path

    async def _copy_layer(self, step: Step, context: Path) -> tuple[dict[str, Any], bool]:
        """The layer of a copy step, made from the build context: (layer, already stored)."""
        fd, raw = tempfile.mkstemp(prefix="sandgate-copy-", suffix=".tar")
        os.close(fd)
        path = Path(raw)
        try:
            digest, size = await asyncio.to_thread(copy_layer, context, step, path)
            stored = await self.store.blob_complete(digest)
            if not stored:
                await self.templates.store_file_layer(path, ArchiveLayer(None, digest, size, "tar"))
        finally:
            _unlink(path)
        return {"digest": digest, "size": size, "media": "tar"}, stored


class BuildStepFailed(InvalidRequestError):
    """A build step's command failed: its output is in the build's log."""

    code = "build_step_failed"


def _unlink(path: Path) -> None:
    """Remove a temporary file at once, not in a thread: a cancelled build still does it
    (an await in its cleanup could itself be cancelled)."""
    path.unlink(missing_ok=True)


def check_context(context: Path) -> None:
    """The build context is a tar whose members follow the layer rules (read through once:
    a bad context is refused before any step runs)."""
    tally = Tally(max_unpacked(context.stat().st_size, True))
    try:
        with tarfile.open(context, "r:*") as tar:
            for member in tar:
                tally.add(member)
    except LayerRuleError as exc:
        raise BuildSpecError(f"the build context: {exc.message}") from None
    except (OSError, EOFError, tarfile.TarError, zlib.error, ValueError, OverflowError) as exc:
        raise BuildSpecError(f"the build context is not a readable tar: {exc}") from None


def copy_layer(context: Path, step: Step, out: Path) -> tuple[str, int]:
    """Write the layer that puts the context's `step.source` at `step.to` (directories
    created, owners root, times zeroed: the same files give the same layer)."""
    with tarfile.open(context, "r:*") as source:
        members = sorted(source.getmembers(), key=lambda m: m.name)
        wanted = step.source.strip("/")
        picked = [
            m
            for m in members
            if wanted in (".", "")
            or m.name.strip("/").removeprefix("./") == wanted
            or m.name.strip("/").removeprefix("./").startswith(wanted + "/")
        ]
        if not picked:
            raise BuildSpecError(f"copy {step.source!r}: not in the build context")
        single = len(picked) == 1 and picked[0].isfile()
        target = step.to.strip("/")
        if single and step.to.endswith("/"):
            target = posixpath.join(target, posixpath.basename(wanted))
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as layer:
            parts = target.split("/") if target else []
            for depth in range(1, len(parts) + (0 if single else 1)):
                info = tarfile.TarInfo("/".join(parts[:depth]))
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                layer.addfile(info)
            for member in picked:
                name = member.name.strip("/").removeprefix("./")
                rest = "" if wanted in (".", "") else name[len(wanted) :].lstrip("/")
                if single:
                    rest = ""
                new_name = posixpath.join(target, rest) if rest else target
                if not new_name:
                    continue
                info = tarfile.TarInfo(new_name)
                info.mode = member.mode & 0o1777
                info.mtime = 0
                if member.isdir():
                    info.type = tarfile.DIRTYPE
                    layer.addfile(info)
                elif member.issym():
                    info.type, info.linkname = tarfile.SYMTYPE, member.linkname
                    layer.addfile(info)
                elif member.isfile():
                    info.size = member.size
                    layer.addfile(info, source.extractfile(member))
    return file_digest(out)
