"""Command output as the agent sends it (raw bytes) turned into what the API returns."""

from __future__ import annotations


def split_output(payload: bytes, stdout_bytes: int) -> tuple[bytes, bytes]:
    """An exec answer's payload is stdout then stderr; `stdout_bytes` says where they split."""
    if not 0 <= stdout_bytes <= len(payload):
        raise ValueError("stdout_bytes outside the payload")
    return payload[:stdout_bytes], payload[stdout_bytes:]


def decode_output(data: bytes, truncated: bool) -> str:
    """UTF-8 with invalid bytes replaced; a character the cap cut in two is dropped."""
    if truncated:
        data = _trim_partial_utf8(data)
    return data.decode("utf-8", "replace")


def _trim_partial_utf8(data: bytes) -> bytes:
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if byte >= 0xC0:
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if needed > back:
                return data[:-back]
        break
    return data
