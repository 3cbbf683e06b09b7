"""Templates and the content-addressed blobs of their layers.

A blob is written in `BLOB_CHUNK` pieces, each its own short statement (a large layer never
holds one transaction open), then marked complete; only complete blobs are read. Its bytes
were verified against the digest before the first chunk is written, so two instances storing
the same blob write the same chunks: inserts that find a chunk there skip it.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import bindparam, delete, func, insert, select, update

from sandgate.core.clock import utcnow
from sandgate.store.base import BuildRecord, TemplateRecord
from sandgate.store.ops import store_op
from sandgate.store.schema import blob_chunks, blobs, build_cache, template_builds, templates
from sandgate.store.sql.engine import Database, PerDialect, dialect_insert

BLOB_CHUNK: Final = 1 << 20
BLOB_GRACE: Final = timedelta(minutes=10)  # an unreferenced blob used more recently is kept

_SELECT_TEMPLATE = select(templates).where(
    templates.c.owner == bindparam("b_owner"), templates.c.name == bindparam("b_name")
)
_LIST_TEMPLATES = (
    select(templates)
    .where(templates.c.owner.in_(bindparam("b_owners", expanding=True)))
    .order_by(templates.c.name, templates.c.owner)
)
_DELETE_TEMPLATE = delete(templates).where(
    templates.c.owner == bindparam("b_owner"), templates.c.name == bindparam("b_name")
)
_SELECT_BLOB = select(blobs).where(blobs.c.digest == bindparam("b_digest"))
_COMPLETE_BLOB = update(blobs).where(blobs.c.digest == bindparam("b_digest")).values(complete=True)
_TOUCH_BLOB = (
    update(blobs).where(blobs.c.digest == bindparam("b_digest")).values(created_at=bindparam("now"))
)
_CHUNK_TOTALS = select(
    func.count(blob_chunks.c.seq), func.coalesce(func.sum(func.length(blob_chunks.c.data)), 0)
).where(blob_chunks.c.digest == bindparam("b_digest"))
_ORPHAN_CHUNKS = delete(blob_chunks).where(blob_chunks.c.digest.not_in(select(blobs.c.digest)))
_READ_CHUNKS = (
    select(blob_chunks.c.seq, blob_chunks.c.data)
    .where(
        blob_chunks.c.digest == bindparam("b_digest"),
        blob_chunks.c.seq >= bindparam("b_first"),
        blob_chunks.c.seq < bindparam("b_end"),
    )
    .order_by(blob_chunks.c.seq)
)
_ALL_IMAGES = select(templates.c.image)
_CACHED_LAYERS = select(build_cache.c.layer).where(build_cache.c.layer.is_not(None))
_SELECT_BUILD = select(template_builds).where(
    template_builds.c.owner == bindparam("b_owner"), template_builds.c.id == bindparam("b_id")
)
_UPDATE_BUILD = (
    update(template_builds)
    .where(template_builds.c.id == bindparam("b_id"))
    .values(
        state=bindparam("state"),
        log=bindparam("log"),
        error=bindparam("error"),
        digest=bindparam("digest"),
        finished_at=bindparam("finished_at"),
    )
)
_OWNER_BUILDS = (
    select(template_builds.c.id)
    .where(template_builds.c.owner == bindparam("b_owner"))
    .order_by(template_builds.c.created_at.desc())
    .offset(bindparam("b_keep"))
)
_DELETE_BUILD = delete(template_builds).where(template_builds.c.id == bindparam("b_id"))
_SELECT_CACHED = select(build_cache.c.layer).where(
    build_cache.c.owner == bindparam("b_owner"), build_cache.c.key == bindparam("b_key")
)
_OLD_BLOBS = select(blobs.c.digest).where(blobs.c.created_at < bindparam("b_before"))
_DELETE_CHUNKS = delete(blob_chunks).where(blob_chunks.c.digest == bindparam("b_digest"))
_DELETE_BLOB = delete(blobs).where(blobs.c.digest == bindparam("b_digest"))

_INSERT_BLOB: Final = PerDialect(
    lambda dialect: dialect_insert(dialect, blobs).on_conflict_do_nothing(
        index_elements=[blobs.c.digest]
    )
)
_INSERT_CHUNK: Final = PerDialect(
    lambda dialect: dialect_insert(dialect, blob_chunks).on_conflict_do_nothing(
        index_elements=[blob_chunks.c.digest, blob_chunks.c.seq]
    )
)
_INSERT_CACHED: Final = PerDialect(
    lambda dialect: dialect_insert(dialect, build_cache).on_conflict_do_nothing(
        index_elements=[build_cache.c.owner, build_cache.c.key]
    )
)
_UPSERT_TEMPLATE: Final = PerDialect(
    lambda dialect: (
        lambda stmt: stmt.on_conflict_do_update(
            index_elements=[templates.c.owner, templates.c.name],
            set_={
                "digest": stmt.excluded.digest,
                "source": stmt.excluded.source,
                "image": stmt.excluded.image,
                "size": stmt.excluded.size,
                "created_at": stmt.excluded.created_at,
            },
        )
    )(dialect_insert(dialect, templates))
)


def _record(row: object) -> TemplateRecord:
    return TemplateRecord(
        owner=row.owner,  # type: ignore[attr-defined]
        name=row.name,  # type: ignore[attr-defined]
        digest=row.digest,  # type: ignore[attr-defined]
        source=row.source,  # type: ignore[attr-defined]
        image=dict(row.image),  # type: ignore[attr-defined]
        size=int(row.size),  # type: ignore[attr-defined]
        created_at=row.created_at,  # type: ignore[attr-defined]
    )


def _build(row: object) -> BuildRecord:
    return BuildRecord(
        id=row.id,  # type: ignore[attr-defined]
        owner=row.owner,  # type: ignore[attr-defined]
        name=row.name,  # type: ignore[attr-defined]
        state=row.state,  # type: ignore[attr-defined]
        log=row.log,  # type: ignore[attr-defined]
        error=row.error,  # type: ignore[attr-defined]
        digest=row.digest,  # type: ignore[attr-defined]
        created_at=row.created_at,  # type: ignore[attr-defined]
        finished_at=row.finished_at,  # type: ignore[attr-defined]
    )


class Templates:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._insert_cached = _INSERT_CACHED.of(db)
        self._insert_blob = _INSERT_BLOB.of(db)
        self._insert_chunk = _INSERT_CHUNK.of(db)
        self._upsert_template = _UPSERT_TEMPLATE.of(db)

    @store_op
    async def blob_complete(self, digest: str) -> bool:
        row = await self._db.fetch_one(_SELECT_BLOB, {"b_digest": digest})
        return row is not None and bool(row.complete)

    @store_op
    async def begin_blob(self, digest: str, size: int) -> None:
        await self._db.write(
            self._insert_blob,
            {"digest": digest, "size": size, "complete": False, "created_at": utcnow()},
        )

    @store_op
    async def write_blob_chunk(self, digest: str, seq: int, data: bytes) -> None:
        await self._db.write(self._insert_chunk, {"digest": digest, "seq": seq, "data": data})

    @store_op
    async def complete_blob(self, digest: str, size: int) -> bool:
        """Mark the blob complete if its row is there and its chunks hold exactly `size`
        bytes; False when not (a sweep took it meanwhile: the caller writes it again)."""
        async with self._db.begin() as conn:
            row = (await conn.execute(_CHUNK_TOTALS, {"b_digest": digest})).first()
            count, total = (int(row[0]), int(row[1])) if row is not None else (0, 0)
            if total != size or count != (size + BLOB_CHUNK - 1) // BLOB_CHUNK:
                return False
            done = await conn.execute(_COMPLETE_BLOB, {"b_digest": digest})
            return bool(done.rowcount)

    @store_op
    async def touch_blob(self, digest: str) -> bool:
        """Mark a stored blob as used now (the sweep spares it for BLOB_GRACE); False if
        there is no such blob."""
        return await self._db.write(_TOUCH_BLOB, {"b_digest": digest, "now": utcnow()}) > 0

    @store_op
    async def read_blob(self, digest: str, offset: int, length: int) -> bytes | None:
        """Up to `length` bytes of a complete blob from `offset` (b"" past its end), or None
        if no complete blob has that digest."""
        row = await self._db.fetch_one(_SELECT_BLOB, {"b_digest": digest})
        if row is None or not row.complete:
            return None
        if offset >= row.size:
            return b""
        first = offset // BLOB_CHUNK
        end = (min(offset + length, row.size) + BLOB_CHUNK - 1) // BLOB_CHUNK
        found = await self._db.fetch_all(
            _READ_CHUNKS, {"b_digest": digest, "b_first": first, "b_end": end}
        )
        data = b"".join(bytes(chunk.data) for chunk in found)
        skip = offset - first * BLOB_CHUNK
        return data[skip : skip + length]

    @store_op
    async def put_template(self, record: TemplateRecord) -> None:
        """Record a template (replacing one of the same owner and name)."""
        await self._db.write(
            self._upsert_template,
            {
                "owner": record.owner,
                "name": record.name,
                "digest": record.digest,
                "source": record.source,
                "image": record.image,
                "size": record.size,
                "created_at": record.created_at,
            },
        )

    @store_op
    async def get_template(self, owner: str, name: str) -> TemplateRecord | None:
        row = await self._db.fetch_one(_SELECT_TEMPLATE, {"b_owner": owner, "b_name": name})
        return None if row is None else _record(row)

    @store_op
    async def list_templates(self, owners: list[str]) -> list[TemplateRecord]:
        return [_record(r) for r in await self._db.fetch_all(_LIST_TEMPLATES, {"b_owners": owners})]

    @store_op
    async def delete_template(self, owner: str, name: str) -> bool:
        return await self._db.write(_DELETE_TEMPLATE, {"b_owner": owner, "b_name": name}) > 0

    @store_op
    async def sweep_blobs(self, now: datetime) -> int:
        """Delete the blobs no template names that are older than BLOB_GRACE (a younger one
        may belong to an import still running); how many went."""
        used: set[str] = set()
        for row in await self._db.fetch_all(_ALL_IMAGES, {}):
            for layer in (row.image or {}).get("layers") or []:
                used.add(str(layer.get("digest")))
        for row in await self._db.fetch_all(_CACHED_LAYERS, {}):
            used.add(str((row.layer or {}).get("digest")))
        gone = 0
        for row in await self._db.fetch_all(_OLD_BLOBS, {"b_before": now - BLOB_GRACE}):
            if row.digest in used:
                continue
            async with self._db.begin() as conn:
                await conn.execute(_DELETE_BLOB, {"b_digest": row.digest})
                await conn.execute(_DELETE_CHUNKS, {"b_digest": row.digest})
            gone += 1
        await self._db.write(_ORPHAN_CHUNKS, {})  # chunks a write left after its row was swept
        return gone

    # -- builds -------------------------------------------------------------------------------
    @store_op
    async def insert_build(self, record: BuildRecord, *, keep: int) -> None:
        """Record a build starting; the owner's builds past the newest `keep` go."""
        async with self._db.begin() as conn:
            await conn.execute(insert(template_builds), asdict(record))
            old = await conn.execute(_OWNER_BUILDS, {"b_owner": record.owner, "b_keep": keep})
            for row in old.fetchall():
                await conn.execute(_DELETE_BUILD, {"b_id": row.id})

    @store_op
    async def update_build(
        self,
        build_id: str,
        *,
        state: str,
        log: str,
        error: str | None,
        digest: str | None,
        finished_at: datetime | None,
    ) -> None:
        await self._db.write(
            _UPDATE_BUILD,
            {
                "b_id": build_id,
                "state": state,
                "log": log,
                "error": error,
                "digest": digest,
                "finished_at": finished_at,
            },
        )

    @store_op
    async def get_build(self, owner: str, build_id: str) -> BuildRecord | None:
        row = await self._db.fetch_one(_SELECT_BUILD, {"b_owner": owner, "b_id": build_id})
        return None if row is None else _build(row)

    @store_op
    async def get_cached_step(self, owner: str, key: str) -> tuple[bool, dict[str, Any] | None]:
        """(found, the layer it made or None when it made none)."""
        row = await self._db.fetch_one(_SELECT_CACHED, {"b_owner": owner, "b_key": key})
        return (False, None) if row is None else (True, row.layer)

    @store_op
    async def put_cached_step(self, owner: str, key: str, layer: dict[str, Any] | None) -> None:
        await self._db.write(
            self._insert_cached,
            {"owner": owner, "key": key, "layer": layer, "created_at": utcnow()},
        )


__all__ = ("BLOB_CHUNK", "Templates")
