"""E2B's gzip uploads are inflated a bounded piece at a time (`api/e2b/files._gunzip`): a
small piece of gzip that stands for a thousand times its size (a "bomb") made all of it in
one call, the server's memory at the mercy of a tenant's body."""

from __future__ import annotations

import asyncio
import gzip
import os
from collections.abc import AsyncIterator

import pytest

from sandgate.api.e2b.files import GUNZIP_PIECE, _gunzip
from sandgate.errors import InvalidRequestError


def inflated(pieces: list[bytes]) -> list[bytes]:
    async def body() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    async def gather() -> list[bytes]:
        return [out async for out in _gunzip(body())]

    return asyncio.run(gather())


def test_a_bomb_comes_out_a_bounded_piece_at_a_time() -> None:
    bomb = gzip.compress(bytes(64 << 20))  # ~64 KiB of gzip
    assert len(bomb) < 100 << 10
    out = inflated([bomb])
    assert max(len(piece) for piece in out) <= GUNZIP_PIECE
    assert sum(len(piece) for piece in out) == 64 << 20


def test_pieces_of_any_size_inflate_to_the_body() -> None:
    data = os.urandom(300_000) + bytes(3 << 20)
    packed = gzip.compress(data)
    pieces = [packed[i : i + 4096] for i in range(0, len(packed), 4096)]
    assert b"".join(inflated(pieces)) == data


def test_a_corrupt_body_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        inflated([b"\x1f\x8b" + os.urandom(100)])
