"""Ports of a sandbox as the control plane names them, and preview tokens. Pure functions,
the clock passed in.

A preview token lets whoever holds it reach one port of one sandbox without an API key
(a browser): it is signed with the deployment's shared secret (`core.tokens`), so any
instance accepts one another issued, and it names its tenant, sandbox and port and when it
expires. It cannot be revoked before then, except by deleting the sandbox (or changing the
secret): keep TTLs short for anything sensitive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sandgate.core.tokens import TokenError, sign, verify
from sandgate.errors import AuthError, ForbiddenError, InvalidRequestError

PREVIEW_PURPOSE = "preview"
DEFAULT_PREVIEW_TTL = 3600.0
MAX_PREVIEW_TTL = 24 * 3600.0  # a sandbox lives at most this long too
API_PREFIX = "/api/v1/sandboxes"


def parse_port(raw: str | int) -> int:
    """A port number from a path or a header; 400 `invalid_request` unless 1..65535."""
    text = str(raw)
    if not text.isascii() or not text.isdigit() or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise InvalidRequestError(f"port {text!r} is not a port number: use 1 to 65535")
    return int(text)


def port_prefix(sandbox: str, port: int) -> str:
    """Where a port of a sandbox is served on the native API: `{prefix}/{path}`."""
    return f"{API_PREFIX}/{sandbox}/ports/{port}"


@dataclass(frozen=True)
class Preview:
    token: str
    expires: float  # unix seconds


def issue_preview(
    secret: str, *, tenant: str, sandbox: str, port: int, ttl: float, now: float
) -> Preview:
    expires = now + ttl
    claims: dict[str, Any] = {
        "purpose": PREVIEW_PURPOSE,
        "tenant": tenant,
        "sandbox": sandbox,
        "port": port,
        "exp": expires,
    }
    return Preview(sign(secret, claims), expires)


@dataclass(frozen=True)
class PreviewGrant:
    tenant: str
    expires: float


def check_preview(secret: str, token: str, *, sandbox: str, port: int, now: float) -> PreviewGrant:
    """The tenant a valid preview token for this sandbox's port was issued to. Malformed,
    forged or expired: `AuthError` (401); valid but for another sandbox or port:
    `ForbiddenError` (403)."""
    try:
        claims = verify(secret, token, now=now, purpose=PREVIEW_PURPOSE)
    except TokenError as exc:
        raise AuthError(
            f"preview token refused: {exc}; ask for a new preview URL "
            f"(POST {port_prefix(sandbox, port)}/preview with the API key)"
        ) from None
    if claims.get("sandbox") != sandbox or claims.get("port") != port:
        raise ForbiddenError(
            f"this preview token is for port {claims.get('port')} of sandbox "
            f"{claims.get('sandbox')}, not port {port} of {sandbox}"
        )
    tenant = claims.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise AuthError("preview token refused: it names no tenant")
    return PreviewGrant(tenant, float(claims["exp"]))
