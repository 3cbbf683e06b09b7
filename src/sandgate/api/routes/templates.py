"""`/api/v1/templates`: the root file systems sandboxes start from (control/templates.py).

`POST /api/v1/templates?name=NAME` takes an archive as the request body, streamed to a
temporary file first (an OCI image layout or `docker save` tarball, or a root file system
as tar or tar.gz): every digest is checked before anything is stored, and the answer is
the template. A tenant key manages its own templates and reads the public ones; an admin
key manages the public ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response

from sandgate.api.deps import Services, Viewer, services, viewer
from sandgate.api.routes.sandboxes import error_docs
from sandgate.api.schemas import TemplateOut
from sandgate.errors import PayloadTooLargeError
from sandgate.store.base import PUBLIC_OWNER, TemplateRecord

router = APIRouter(prefix="/api/v1/templates", tags=["templates"])

Svc = Annotated[Services, Depends(services)]
Who = Annotated[Viewer, Depends(viewer)]
NameQuery = Annotated[str, Query(min_length=1, max_length=63, description="the template's name")]


def template_out(record: TemplateRecord) -> dict[str, Any]:
    image = record.image
    return {
        "name": record.name,
        "public": record.owner == PUBLIC_OWNER,
        "digest": record.digest,
        "source": record.source,
        "size": record.size,
        "layers": len(image.get("layers") or []),
        "env": image.get("env") or {},
        "workdir": image.get("workdir") or "",
        "user": image.get("user") or "",
        "cmd": image.get("cmd") or [],
        "created_at": record.created_at,
    }


@router.post("", status_code=201, response_model=TemplateOut, responses=error_docs())
async def import_template(name: NameQuery, request: Request, who: Who, svc: Svc) -> Any:
    """Import an image archive (the body) as template `name`, replacing one of that name."""
    limit = svc.settings.max_template_bytes
    fd, raw_path = tempfile.mkstemp(prefix="sandgate-template-", suffix=".tar")
    path = Path(raw_path)
    try:
        received = 0
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit:
                    raise PayloadTooLargeError(
                        f"the archive is over {limit} bytes (--max-template-bytes)"
                    )
                await asyncio.to_thread(out.write, chunk)
        record = await svc.templates.import_archive(who.tenant, name, path)
    finally:
        await asyncio.to_thread(_discard, path)
    return template_out(record)


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


@router.get("", response_model=list[TemplateOut], responses=error_docs())
async def list_templates(who: Who, svc: Svc) -> Any:
    return [template_out(r) for r in await svc.templates.list(who.tenant)]


@router.get("/{name}", response_model=TemplateOut, responses=error_docs())
async def get_template(name: str, who: Who, svc: Svc) -> Any:
    return template_out(await svc.templates.get(who.tenant, name))


@router.delete("/{name}", status_code=204, responses=error_docs())
async def delete_template(name: str, who: Who, svc: Svc) -> Response:
    await svc.templates.delete(who.tenant, name)
    return Response(status_code=204)
