"""API keys and worker tokens: generation and hashing. Pure functions, no I/O.

A key is a type prefix plus 32 random bytes (url-safe base64). Only its sha256 is stored;
a 256-bit random secret needs no slow KDF.
"""

from __future__ import annotations

import hashlib
import secrets
from types import MappingProxyType
from typing import Literal

TENANT_PREFIX = "sg_"
WORKER_PREFIX = "sgw_"
ADMIN_PREFIX = "sga_"  # an operator's key: the fleet-wide read views, never a tenant's routes

_PREFIXES = MappingProxyType(
    {"tenant": TENANT_PREFIX, "worker": WORKER_PREFIX, "admin": ADMIN_PREFIX}
)


def new_key(kind: Literal["tenant", "worker", "admin"]) -> str:
    return _PREFIXES[kind] + secrets.token_urlsafe(32)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
