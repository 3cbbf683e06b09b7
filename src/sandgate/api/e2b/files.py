"""envd's plain-HTTP endpoints: `GET /files` (download), `POST /files` (upload), `/health`.

Uploads stream: a multipart body is parsed as it arrives (python-multipart's push parser),
each part's bytes fed to `Toolbox.upload` through a small bounded queue, so no hop holds a
whole file; several `file` parts (E2B's `write_files`) are written one after the other, each
to its part's filename, directories included. An `application/octet-stream` body (optionally
`Content-Encoding: gzip`) is one file at `?path=`. Errors answer `{"code", "message"}` with
the statuses E2B's SDK maps (400, 401, 404, 502, 507...).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sandgate.api.deps import Services
from sandgate.api.e2b.caller import EnvdCaller, sandbox_path
from sandgate.api.routes.files import file_response
from sandgate.control.replies import Entry
from sandgate.errors import InvalidRequestError

QUEUE_CHUNKS = 8  # chunks a part may run ahead of its upload (backpressure beyond)
GUNZIP_PIECE = 1 << 20  # the most a gzip body is inflated to at a time


async def download(request: Request, svc: Services, who: EnvdCaller) -> Response:
    path = request.query_params.get("path")
    if not path:
        raise InvalidRequestError("path is required")
    opened = await svc.toolbox.download(
        who.tenant, who.sandbox, sandbox_path(path), chunk_bytes=svc.settings.file_chunk_bytes
    )
    return file_response(opened, {})


async def upload(request: Request, svc: Services, who: EnvdCaller) -> Response:
    path = request.query_params.get("path")
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    if content_type == b"multipart/form-data":
        boundary = options.get(b"boundary")
        if not boundary:
            raise InvalidRequestError("multipart/form-data without a boundary")
        written = await _multipart(request, svc, who, boundary, path)
    else:
        if not path:
            raise InvalidRequestError("path is required for a raw upload (or send multipart)")
        declared = request.headers.get("content-length", "")
        body: AsyncIterator[bytes] = request.stream()
        if request.headers.get("content-encoding", "").lower() == "gzip":
            body, declared = _gunzip(body), ""
        entry = await _write(svc, who, path, body, int(declared) if declared.isdigit() else None)
        written = [entry]
    if not written:
        raise InvalidRequestError("the multipart body has no file part")
    return JSONResponse([{"name": e.name, "type": "file", "path": e.path} for e in written])


async def _write(
    svc: Services, who: EnvdCaller, path: str, data: AsyncIterator[bytes], size: int | None
) -> Entry:
    return await svc.toolbox.upload(
        who.tenant,
        who.sandbox,
        sandbox_path(path),
        data,
        chunk_bytes=svc.settings.file_chunk_bytes,
        max_bytes=svc.settings.max_upload_bytes,
        declared_size=size,
    )


async def _gunzip(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The body inflated, at most GUNZIP_PIECE bytes at a time: a small piece of gzip can
    stand for a thousand times its size, which must never be made in one go."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for piece in body:
            while piece:
                if out := inflate.decompress(piece, GUNZIP_PIECE):
                    yield out
                piece = inflate.unconsumed_tail
        if tail := inflate.flush():
            yield tail
    except zlib.error:
        raise InvalidRequestError("the gzip body is corrupt") from None


class _Part:
    """One file part being written: its bytes go through `queue` to its upload task."""

    def __init__(self, task: asyncio.Task[Entry], queue: asyncio.Queue[bytes | None]) -> None:
        self.task = task
        self.queue = queue


async def _multipart(
    request: Request, svc: Services, who: EnvdCaller, boundary: bytes, path: str | None
) -> list[Entry]:
    events: list[tuple[str, bytes]] = []
    header: dict[str, bytearray] = {"field": bytearray(), "value": bytearray()}
    headers: dict[bytes, bytes] = {}

    def on(kind: str) -> Callable[..., None]:
        def record(data: bytes | None = None, start: int = 0, end: int = 0) -> None:
            events.append((kind, b"" if data is None else bytes(data[start:end])))

        return record

    def on_header_end() -> None:
        headers[bytes(header["field"]).lower()] = bytes(header["value"])
        header["field"].clear()
        header["value"].clear()

    def on_header(part: str) -> Callable[[bytes, int, int], None]:
        def record(data: bytes, start: int, end: int) -> None:
            header[part] += data[start:end]

        return record

    callbacks: Any = {
        "on_part_begin": lambda: headers.clear(),
        "on_header_field": on_header("field"),
        "on_header_value": on_header("value"),
        "on_header_end": on_header_end,
        "on_headers_finished": lambda: events.append(("headers", _destination(headers))),
        "on_part_data": on("data"),
        "on_part_end": on("end"),
    }
    parser = MultipartParser(boundary, callbacks)
    written: list[Entry] = []
    part: _Part | None = None
    try:
        async for chunk in request.stream():
            try:
                parser.write(chunk)
            except Exception as exc:  # python-multipart's errors: the body is malformed
                raise InvalidRequestError(f"malformed multipart body: {exc}") from None
            for kind, data in events:
                if kind == "headers":
                    target = path if path and not written and part is None else None
                    destination = target or data.decode(errors="replace")
                    if not destination:
                        raise InvalidRequestError("a file part has no filename and no ?path=")
                    queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_CHUNKS)
                    task = asyncio.create_task(_write(svc, who, destination, _drain(queue), None))
                    part = _Part(task, queue)
                elif kind == "data" and part is not None and data:
                    await _put(part, data)
                elif kind == "end" and part is not None:
                    await _put(part, None)
                    written.append(await part.task)
                    part = None
            events.clear()
        parser.finalize()
        if part is not None:
            raise InvalidRequestError("the multipart body ended inside a part")
    finally:
        if part is not None and not part.task.done():
            part.task.cancel()  # the upload discards its partial file
            with contextlib.suppress(BaseException):
                await part.task
    return written


async def _put(part: _Part, data: bytes | None) -> None:
    """Hand a chunk to the part's upload; if the upload failed, its error is the answer."""
    put = asyncio.ensure_future(part.queue.put(data))
    done, _ = await asyncio.wait({put, part.task}, return_when=asyncio.FIRST_COMPLETED)
    if put not in done:
        put.cancel()
        part.task.result()  # raises the upload's error
        raise InvalidRequestError("the upload ended before its data did")


async def _drain(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    while (piece := await queue.get()) is not None:
        yield piece


def _destination(headers: dict[bytes, bytes]) -> bytes:
    """The part's filename (the full path, as E2B's SDK sends it), or b"" if none."""
    _, options = parse_options_header(headers.get(b"content-disposition", b""))
    filename = options.get(b"filename", b"")
    return filename if posixpath.basename(filename.decode(errors="replace")) else b""
