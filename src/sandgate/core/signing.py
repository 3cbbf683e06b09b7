"""Signatures on requests between instances (`/internal/*`). Pure functions, clock passed in.

signature = hex(HMAC-SHA256(secret, METHOD \\n PATH \\n TIMESTAMP \\n sha256hex(BODY)))

A request is accepted only with a valid signature made within `MAX_SKEW` seconds of the
receiver's clock; everything is compared in constant time. TIMESTAMP is the sender's clock
exactly as `signed_headers` writes it (ASCII digits, a dot, three decimals): any other spelling,
`nan`, `inf`, an exponent or anything `float()` would also take, is refused before the
signature is even computed, so no value can slip past the freshness check.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re

MAX_SKEW = 300.0
TIMESTAMP_HEADER = "x-sandgate-timestamp"
SIGNATURE_HEADER = "x-sandgate-signature"
HOP_HEADER = "x-sandgate-hop"  # set on every forwarded request: the receiver never forwards
# what `signed_headers` writes: at most 15 integer digits (seconds until the year 3e7)
TIMESTAMP_RE = re.compile(r"[0-9]{1,15}\.[0-9]{3}", re.ASCII)


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
    stamp = parse_timestamp(timestamp)
    if not abs(now - stamp) <= MAX_SKEW:  # also false for a nan `now`
        raise SignatureError("signature too old or from the future (clock skew?)")
    expected = sign(secret, method, path, stamp, body)
    if not hmac.compare_digest(expected, signature):
        raise SignatureError("signature does not match (is the secret the same everywhere?)")


def parse_timestamp(timestamp: str) -> float:
    """The sender's clock from TIMESTAMP_HEADER; SignatureError unless it is spelled exactly as
    `signed_headers` writes it (so never nan, inf, an exponent, a sign, spaces or `_`)."""
    if not TIMESTAMP_RE.fullmatch(timestamp):
        raise SignatureError("bad timestamp (expected seconds as digits with 3 decimals)")
    stamp = float(timestamp)
    if not math.isfinite(stamp):  # cannot happen with TIMESTAMP_RE; kept as the last word
        raise SignatureError("bad timestamp (not a finite number)")
    return stamp
