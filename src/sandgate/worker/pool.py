"""Warm pools: sandboxes a worker starts before any create asks, handed out on provision.

`--pool TEMPLATE=N` keeps N ready sandboxes of a template, each with the deployment's
default resources and no network. A provision that asks for exactly that (and did not say
`"pool": false`) takes one: the tenant's environment is applied to it and it is registered
under the create's name. A pooled sandbox has never been handed out before: nothing of a
previous tenant can be in it. The pool is then refilled in the background.

Pooled sandboxes count in the worker's capacity and budget: the worker reports its capacity
and budget less the pools' share, so the control plane (which counts what it places, exactly,
in the store) never places more than the host holds.

Templates a pool may hold:

* `default`: the host's root, the sandbox as it always was;
* `code-interpreter`: the same, with its default code context (an IPython kernel:
  agent/kernel_bridge.py) started at boot. A pooled one is handed out with its kernel ready;
* any public template (an image): the worker asks the control plane for its image when it
  starts a pool sandbox (`template` request), so a pool follows a template that is replaced;
  a public image named `code-interpreter` (an operator's) takes the built-in's place, kernel
  and all.

This module holds the pure parts: which sandboxes match, what a pool reserves.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from sandgate.worker.runtime.base import ImageSpec, SandboxSpec

TEMPLATES = ("default", "code-interpreter")
BOOT_CONTEXT = MappingProxyType({"code-interpreter": "default"})  # template -> its context
POOL_NAME_PREFIX = "pool-"
TEMPLATE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")  # control/templates.NAME_RE


def parse_pools(given: list[str]) -> dict[str, int]:
    """`TEMPLATE=N` items (the CLI's `--pool`), validated."""
    pools: dict[str, int] = {}
    for item in given:
        template, eq, count = item.partition("=")
        valid = TEMPLATE_NAME.fullmatch(template)
        if not eq or not valid or not count.isdigit() or int(count) > 1000:
            raise ValueError(
                f"--pool {item!r}: give TEMPLATE=N, N at most 1000, TEMPLATE a built-in "
                f"({', '.join(TEMPLATES)}) or a public template's name"
            )
        pools[template] = int(count)
    return {template: n for template, n in pools.items() if n > 0}


def pooled_spec(template: str, image: ImageSpec | None = None) -> SandboxSpec:
    """A pool sandbox: the default resources, no network, a name of its own (its hostname)."""
    return SandboxSpec(
        name=POOL_NAME_PREFIX + secrets.token_hex(6),
        template=template,
        image=image,
    )


def image_digest(spec: SandboxSpec) -> str | None:
    return None if spec.image is None else spec.image.digest


def matches(pooled: SandboxSpec, wanted: SandboxSpec, *, network_switches: bool) -> bool:
    """Whether a provision can take this pooled sandbox instead of starting one (pooled
    sandboxes start with no network; `network_switches`: the runtime can turn it on)."""
    return (
        wanted.pool
        and (network_switches or not wanted.network.enabled)
        and pooled.template == wanted.template
        and image_digest(pooled) == image_digest(wanted)
        and pooled.resources() == wanted.resources()
    )


def reserved(pools: Mapping[str, int]) -> int:
    return sum(pools.values())


def reported_enforces(enforces: Mapping[str, Any], pools: Mapping[str, int]) -> dict[str, Any]:
    """The worker's budget as it reports it: less what its pools hold."""
    out = dict(enforces)
    budget = dict(out.get("budget") or {})
    one = pooled_spec("default").resources()
    count = reserved(pools)
    for resource in ("memory_mb", "disk_mb"):
        if resource in budget:
            budget[resource] = max(0, int(budget[resource]) - int(one[resource]) * count)
    if budget:
        out["budget"] = budget
    return out
