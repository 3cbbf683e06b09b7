"""A template build, as data: its base, its steps, and the cache key of each step.

A build file (``template.toml``, or the same document as JSON)::

    from = "py312"              # the template it starts from (an image)
    network = false             # run steps get network (the worker must allow it)
    resources = { disk_mb = 4096 }  # of each run step's sandbox (the operator's caps apply)
    cmd = ["python3", "app.py"] # optional: the image's command

    [[steps]]
    run = "pip install --no-index /wheels/*.whl"

    [[steps]]
    copy = "app/"               # a path in the build context (the file's directory)...
    to = "/app"                 # ...copied here (owners root)

    [[steps]]
    env = { APP_MODE = "prod" }

    [[steps]]
    workdir = "/app"

    [[steps]]
    user = "1000"

`run` and `copy` make a layer each; `env`, `workdir` and `user` change the config (and the
steps after them). Each step has a cache key: the parent's key, the step and the config it
runs under (and for a copy, the digest of what it copies) hashed together, like image
layers: a build whose steps did not change reuses every layer it made before.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sandgate.core.caps import RESOURCES
from sandgate.errors import InvalidRequestError

StepKind = Literal["run", "copy", "env", "workdir", "user"]
MAX_STEPS = 50
MAX_RUN_SECONDS = 3600.0
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class BuildSpecError(InvalidRequestError):
    code = "invalid_build"


@dataclass(frozen=True)
class Step:
    kind: StepKind
    run: str = ""  # kind run: a shell command line (/bin/sh -c)
    source: str = ""  # kind copy: a path in the context
    to: str = ""  # kind copy: an absolute path in the image
    env: tuple[tuple[str, str], ...] = ()  # kind env
    value: str = ""  # kind workdir / user
    timeout: float = 600.0  # kind run

    def describe(self) -> str:
        if self.kind == "run":
            return f"run {self.run}"
        if self.kind == "copy":
            return f"copy {self.source} {self.to}"
        if self.kind == "env":
            return "env " + " ".join(f"{k}={v}" for k, v in self.env)
        return f"{self.kind} {self.value}"

    def canonical(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "run": self.run,
            "source": self.source,
            "to": self.to,
            "env": [list(pair) for pair in self.env],
            "value": self.value,
        }


@dataclass(frozen=True)
class BuildSpec:
    base: str
    steps: tuple[Step, ...]
    network: bool = False
    cmd: tuple[str, ...] | None = None
    resources: tuple[tuple[str, int | float], ...] = ()  # asked for the run steps' sandboxes


@dataclass(frozen=True)
class Config:
    """The image config as the steps change it."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    user: str = ""
    cmd: tuple[str, ...] = ()

    @classmethod
    def of(cls, image: dict[str, Any]) -> Config:
        return cls(
            env=dict(image.get("env") or {}),
            workdir=str(image.get("workdir") or ""),
            user=str(image.get("user") or ""),
            cmd=tuple(str(x) for x in image.get("cmd") or ()),
        )

    def after(self, step: Step) -> Config:
        if step.kind == "env":
            return replace(self, env={**self.env, **dict(step.env)})
        if step.kind == "workdir":
            return replace(self, workdir=step.value)
        if step.kind == "user":
            return replace(self, user=step.value)
        return self


