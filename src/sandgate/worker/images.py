"""The worker's cache of image layers: fetched from the control plane by digest, verified,
unpacked once, shared by every sandbox started from an image that has them.

``<store>/<hex>`` is the layer unpacked (`layers.py`), present only once complete: a layer
is fetched into ``<store>/.incoming/``, its bytes hashed as they arrive, unpacked beside,
and renamed into place only if the digest matches. A crash leaves at most ``.incoming``,
emptied at the next start. Two sandboxes that need the same missing layer wait for one
fetch (`WorkerLocalState.layer_fetches`).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sandgate.agent import entries
from sandgate.core.layer_rules import max_unpacked
from sandgate.errors import WorkerError
from sandgate.worker import layers
from sandgate.worker.layers import layer_name
from sandgate.worker.runtime.base import LayerRef

log = logging.getLogger(__name__)

# (digest, offset) -> the blob's bytes from offset (empty at its end)
FetchChunk = Callable[[str, int], Awaitable[bytes]]
INCOMING = ".incoming"


class LayerCache:
    def __init__(self, store: Path, fetches: dict[str, asyncio.Task[None]]) -> None:
        self.store = store
        self._fetches = fetches  # WorkerLocalState.layer_fetches

    def prepare(self) -> None:
        """Once at worker start: the store exists (root only) and holds no partial fetch."""
        self.store.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.store, 0o700)
        shutil.rmtree(self.store / INCOMING, ignore_errors=True)

    def has(self, layer: LayerRef) -> bool:
        return (self.store / layer_name(layer.digest)).is_dir()

    async def ensure(self, wanted: tuple[LayerRef, ...], fetch: FetchChunk | None) -> list[str]:
        """The store names of `wanted` (bottom first), fetching what is missing."""
        names = [layer_name(layer.digest) for layer in wanted]
        for layer in wanted:
            if self.has(layer):
                continue
            if fetch is None:
                raise WorkerError(
                    "this worker has no tunnel to fetch the image's layers from; retry"
                )
            task = self._fetches.get(layer.digest)
            if task is None:
                task = asyncio.ensure_future(self._fetch(layer, fetch))
                self._fetches[layer.digest] = task
                task.add_done_callback(self._forget_fetch(layer.digest))
            await asyncio.shield(task)  # one caller leaving does not abandon it for others
        return names

    def _forget_fetch(self, digest: str) -> Callable[[asyncio.Task[None]], None]:
        def forget(_task: asyncio.Task[None]) -> None:
            self._fetches.pop(digest, None)

        return forget

    async def _fetch(self, layer: LayerRef, fetch: FetchChunk) -> None:
        name = layer_name(layer.digest)
        incoming = self.store / INCOMING
        await asyncio.to_thread(incoming.mkdir, mode=0o700, exist_ok=True)
        blob = incoming / f"{name}.blob"
        unpacked = incoming / name
        began = time.monotonic()
        try:
            await self._download(layer, fetch, blob)
            stats = await asyncio.to_thread(_unpack_blob, blob, unpacked, layer.media)
            await asyncio.to_thread(os.rename, unpacked, self.store / name)
        finally:
            await asyncio.to_thread(_discard, blob, unpacked)
        log.info(
            "image.layer_fetched",
            extra={
                "layer": layer.digest,
                "bytes": layer.size,
                "files": stats.files,
                "seconds": round(time.monotonic() - began, 3),
            },
        )

    async def _download(self, layer: LayerRef, fetch: FetchChunk, blob: Path) -> None:
        digest = hashlib.sha256()
        size = 0
        fd = await asyncio.to_thread(
            os.open, blob, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600
        )
        try:
            while True:
                chunk = await fetch(layer.digest, size)
                if not chunk:
                    break
                digest.update(chunk)
                size += len(chunk)
                if size > layer.size:
                    break
                await asyncio.to_thread(entries.write_all, fd, chunk)
        finally:
            os.close(fd)
        got = "sha256:" + digest.hexdigest()
        if size != layer.size or got != layer.digest:
            raise WorkerError(
                f"layer {layer.digest} arrived as {size} bytes with digest {got} "
                f"(want {layer.size} bytes): not used"
            )


def _unpack_blob(blob: Path, dest: Path, media: str) -> layers.UnpackStats:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(mode=0o755)
    compressed = media == "tar+gzip"
    cap = max_unpacked(blob.stat().st_size, compressed)
    with open(blob, "rb") as raw:
        if compressed:
            with gzip.GzipFile(fileobj=raw) as stream:
                return layers.unpack(stream, dest, max_bytes=cap)  # type: ignore[arg-type]
        return layers.unpack(raw, dest, max_bytes=cap)


def _discard(blob: Path, unpacked: Path) -> None:
    blob.unlink(missing_ok=True)
    shutil.rmtree(unpacked, ignore_errors=True)
