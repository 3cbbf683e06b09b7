"""The name a client connection is for, read from its first bytes: the server name of a TLS
ClientHello (SNI, RFC 8446 §4.1.2 and RFC 6066 §3) or the ``Host`` header of an HTTP/1
request. Pure: bytes in, a name (or "need more", or "none") out. The egress gate peeks these
bytes, judges the name, and sends them on unchanged.
"""

from __future__ import annotations

import re
from typing import Final

NEED_MORE: Final = "need-more"  # not enough bytes yet to say
MAX_PEEK = 32 * 1024  # a ClientHello (in one record or several) or an HTTP request head

_METHOD = re.compile(rb"^[A-Z]{3,10} \S+ HTTP/1\.[01]\r\n")
_HOST = re.compile(rb"\r\nhost:[ \t]*([^\r\n]*)", re.IGNORECASE)
_NAME = re.compile(r"^[a-z0-9*_.-]{1,253}$")


def _clean(raw: str) -> str | None:
    name = raw.strip().lower().rstrip(".")
    return name if _NAME.match(name) and not name.startswith(".") else None


def http_host(data: bytes) -> str | None:
    """The Host of an HTTP/1 request head (without its port), None if it is not one,
    NEED_MORE while the head is incomplete."""
    if not data:
        return NEED_MORE
    if not _METHOD.match(data):
        if b"\r\n" not in data and len(data) < 64 and re.match(rb"^[A-Z]{0,10}( |$)", data):
            return NEED_MORE
        return None
    end = data.find(b"\r\n\r\n")
    head = data if end < 0 else data[: end + 2]
    found = _HOST.search(head)
    if found is None:
        return NEED_MORE if end < 0 and len(data) < MAX_PEEK else None
    if end < 0 and not head.endswith(b"\r\n") and b"\r\n" not in head[found.end(1) :]:
        return NEED_MORE  # the Host line itself may be cut
    value = found.group(1).decode("latin-1").strip()
    if value.startswith("["):
        return None  # an IPv6 literal: no name
    host = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
    return _clean(host)


def tls_server_name(data: bytes) -> str | None:
    """The SNI host name of a TLS ClientHello, None if there is none (or this is not TLS),
    NEED_MORE while it is incomplete. The ClientHello may span several handshake records
    (a client may cut it anywhere): they are put together first."""
    handshake = b""
    at = 0
    while True:
        if len(data) - at < 5:
            if at == 0 and data and data[0] != 0x16:
                return None
            return NEED_MORE if len(data) < MAX_PEEK else None
        if data[at] != 0x16 or data[at + 1] != 0x03:
            return None  # not (or no longer) a handshake record
        length = int.from_bytes(data[at + 3 : at + 5], "big")
        if len(data) < at + 5 + length:
            return NEED_MORE if at + 5 + length <= MAX_PEEK else None
        handshake += data[at + 5 : at + 5 + length]
        at += 5 + length
        if len(handshake) >= 4:
            needed = 4 + int.from_bytes(handshake[1:4], "big")
            if len(handshake) >= needed:
                try:
                    return _sni_of_hello(handshake[:needed])
                except IndexError:
                    return None
            if needed > MAX_PEEK:
                return None


def _sni_of_hello(body: bytes) -> str | None:
    if body[0] != 0x01:  # handshake type client_hello
        return None
    at = 4 + 2 + 32  # handshake header, legacy_version, random
    at += 1 + body[at]  # session id
    at += 2 + int.from_bytes(body[at : at + 2], "big")  # cipher suites
    at += 1 + body[at]  # compression methods
    if at + 2 > len(body):
        return None
    end = at + 2 + int.from_bytes(body[at : at + 2], "big")
    at += 2
    while at + 4 <= end:
        kind = int.from_bytes(body[at : at + 2], "big")
        size = int.from_bytes(body[at + 2 : at + 4], "big")
        at += 4
        if kind == 0:  # server_name
            names = body[at : at + size]
            pos = 2
            while pos + 3 <= len(names):
                name_type = names[pos]
                name_len = int.from_bytes(names[pos + 1 : pos + 3], "big")
                value = names[pos + 3 : pos + 3 + name_len]
                if name_type == 0 and len(value) == name_len:
                    return _clean(value.decode("ascii", "replace"))
                pos += 3 + name_len
            return None
        at += size
    return None


def claims_a_name(data: bytes) -> bool:
    """Whether these first bytes are TLS or an HTTP request: a protocol that names its
    server, whether or not the name could be read."""
    return (len(data) >= 2 and data[0] == 0x16 and data[1] == 0x03) or bool(_METHOD.match(data))


def server_name(data: bytes) -> str | None:
    """The name a connection is for from its first bytes: TLS SNI or HTTP Host; None when
    it names none; NEED_MORE while the bytes could still become one."""
    if data[:1] == b"\x16":
        return tls_server_name(data)
    return http_host(data)
