"""Signatures on requests between instances (`/internal/*`). Pure functions, clock passed in.

signature = hex(HMAC-SHA256(secret, METHOD \\n PATH \\n TIMESTAMP \\n sha256hex(BODY)))
(sha256hex(BODY) travels in BODY_DIGEST_HEADER, so the signature is checked before the body)

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
BODY_DIGEST_HEADER = "x-sandgate-body-sha256"
DIGEST_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)
HOP_HEADER = "x-sandgate-hop"  # set on every forwarded request: the receiver never forwards
# what `signed_headers` writes: at most 15 integer digits (seconds until the year 3e7)
TIMESTAMP_RE = re.compile(r"[0-9]{1,15}\.[0-9]{3}", re.ASCII)


class SignatureError(ValueError):
    """Missing, stale or wrong signature."""


def sign(secret: str, method: str, path: str, timestamp: float, body: bytes) -> str:
    return sign_digest(secret, method, path, timestamp, hashlib.sha256(body).hexdigest())


def sign_digest(secret: str, method: str, path: str, timestamp: float, digest: str) -> str:
    message = "\n".join((method.upper(), path, f"{timestamp:.3f}", digest))
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def signed_headers(secret: str, method: str, path: str, now: float, body: bytes) -> dict[str, str]:
    digest = hashlib.sha256(body).hexdigest()
    return {
        TIMESTAMP_HEADER: f"{now:.3f}",
        SIGNATURE_HEADER: sign_digest(secret, method, path, now, digest),
        # the body's digest, signed with the rest: the receiver checks the signature on the
        # headers before it reads a byte of the body, then the body against this
        BODY_DIGEST_HEADER: digest,
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
    verify_head(
        secret,
        method,
        path,
        hashlib.sha256(body).hexdigest(),
        timestamp=timestamp,
        signature=signature,
        now=now,
    )


def verify_head(
    secret: str,
    method: str,
    path: str,
    digest: str | None,
    *,
    timestamp: str | None,
    signature: str | None,
    now: float,
) -> None:
    """`verify` from the headers alone, `digest` being the body's as the sender signed it
    (BODY_DIGEST_HEADER): the body is then read only from a peer holding the secret, and
    checked against the digest as it arrives."""
    if not secret:
        raise SignatureError("this instance has no shared secret (--secret-file)")
    if not timestamp or not signature:
        raise SignatureError("unsigned request")
    stamp = parse_timestamp(timestamp)
    if not abs(now - stamp) <= MAX_SKEW:  # also false for a nan `now`
        raise SignatureError("signature too old or from the future (clock skew?)")
    if digest is None or not DIGEST_RE.fullmatch(digest):
        raise SignatureError("no signed body digest (every instance must run this release)")
    expected = sign_digest(secret, method, path, stamp, digest)
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
