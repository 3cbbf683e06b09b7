"""`control/transfers.py`'s Chunker: a body's pieces, of any sizes, come out as chunks of
exactly the chunk size (the last one shorter), holding the body's bytes in order."""

from __future__ import annotations

import random

import pytest

from sandgate.control.transfers import Chunker


@pytest.mark.parametrize("seed", range(20))
def test_pieces_of_any_size_make_exact_chunks_in_order(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.choice([1, 7, 64, 1000])
    body = rng.randbytes(rng.randrange(0, 5000))
    chunker, chunks, at = Chunker(size), [], 0
    while at < len(body):
        step = rng.choice([0, 1, size - 1, size, size + 1, rng.randrange(1, 3 * size + 2)])
        chunker.add(body[at : at + step])
        at += step
        while (chunk := chunker.full()) is not None:
            chunks.append(chunk)
        assert chunker.held < size
    last = chunker.rest()
    assert chunker.held == 0 and chunker.rest() == b""
    assert all(len(chunk) == size for chunk in chunks) and len(last) < size
    assert b"".join([*chunks, last]) == body


def test_a_piece_that_is_a_whole_chunk_is_not_copied() -> None:
    piece = bytes(range(256)) * 4
    chunker = Chunker(len(piece))
    chunker.add(piece)
    assert chunker.full() is piece
