"""Short-lived signed tokens (PTY WebSockets): HMAC-SHA256 with the deployment's secret.

Pure functions, the clock passed in. A token is `base64url(claims JSON).base64url(mac)`;
any instance sharing the secret accepts one issued by another.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any


class TokenError(ValueError):
    """The token is malformed, forged, expired or for something else."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(secret: str, claims: dict[str, Any]) -> str:
    body = _b64(json.dumps(claims, sort_keys=True, separators=(",", ":")).encode())
    mac = hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def verify(secret: str, token: str, *, now: float, purpose: str) -> dict[str, Any]:
    """The claims of a valid token of this purpose; TokenError otherwise."""
    body, dot, mac = token.partition(".")
    if not dot or not body or not mac or len(token) > 4096:
        raise TokenError("malformed token")
    expected = hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest()
    try:
        given = _unb64(mac)
        claims = json.loads(_unb64(body))
    except (ValueError, UnicodeDecodeError):
        raise TokenError("malformed token") from None
    if not hmac.compare_digest(expected, given):
        raise TokenError("token signature does not match")
    if not isinstance(claims, dict) or claims.get("purpose") != purpose:
        raise TokenError("token is not for this use")
    expires = claims.get("exp")
    if not isinstance(expires, int | float) or now >= expires:
        raise TokenError("token expired; ask for a new one")
    return claims
