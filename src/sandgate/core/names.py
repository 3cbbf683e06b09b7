"""Sandbox names: chosen by the control plane, valid as a hostname. Pure functions."""

from __future__ import annotations

import re
import secrets

_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"
NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def new_sandbox_name() -> str:
    return "sbx-" + "".join(secrets.choice(_ALPHABET) for _ in range(12))


def is_valid_name(name: str) -> bool:
    return bool(NAME_PATTERN.match(name))
