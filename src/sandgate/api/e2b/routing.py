"""Which front-end a request is for: a pure function of its path and headers.

* `E2b-Sandbox-Id` set (E2B's SDKs send it on every envd request), or a `Host` of
  `{port}-{sandboxID}.<domain>` when the deployment has an E2B domain: envd for envd's port
  and the code interpreter's (none named: envd's), the port proxy (api/ports: a server
  inside the sandbox, `sandbox.get_host(port)`) for any other port;
* a path of E2B's REST API (`/v2/sandboxes`, `/sandboxes/...`...): E2B's REST API;
* anything else: the native API.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from sandgate.core.names import is_valid_name

REST_PREFIXES = (
    "/v2/sandboxes",
    "/sandboxes",
    "/snapshots",
    "/templates",
    "/v2/templates",
    "/v3/templates",
    "/volumes",
    "/volumecontent",  # E2B's volume files API: answered 501 (api.e2b.volumes)
)


# envd's own port and the code interpreter's (api.e2b.envd.ENVD_PORT,
# api.e2b.interpreter.INTERPRETER_PORT): every other port is a server in the sandbox
ENVD_PORTS = ("49983", "49999")


@dataclass(frozen=True)
class Route:
    to: Literal["envd", "e2b_rest", "native", "port"]
    sandbox: str = ""
    port: str = ""


def route(path: str, headers: Iterable[tuple[bytes, bytes]], domain: str | None) -> Route:
    host = b""
    sandbox = port = None
    for name, value in headers:
        if name == b"e2b-sandbox-id":
            sandbox = value.decode("latin-1")
        elif name == b"e2b-sandbox-port":
            port = value.decode("latin-1")
        elif name == b"host":
            host = value
    if sandbox is not None:
        return Route(_served_by(port), sandbox, port or "")
    if domain:
        by_host = sandbox_of_host(host.decode("latin-1"), domain)
        if by_host is not None:
            return Route(_served_by(by_host[0]), by_host[1], by_host[0])
    if any(path == prefix or path.startswith(prefix + "/") for prefix in REST_PREFIXES):
        return Route("e2b_rest")
    return Route("native")


def _served_by(port: str | None) -> Literal["envd", "port"]:
    return "envd" if not port or port in ENVD_PORTS else "port"


def sandbox_of_host(host: str, domain: str) -> tuple[str, str] | None:
    """(port, sandbox) of `{port}-{sandbox}.{domain}[:listen port]`, or None."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    name = name.lower().rstrip(".")
    suffix = "." + domain.lower().strip(".")
    if not name.endswith(suffix):
        return None
    label = name[: -len(suffix)]
    port, dash, sandbox = label.partition("-")
    if not dash or not port.isdigit() or len(port) > 5 or not is_valid_name(sandbox):
        return None
    return port, sandbox
