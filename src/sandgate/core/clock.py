"""The clock: what time it is, as sandgate records it (aware UTC, every `*_at` field).

The one `utcnow` of the control plane and the CLI. Pure decisions in `core/` take the time as
an argument (`now`) instead of calling it, so a test passes any instant it likes.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """Now, as an aware datetime in UTC."""
    return datetime.now(UTC)
