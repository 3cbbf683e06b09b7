"""Fault points for tests, all named here. Set with SANDGATE_FAULTS=a,b (comma-separated).

An instance started with any of them logs it loudly at start; an unknown name refuses to
start, so a typo never silently tests nothing.
"""

from __future__ import annotations

import os
from types import MappingProxyType

FAULTS = MappingProxyType(
    {
        "skip-delivery": (
            "accept creates (sandbox, job and key committed) and never deliver them, as if the "
            "instance died right after the commit; the request answers 503 delivery_skipped"
        ),
        "exit-after-accept": (
            "SIGKILL this process right after committing an accept, before any delivery"
        ),
        "fail-reaper": (
            "the reaper's first 4 iterations raise, as if the store refused them; the "
            "supervisor logs each with its traceback and restarts the reaper with backoff, "
            "/readyz answers 503 naming it, and it is healthy again from the 5th"
        ),
        # worker side
        "pause-workspace-git": (
            "worker: a workspace commit or restore waits 3 s after its first git step, so a "
            "test can kill the holder of the workspace's lock meanwhile"
        ),
        "hang-start": (
            "worker: every provision hangs and its sandbox never becomes ready, so each create "
            "is a scheduling timeout; restart the worker without it to recover"
        ),
    }
)


def parse(value: str | None) -> frozenset[str]:
    names = frozenset(n.strip() for n in (value or "").split(",") if n.strip())
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown fault {unknown[0]!r}; known: {', '.join(FAULTS)}")
    return names


def from_environment() -> frozenset[str]:
    return parse(os.environ.get("SANDGATE_FAULTS"))
