"""Signatures on requests between instances (`/internal/*`). Pure functions, clock passed in.

signature = hex(HMAC-SHA256(secret, METHOD \\n PATH \\n TIMESTAMP \\n sha256hex(BODY)))

A request is accepted only with a valid signature made within `MAX_SKEW` seconds of the
receiver's clock; everything is compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac

MAX_SKEW = 300.0
TIMESTAMP_HEADER = "x-sandgate-timestamp"
SIGNATURE_HEADER = "x-sandgate-signature"
HOP_HEADER = "x-sandgate-hop"  # set on every forwarded request: the receiver never forwards


class SignatureError(ValueError):
    """Missing, stale or wrong signature."""


def sign(secret: str, method: str, path: str, timestamp: float, body: bytes) -> str:
    message = "\n".join(
        (method.upper(), path, f"{timestamp:.3f}", hashlib.sha256(body).hexdigest())
    )
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def signed_headers(secret: str, method: str, path: str, now: float, body: bytes) -> dict[str, str]:
    return {
        TIMESTAMP_HEADER: f"{now:.3f}",
        SIGNATURE_HEADER: sign(secret, method, path, now, body),
        HOP_HEADER: "1",
    }


def verify(
    secret: str,
    method: str,
    path: str,
    body: bytes,
    *,
    timestamp: str | None,
    signature: str | None,
    now: float,
) -> None:
    if not secret:
        raise SignatureError("this instance has no shared secret (--secret-file)")
    if not timestamp or not signature:
        raise SignatureError("unsigned request")
    try:
        stamp = float(timestamp)
    except ValueError:
        raise SignatureError("bad timestamp") from None
    if abs(now - stamp) > MAX_SKEW:
        raise SignatureError("signature too old or from the future (clock skew?)")
    expected = sign(secret, method, path, stamp, body)
    if not hmac.compare_digest(expected, signature):
        raise SignatureError("signature does not match (is the secret the same everywhere?)")
