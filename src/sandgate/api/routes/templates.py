"""`/api/v1/templates`: the root file systems sandboxes start from (control/templates.py),
imported from archives or built from steps (control/builds.py).

`POST /api/v1/templates?name=NAME` takes an archive as the request body, streamed to a
temporary file first (an OCI image layout or `docker save` tarball, or a root file system
as tar or tar.gz): every digest is checked before anything is stored, and the answer is
the template. A tenant key manages its own templates and reads the public ones; an admin
key manages the public ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from sandgate.api.deps import Services, Viewer, services, viewer
from sandgate.api.responses import JSON_BODY, VIEWER, error_docs
from sandgate.api.schemas import BuildOut, TemplateOut
from sandgate.core import build_spec
from sandgate.errors import InvalidRequestError, PayloadTooLargeError
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


BUILD_TYPES = ("application/json", "multipart/form-data")


@router.post(
    "",
    status_code=201,
    response_model=TemplateOut,
    # a bad archive or build document (400), an unknown base (404), a built-in's name (409),
    # too many or too large templates (429)
    responses={
        **error_docs(VIEWER, JSON_BODY, 404, 409),
        200: {"content": {"application/x-ndjson": {}}},
    },
)
async def create_template(name: NameQuery, request: Request, who: Who, svc: Svc) -> Any:
    """Make template `name` (replacing one of that name).

    - An image archive as the body (any other content type): imported; answers 201 with the
      template.
    - A build: `application/json` (the build document), or `multipart/form-data` with a
      `build` field (the document, JSON) and a `context` file (a tar of the files its copy
      steps name). Answers 200 with the build's events as NDJSON, as they happen: `build`
      {id, steps}, `step`, `log` {text}, `step_done` {cached, layer}, then `done`
      {template} or `error` {message, step, build}. A bad document, an unknown base or a
      build without a tenant key is refused before anything runs (4xx).
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in BUILD_TYPES:
        return await _build(name, request, content_type, who, svc)
    return await _import(name, request, who, svc)


async def _build(name: str, request: Request, content_type: str, who: Viewer, svc: Services) -> Any:
    context: Path | None = None
    if content_type == "application/json":
        raw = await _bounded_body(request, svc.settings.max_json_bytes)
        spec = build_spec.parse(_json_document(raw))
    else:
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit():
            raise InvalidRequestError("a multipart build needs a Content-Length")
        if int(declared) > svc.settings.max_template_bytes:
            raise PayloadTooLargeError(
                f"the build's context is over {svc.settings.max_template_bytes} bytes"
            )
        form = await request.form(max_files=1, max_fields=4)
        try:
            field = form.get("build")
            if not isinstance(field, str):
                raise InvalidRequestError("a multipart build needs a 'build' field (the document)")
            spec = build_spec.parse(_json_document(field.encode()))  # before any copy is made
            upload = form.get("context")
            if upload is not None and not isinstance(upload, str):
                context = await asyncio.to_thread(_spool, upload.file)
        finally:
            await form.close()
    try:
        events = svc.builds.build(who.tenant, name, spec, context)
        first = await anext(events)  # refusals before anything ran are plain 4xx answers
    except BaseException:
        if context is not None:
            _discard(context)
        raise
    return StreamingResponse(_stream(first, events, context), media_type="application/x-ndjson")


HEARTBEAT_SECONDS = 15.0  # a build that says nothing this long sends a heartbeat line


async def _stream(
    first: dict[str, Any], events: AsyncGenerator[dict[str, Any], None], context: Path | None
) -> AsyncIterator[bytes]:
    """The build's events as NDJSON lines, with a `heartbeat` line whenever a step is quiet
    (so neither a client's read timeout nor a proxy's idle timeout cuts a long step). The
    build runs in a task of its own feeding a queue: the client leaving cancels it."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=64)

    async def produce() -> None:
        try:
            async for event in events:
                await queue.put(event)
        finally:
            await events.aclose()
            await queue.put(None)

    producer = asyncio.ensure_future(produce())
    try:
        yield _line(first)
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), HEARTBEAT_SECONDS)
            except TimeoutError:
                yield _line({"event": "heartbeat"})
                continue
            if event is None:
                break
            yield _line(event)
        await producer  # its failure, if any, is the response's
    finally:
        if not producer.done():
            producer.cancel()
            with contextlib.suppress(BaseException):
                await producer
        if context is not None:
            _discard(context)


@router.get("/builds/{build_id}", response_model=BuildOut, responses=error_docs(VIEWER, 404))
async def get_build(build_id: str, who: Who, svc: Svc) -> Any:
    """A build's record: its state, its whole log (the last 1 MiB), its error."""
    return asdict(await svc.builds.get(who.tenant, build_id))  # BuildOut leaves out its owner


def _shown(record: TemplateRecord) -> dict[str, Any]:
    """A template as every answer shows it (the response model's JSON)."""
    return TemplateOut(**template_out(record)).model_dump(mode="json")


def _line(event: dict[str, Any]) -> bytes:
    template = event.get("template")
    if isinstance(template, TemplateRecord):
        event = {**event, "template": _shown(template)}
    return json.dumps(event).encode() + b"\n"


def _json_document(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the build document is not JSON: {exc}") from None


async def _bounded_body(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLargeError(f"the build document is over {limit} bytes")
    return bytes(body)


def _spool(source: IO[bytes]) -> Path:
    fd, raw = tempfile.mkstemp(prefix="sandgate-context-", suffix=".tar")
    with os.fdopen(fd, "wb") as out:
        source.seek(0)
        shutil.copyfileobj(source, out, 1 << 20)
    return Path(raw)


async def _import(name: str, request: Request, who: Viewer, svc: Services) -> Any:
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
    return JSONResponse(_shown(record), status_code=201)


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


@router.get("", response_model=list[TemplateOut], responses=error_docs(VIEWER))
async def list_templates(who: Who, svc: Svc) -> Any:
    return [template_out(r) for r in await svc.templates.list(who.tenant)]


@router.get("/{name}", response_model=TemplateOut, responses=error_docs(VIEWER, 404))
async def get_template(name: str, who: Who, svc: Svc) -> Any:
    return template_out(await svc.templates.get(who.tenant, name))


@router.delete("/{name}", status_code=204, responses=error_docs(VIEWER, 404))
async def delete_template(name: str, who: Who, svc: Svc) -> Response:
    await svc.templates.delete(who.tenant, name)
    return Response(status_code=204)
