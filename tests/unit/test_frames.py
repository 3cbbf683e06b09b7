"""The frame codec: whole-message decode, incremental decode and blocking reads."""

from __future__ import annotations

import asyncio
import io
import random
from typing import BinaryIO, cast

import pytest

from sandgate.agent import frames
from sandgate.worker.agent_link import read_frame

SAMPLES: list[tuple[frames.Header, bytes]] = [
    ({"id": 1, "op": "ping"}, b""),
    ({"id": 2, "op": "write", "handle": 7}, bytes(range(256)) * 3),
    ({"event": "ready", "pid": 42, "version": 1}, b""),
    ({"id": 3, "ok": True, "stdout": "héllo ✓ \x00\n", "nested": {"a": [1, 2.5, None]}}, b"x"),
    ({"id": 4, "ok": False, "error": {"code": "not_found", "message": "nope"}}, b""),
]


def _stream() -> bytes:
    return b"".join(frames.encode(header, payload) for header, payload in SAMPLES)


@pytest.mark.parametrize(("header", "payload"), SAMPLES)
def test_encode_decode_round_trip(header: frames.Header, payload: bytes) -> None:
    assert frames.decode(frames.encode(header, payload)) == (header, payload)


def test_encoding_is_prefix_header_payload() -> None:
    data = frames.encode({"id": 1}, b"abc")
    hlen, plen = frames.PREFIX.unpack_from(data)
    assert (hlen, plen) == (len(b'{"id":1}'), 3)
    assert data[frames.PREFIX.size :] == b'{"id":1}abc'


async def _read_all(pieces: list[bytes]) -> list[tuple[frames.Header, bytes]]:
    """Frames read by the worker's reader (agent_link.read_frame) from a pipe that delivered
    `pieces`, then ended."""
    reader = asyncio.StreamReader()
    for piece in pieces:
        reader.feed_data(piece)
    reader.feed_eof()
    decoded = []
    while (frame := await read_frame(reader)) is not None:
        decoded.append(frame)
    return decoded


def test_reader_fed_byte_by_byte() -> None:
    data = _stream()
    assert asyncio.run(_read_all([data[i : i + 1] for i in range(len(data))])) == SAMPLES


@pytest.mark.parametrize("seed", range(20))
def test_reader_fed_in_arbitrary_splits(seed: int) -> None:
    data = _stream()
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 12)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert asyncio.run(_read_all(pieces)) == SAMPLES


def test_reader_whole_stream_at_once() -> None:
    assert asyncio.run(_read_all([_stream()])) == SAMPLES


def test_encode_rejects_oversize() -> None:
    with pytest.raises(frames.FrameError):
        frames.encode({"id": 1}, b"x" * (frames.MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(frames.FrameError):
        frames.encode({"id": 1, "blob": "x" * frames.MAX_HEADER_BYTES})


def test_payload_at_the_limit_is_fine() -> None:
    payload = b"y" * frames.MAX_PAYLOAD_BYTES
    assert frames.decode(frames.encode({"id": 1}, payload))[1] == payload


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\x00\x00",
        frames.PREFIX.pack(frames.MAX_HEADER_BYTES + 1, 0),
        frames.PREFIX.pack(2, frames.MAX_PAYLOAD_BYTES + 1) + b"{}",
        frames.PREFIX.pack(5, 0) + b"{}",  # shorter than its prefix says
        frames.PREFIX.pack(2, 0) + b"{}extra",  # longer than its prefix says
        frames.PREFIX.pack(3, 0) + b"{x}",  # not JSON
        frames.PREFIX.pack(2, 0) + b"[]",  # JSON but not an object
        frames.PREFIX.pack(2, 0) + b"\xff\xfe",  # not UTF-8
    ],
)
def test_decode_rejects_garbage(data: bytes) -> None:
    with pytest.raises(frames.FrameError):
        frames.decode(data)


@pytest.mark.parametrize(
    "data",
    [
        frames.PREFIX.pack(frames.MAX_HEADER_BYTES + 1, 0),
        frames.PREFIX.pack(2, frames.MAX_PAYLOAD_BYTES + 1),
        frames.PREFIX.pack(7, 0) + b"garbage",
        frames.PREFIX.pack(4, 0) + b"null",
    ],
)
def test_reader_rejects_garbage(data: bytes) -> None:
    with pytest.raises(frames.FrameError):
        asyncio.run(_read_all([data]))


def test_reader_rejects_a_frame_cut_short() -> None:
    whole = frames.encode({"id": 1}, b"payload")
    for cut in (3, frames.PREFIX.size + 2, len(whole) - 1):
        with pytest.raises(frames.FrameError, match="ended inside a frame"):
            asyncio.run(_read_all([whole[:cut]]))


def test_read_frame_sequence_then_eof() -> None:
    stream = io.BytesIO(_stream())
    assert [frames.read_frame(stream) for _ in SAMPLES] == SAMPLES
    assert frames.read_frame(stream) is None


def test_read_frame_at_eof_is_none() -> None:
    assert frames.read_frame(io.BytesIO(b"")) is None


@pytest.mark.parametrize("keep", [1, frames.PREFIX.size - 1, frames.PREFIX.size, -1])
def test_read_frame_eof_inside_a_frame(keep: int) -> None:
    data = frames.encode({"id": 1, "op": "write"}, b"payload")
    with pytest.raises(frames.FrameError):
        frames.read_frame(io.BytesIO(data[:keep]))


def test_read_frame_rejects_oversize_prefix() -> None:
    data = frames.PREFIX.pack(frames.MAX_HEADER_BYTES + 1, 0)
    with pytest.raises(frames.FrameError):
        frames.read_frame(io.BytesIO(data + b"x" * 16))


class _Trickle(io.RawIOBase):
    """A stream that returns at most 3 bytes per read, like a slow pipe."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._data.read(min(size, 3) if size >= 0 else 3)


def test_read_frame_from_short_reads() -> None:
    stream = cast(BinaryIO, _Trickle(_stream()))
    assert [frames.read_frame(stream) for _ in SAMPLES] == SAMPLES
    assert frames.read_frame(stream) is None


def test_error_header() -> None:
    assert frames.error_header(None, "invalid_request", "bad") == {
        "id": None,
        "ok": False,
        "error": {"code": "invalid_request", "message": "bad"},
    }
