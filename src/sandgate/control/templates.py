"""Templates: the root file systems a sandbox may start from, and how a create finds one.

Built-in templates (`ServerSettings.templates`: ``default``, ``code-interpreter``) are the
host's own /usr, read-only, as before. Every other template is an image: layers stored once
per deployment as content-addressed blobs (store/sql/templates.py), plus its config. A
tenant's templates are its own; public ones (made with an admin key) are everyone's; a
tenant's own name shadows a public one, a built-in name is never shadowed.

An import checks the whole archive first (`image_archive.parse`: every digest against the
bytes), then stores each layer not stored yet, then records the template: a failure at any
point records nothing, and a blob left incomplete is never read and is swept.

Workers fetch the layers they lack over their tunnel (`blob` requests, `read_chunk`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sandgate.agent.frames import Header
from sandgate.config import ServerSettings
from sandgate.control import image_archive
from sandgate.control.image_archive import ArchiveLayer, ParsedArchive
from sandgate.core.clock import utcnow
from sandgate.errors import (
    ConflictError,
    InvalidRequestError,
    LimitExceededError,
    NotFoundError,
    StoreError,
)
from sandgate.store.base import PUBLIC_OWNER, Store, TemplateRecord, TenantId
from sandgate.store.sql.templates import BLOB_CHUNK

log = logging.getLogger(__name__)

BUILTIN_ALIASES = MappingProxyType({"base": "default"})  # E2B's name for the host root
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
MAX_CHUNK_READ = 4 << 20  # a worker's `blob` request gets at most this much


@dataclass(frozen=True)
class Resolved:
    """What a create's `template` names: a built-in (image None) or an image."""

    name: str
    image: dict[str, Any] | None  # the provision's `image` (worker/service.py `_image`)

    @property
    def size(self) -> int:
        return sum(int(x["size"]) for x in (self.image or {}).get("layers", []))


def _provisioned(record: TemplateRecord) -> dict[str, Any]:
    return {**record.image, "digest": record.digest}


def check_name(name: str) -> None:
    if not NAME_RE.fullmatch(name):
        raise InvalidRequestError(
            f"invalid template name {name!r}: use 1-63 of [a-z0-9._-], starting with a letter "
            "or digit"
        )


def image_of(parsed: ParsedArchive) -> dict[str, Any]:
    """The stored and provisioned form of an image: layers, bottom first, and its config."""
    config = parsed.config
    return {
        "layers": [{"digest": x.digest, "size": x.size, "media": x.media} for x in parsed.layers],
        "env": dict(config.env),
        "workdir": config.workdir,
        "user": config.user,
        "cmd": list(config.cmd),
    }


