"""Create idempotency: the digest that names a request, and the fingerprint of its body.

The digest includes the tenant: two tenants choosing the same key must never share a
sandbox (seed 000). Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

MAX_KEY_LENGTH = 255


def validate_key(key: str) -> str | None:
    """Return why an Idempotency-Key is unusable, or None when it is fine."""
    if not key:
        return "Idempotency-Key must not be empty"
    if len(key) > MAX_KEY_LENGTH:
        return f"Idempotency-Key must be at most {MAX_KEY_LENGTH} characters"
    if any(ord(c) < 0x21 or ord(c) > 0x7E for c in key):
        return "Idempotency-Key must be printable ASCII without spaces"
    return None


def digest(tenant_id: str, key: str) -> str:
    """sha256 over the tenant scope and the key, hex."""
    return hashlib.sha256(f"tenant:{tenant_id}\x00key:{key}".encode()).hexdigest()


def short_digest(full_digest: str) -> str:
    """The first 32 bits of the digest, hex: written on the sandbox as `metadata.idem`."""
    return full_digest[:8]


def fingerprint(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a request body: same body, same fingerprint."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
