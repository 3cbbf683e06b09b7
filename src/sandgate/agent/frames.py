"""The one wire format sandgate speaks between its own processes (sans-IO).

Used on the worker tunnel (one WebSocket binary message = one frame) and on the pipe
between a worker and the agent inside each sandbox. Standard library only: this file is
bind-mounted into every sandbox next to the agent and imported there by the system Python.

A frame is a JSON header (a dict) plus an opaque binary payload:

    u32 header length | u32 payload length | header (UTF-8 JSON) | payload

Requests carry ``{"id": int, "op": str, ...}``; responses carry ``{"id": int, "ok": bool, ...}``
and, when ``ok`` is false, ``{"error": {"code": str, "message": str}}``. A frame with no ``id``
is an unsolicited event (``{"event": "ready", ...}``).
"""

from __future__ import annotations

import json
import struct

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (agent start-up)

PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 8 << 20

if TYPE_CHECKING:
    from typing import Any, BinaryIO

    Header = dict[str, Any]
else:
    Header = dict


class FrameError(ValueError):
    """A peer sent bytes that are not a valid frame; the link must be closed."""


# a payload at least this large is written apart from its head (encode_head), not copied
# behind it: on a pipe two writes cost less than a copy of the payload
SEPARATE_PAYLOAD_BYTES = 64 << 10


def encode(header: Header, payload: bytes = b"") -> bytes:
    return encode_head(header, len(payload)) + payload


def encode_parts(header: Header, payload: bytes) -> tuple[bytes, bytes]:
    """A frame as two writes: its head and its payload when the payload is at least
    SEPARATE_PAYLOAD_BYTES, else the whole frame and nothing."""
    if len(payload) >= SEPARATE_PAYLOAD_BYTES:
        return encode_head(header, len(payload)), payload
    return encode(header, payload), b""


def encode_head(header: Header, payload_bytes: int) -> bytes:
    """A frame's prefix and header, for a payload of `payload_bytes` sent right after."""
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    if payload_bytes > MAX_PAYLOAD_BYTES:
        raise FrameError(f"frame payload of {payload_bytes} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return PREFIX.pack(len(raw), payload_bytes) + raw


def lengths(prefix: bytes) -> tuple[int, int]:
    """The header and payload lengths a frame's prefix (its first PREFIX.size bytes) gives,
    within their bounds (FrameError otherwise)."""
    hlen, plen = PREFIX.unpack_from(prefix)
    if hlen > MAX_HEADER_BYTES or plen > MAX_PAYLOAD_BYTES:
        raise FrameError("frame length prefix out of bounds")
    return hlen, plen


def decode(frame: bytes) -> tuple[Header, bytes]:
    """Decode exactly one frame (a whole WebSocket message)."""
    if len(frame) < PREFIX.size:
        raise FrameError("frame shorter than its length prefix")
    hlen, plen = lengths(frame)
    if len(frame) != PREFIX.size + hlen + plen:
        raise FrameError("frame length does not match its prefix")
    header = parse_header(frame[PREFIX.size : PREFIX.size + hlen])
    return header, bytes(frame[PREFIX.size + hlen :])


def read_frame(stream: BinaryIO) -> tuple[Header, bytes] | None:
    """Blocking read of one frame from a binary file; None at a clean end of stream."""
    prefix = _read_exact(stream, PREFIX.size)
    if prefix is None:
        return None
    hlen, plen = lengths(prefix)
    body = _read_exact(stream, hlen + plen)
    if body is None:
        raise FrameError("stream ended inside a frame")
    return parse_header(body[:hlen]), body[hlen:]


def error_header(
    request_id: int | None, code: str, message: str, details: Header | None = None
) -> Header:
    error: Header = {"code": code, "message": message}
    if details:
        error["details"] = details
    return {"id": request_id, "ok": False, "error": error}


def _read_exact(stream: BinaryIO, size: int) -> bytes | None:
    chunks = []
    remaining = size
    while remaining:
        chunk = stream.read(remaining)
        if not chunk:
            if remaining == size:
                return None
            raise FrameError("stream ended inside a frame")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def parse_header(raw: bytes) -> Header:
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise FrameError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header