def image_digest(image: dict[str, Any]) -> str:
    """The template's content address: the same layers and config give the same digest."""
    canonical = json.dumps(image, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


class TemplateService:
    def __init__(self, store: Store, settings: ServerSettings) -> None:
        self.store = store
        self.settings = settings

    # -- resolving (every create) -----------------------------------------------------------
    async def resolve(self, tenant: TenantId, name: str) -> Resolved:
        name = BUILTIN_ALIASES.get(name, name)  # base: the default template's other name
        if name in self.settings.templates:
            # a built-in, unless the operator published an image under its name
            public = await self.store.get_template(PUBLIC_OWNER, name)
            return Resolved(name, None if public is None else _provisioned(public))
        record = await self.store.get_template(tenant, name)
        if record is None:
            record = await self.store.get_template(PUBLIC_OWNER, name)
        if record is None:
            known = ", ".join(self.settings.templates)
            raise NotFoundError(
                f"template {name!r} not found: import or build it (sandgate templates import "
                f"NAME FILE), or use a built-in ({known})",
                code="template_not_found",
            )
        return Resolved(name, _provisioned(record))

    async def public_image(self, name: str) -> dict[str, Any] | None:
        """What a worker's pool of `name` starts from: the public image of that name, None for
        a built-in not replaced by one; an unknown name is a NotFoundError."""
        record = await self.store.get_template(PUBLIC_OWNER, name)
        if record is not None:
            return _provisioned(record)
        if name in self.settings.templates:
            return None
        raise NotFoundError(f"no public template {name!r} to pool", code="template_not_found")

    # -- managing -----------------------------------------------------------------------------
    def owner_of(self, tenant: TenantId | None) -> str:
        return PUBLIC_OWNER if tenant is None else tenant

    async def list(self, tenant: TenantId | None) -> list[TemplateRecord]:
        owners = [PUBLIC_OWNER] if tenant is None else [tenant, PUBLIC_OWNER]
        return await self.store.list_templates(owners)

    async def get(self, tenant: TenantId | None, name: str) -> TemplateRecord:
        record = await self.store.get_template(self.owner_of(tenant), name)
        if record is None and tenant is not None:
            record = await self.store.get_template(PUBLIC_OWNER, name)
        if record is None:
            raise NotFoundError(f"template {name!r} not found", code="template_not_found")
        return record

    async def delete(self, tenant: TenantId | None, name: str) -> None:
        """Delete the caller's own template (sandboxes started from it keep running: their
        workers hold its layers); its blobs go once no template names them."""
        if not await self.store.delete_template(self.owner_of(tenant), name):
            raise NotFoundError(f"template {name!r} not found", code="template_not_found")
        await self._sweep()

    async def _sweep(self) -> None:
        """Delete the blobs no template names (what a delete or a failed import left)."""
        try:
            gone = await self.store.sweep_blobs(utcnow())
        except Exception:  # the next import or delete sweeps again
            log.exception("templates.sweep_failed")
        else:
            if gone:
                log.info("templates.blobs_swept", extra={"blobs": gone})

    def check_builtin(self, tenant: TenantId | None, name: str) -> None:
        """A built-in name is the operator's: an admin may publish an image under it (every
        create of that name then starts the image), a tenant may not take it."""
        if name in self.settings.templates and tenant is not None:
            raise ConflictError(
                f"{name!r} is a built-in template: choose another name (an operator may "
                "replace a built-in with a public image, using an admin key)"
            )

    async def check_quota(self, owner: str, name: str, size: int) -> None:
        """Refuse a template that would take its owner past the deployment's limits (the
        one it replaces does not count)."""
        held = [r for r in await self.store.list_templates([owner]) if r.name != name]
        limit = self.settings.max_templates
        if len(held) >= limit:
            raise LimitExceededError(
                f"you hold {len(held)} templates, the most this deployment keeps per tenant "
                f"(max_templates {limit}): delete one first",
                limit="max_templates",
                retry_after=0.0,
            )
        storage = self.settings.max_template_storage_bytes
        used = sum(r.size for r in held)
        if used + size > storage:
            raise LimitExceededError(
                f"the template's {size} bytes would take your templates to {used + size} "
                f"bytes, past this deployment's {storage} (max_template_storage_bytes): "
                "delete some first",
                limit="max_template_storage_bytes",
                retry_after=0.0,
            )

    async def import_archive(
        self, tenant: TenantId | None, name: str, path: Path
    ) -> TemplateRecord:
        """Record `name` (the caller's, or public for an admin) as the image in the archive
        at `path`, replacing a template of that name."""
        check_name(name)
        self.check_builtin(tenant, name)
        parsed = await asyncio.to_thread(image_archive.parse, path)
        await self.check_quota(self.owner_of(tenant), name, sum(x.size for x in parsed.layers))
        await self._sweep()
        for layer in parsed.layers:
            await self.store_file_layer(path, layer)
        image = image_of(parsed)
        for layer in parsed.layers:  # one a sweep took meanwhile is stored again
            if not await self.store.blob_complete(layer.digest):
                await self.store_file_layer(path, layer)
        record = TemplateRecord(
            owner=self.owner_of(tenant),
            name=name,
            digest=image_digest(image),
            source=parsed.kind,
            image=image,
            size=sum(x.size for x in parsed.layers),
            created_at=utcnow(),
        )
        await self.store.put_template(record)
        log.info(
            "template.imported",
            extra={
                "template": name,
                "owner": record.owner,
                "kind": parsed.kind,
                "layers": len(parsed.layers),
                "bytes": record.size,
            },
        )
        return record

    async def store_file_layer(self, path: Path, layer: ArchiveLayer) -> None:
        """Store a layer whose bytes were checked against its digest (an archive's member,
        or a whole file: a build step's) unless a complete blob already holds it (then it
        is marked used now, so no sweep takes it while the template is being recorded)."""
        for _attempt in range(3):
            if await self.store.blob_complete(layer.digest) and await self.store.touch_blob(
                layer.digest
            ):
                return
            await self.store.begin_blob(layer.digest, layer.size)
            await self.store.touch_blob(layer.digest)  # a row left by an earlier attempt
            stream, tar = await asyncio.to_thread(image_archive.open_layer, path, layer)
            try:
                seq = 0
                while chunk := await asyncio.to_thread(stream.read, BLOB_CHUNK):
                    await self.store.write_blob_chunk(layer.digest, seq, chunk)
                    seq += 1
            finally:
                stream.close()
                if tar is not None:
                    tar.close()
            if await self.store.complete_blob(layer.digest, layer.size):
                return
        raise StoreError(f"layer {layer.digest} could not be stored (swept while written)")

    async def verify_layers(self, layers: Sequence[dict[str, Any]]) -> None:
        """Every layer a template is about to name is still stored (and now marked used)."""
        for layer in layers:
            if not await self.store.touch_blob(str(layer["digest"])):
                raise StoreError(f"layer {layer['digest']} was removed meanwhile: try again")

    # -- workers' requests (over their tunnels) ------------------------------------------------
    async def answer_worker(self, header: Header, payload: bytes) -> tuple[Header, bytes]:
        """What a worker asks of the control plane: `template` (the image of a public
        template it pools) and `blob` (its image layers' bytes)."""
        op = header.get("op")
        if op == "template":
            name = header.get("name")
            if not isinstance(name, str):
                raise InvalidRequestError("template takes a name")
            return {"image": await self.public_image(name)}, b""
        if op == "blob":
            digest, offset = header.get("digest"), header.get("offset")
            if not isinstance(digest, str) or not isinstance(offset, int):
                raise InvalidRequestError("blob takes a digest (string) and an offset (integer)")
            return {}, await self.read_chunk(digest, offset)
        raise InvalidRequestError(f"unknown request {op!r} from a worker")

    async def read_chunk(self, digest: str, offset: int) -> bytes:
        if offset < 0:
            raise InvalidRequestError("offset must be >= 0")
        data = await self.store.read_blob(digest, offset, MAX_CHUNK_READ)
        if data is None:
            raise NotFoundError(f"blob {digest} is not stored (or not completely)")
        return data