def parse(document: Any) -> BuildSpec:
    """A build file's document (parsed TOML or JSON) as a BuildSpec; refuses what is wrong."""
    if not isinstance(document, dict):
        raise BuildSpecError("a build is an object with 'from' and 'steps'")
    unknown = set(document) - {"from", "steps", "network", "cmd", "resources"}
    if unknown:
        raise BuildSpecError(f"unknown build keys: {', '.join(sorted(unknown))}")
    base = document.get("from")
    if not isinstance(base, str) or not base:
        raise BuildSpecError("'from' names the template the build starts from")
    raw_steps = document.get("steps") or []
    if not isinstance(raw_steps, list) or not raw_steps:
        raise BuildSpecError("'steps' is a list of at least one step")
    if len(raw_steps) > MAX_STEPS:
        raise BuildSpecError(f"a build has at most {MAX_STEPS} steps")
    network = document.get("network", False)
    if not isinstance(network, bool):
        raise BuildSpecError("'network' is true or false")
    cmd = document.get("cmd")
    if cmd is not None and (not isinstance(cmd, list) or not all(isinstance(x, str) for x in cmd)):
        raise BuildSpecError("'cmd' is a list of strings")
    resources = document.get("resources") or {}
    if not isinstance(resources, dict) or not all(
        key in RESOURCES and isinstance(value, int | float) and not isinstance(value, bool)
        for key, value in resources.items()
    ):
        raise BuildSpecError(f"'resources' is a table of {', '.join(RESOURCES)} = number")
    steps = tuple(_step(index, raw) for index, raw in enumerate(raw_steps, 1))
    return BuildSpec(
        base,
        steps,
        network,
        tuple(cmd) if cmd is not None else None,
        tuple(sorted(resources.items())),
    )


def _step(index: int, raw: Any) -> Step:
    if not isinstance(raw, dict):
        raise BuildSpecError(f"step {index} is not an object")
    kinds = [k for k in ("run", "copy", "env", "workdir", "user") if k in raw]
    if len(kinds) != 1:
        raise BuildSpecError(
            f"step {index} needs exactly one of run, copy, env, workdir, user (has "
            f"{', '.join(kinds) or 'none'})"
        )
    kind = kinds[0]
    allowed = {kind, "to"} if kind == "copy" else {kind, "timeout"} if kind == "run" else {kind}
    if set(raw) - allowed:
        raise BuildSpecError(f"step {index}: unknown keys {', '.join(sorted(set(raw) - allowed))}")
    value = raw[kind]
    if kind == "run":
        if not isinstance(value, str) or not value.strip():
            raise BuildSpecError(f"step {index}: run is a non-empty command line")
        timeout = raw.get("timeout", 600.0)
        if not isinstance(timeout, int | float) or not 0 < timeout <= MAX_RUN_SECONDS:
            raise BuildSpecError(f"step {index}: timeout is 0 < seconds <= {MAX_RUN_SECONDS:g}")
        return Step("run", run=value, timeout=float(timeout))
    if kind == "copy":
        to = raw.get("to")
        if not isinstance(value, str) or not value:
            raise BuildSpecError(f"step {index}: copy names a path in the build context")
        if not isinstance(to, str) or not to.startswith("/"):
            raise BuildSpecError(f"step {index}: copy needs 'to', an absolute path in the image")
        source = posixpath.normpath(value)
        if source == ".." or source.startswith("../") or source.startswith("/"):
            raise BuildSpecError(f"step {index}: copy {value!r} leaves the build context")
        # a trailing / says "into this directory" (copy app.py to /app/ makes /app/app.py)
        target = posixpath.normpath(to) + ("/" if to.endswith("/") and to != "/" else "")
        return Step("copy", source=source, to=target)
    if kind == "env":
        if not isinstance(value, dict) or not value:
            raise BuildSpecError(f"step {index}: env is a table of NAME = value")
        pairs = []
        for key, item in value.items():
            if not ENV_NAME.fullmatch(str(key)) or not isinstance(item, str) or "\0" in item:
                raise BuildSpecError(f"step {index}: env {key!r} must be NAME = string")
            pairs.append((str(key), item))
        return Step("env", env=tuple(sorted(pairs)))
    if not isinstance(value, str) or not value:
        raise BuildSpecError(f"step {index}: {kind} is a non-empty string")
    if kind == "workdir" and not value.startswith("/"):
        raise BuildSpecError(f"step {index}: workdir is an absolute path")
    return Step(kind, value=value)  # type: ignore[arg-type]


def step_key(parent: str, step: Step, config: Config, *, network: bool, content: str = "") -> str:
    """The cache key of `step` run on the image whose key is `parent` under `config`
    (`content`: a copy's layer digest)."""
    material = {
        "parent": parent,
        "step": step.canonical(),
        "config": {
            "env": sorted(config.env.items()),
            "workdir": config.workdir,
            "user": config.user,
        },
        "network": network if step.kind == "run" else False,
        "content": content,
    }
    canonical = json.dumps(material, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()
