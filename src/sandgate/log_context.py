"""What a log line says about the request it belongs to: its request id, the tenant, the
sandbox, the instance. Bound in the request's context (structlog's contextvars: each request
and each tunnel call runs in a context of its own), read by the log formatter
(`cli/logs.py`), and carried with the request to the instance holding a worker's tunnel
and to the worker itself, so one id follows a request through every process it touches.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from structlog.contextvars import bind_contextvars, bound_contextvars, get_contextvars

HEADER: Final = "X-Request-Id"
FIELD: Final = "request_id"  # in a tunnel request's and a peer call's fields
_VALID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def accepted(value: Any) -> str | None:
    """A request id a client or a peer sent, if it is one (else a new one is made)."""
    return value if isinstance(value, str) and _VALID.fullmatch(value) else None


def request_id() -> str | None:
    found = get_contextvars().get(FIELD)
    return found if isinstance(found, str) else None


def bind(**fields: Any) -> None:
    """Add fields (tenant, sandbox...) to every line logged for the current request."""
    bind_contextvars(**{k: v for k, v in fields.items() if v is not None})


@contextmanager
def request(request_id: str | None, **fields: Any) -> Iterator[str]:
    """The context of one request: its id (a new one if none was given) and `fields`."""
    rid = accepted(request_id) or new_request_id()
    with bound_contextvars(**{FIELD: rid}, **{k: v for k, v in fields.items() if v is not None}):
        yield rid
