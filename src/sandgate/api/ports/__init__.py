"""The port proxy: HTTP and WebSocket requests for a server inside a sandbox.

Two forms reach it, both served by `api/routes/ports.py`:

* the path form, `/api/v1/sandboxes/{name}/ports/{port}/{path...}`, on any instance;
* the host form, `{port}-{name}.<domain>` (the deployment's `--e2b-domain`: what E2B's
  `sandbox.get_host(port)` builds), for every port but envd's and the code interpreter's.
  `api/e2b/dispatch.py` rewrites such a request into the path form (`port_scope`) and marks
  it (`HOST_FORM`): the path the server in the sandbox sees is then the request's own.

The modules: `credentials` (who asks), `headers` (what goes on, what comes back),
`http_relay` (one HTTP request through `h11`), `ws_relay` (a WebSocket through the sans-IO
`websockets` client protocol). Under them is `control/ports.py`, the connection through the
sandbox's agent.
"""

from __future__ import annotations

import re

from starlette.types import Scope

from sandgate.core.ports import API_PREFIX

HOST_FORM = "sandgate.port_host_form"  # a scope key: the request came by the host form
_PROXIED = re.compile(r"^/api/v1/sandboxes/[^/]+/ports/[^/]+(/|$)")


def is_proxied_path(path: str) -> bool:
    """A request for a sandbox's port: its route authenticates before it reads a byte and
    streams the body on (`api.limits.BodyLimit` leaves it uncapped, still timed)."""
    return _PROXIED.match(path) is not None


def port_scope(scope: Scope, sandbox: str, port: str) -> Scope:
    """The host form's request as the path form's: the same request under the prefix."""
    prefix = f"{API_PREFIX}/{sandbox}/ports/{port}"
    raw = scope.get("raw_path") or scope["path"].encode()
    return {
        **scope,
        "path": prefix + scope["path"],
        "raw_path": prefix.encode() + raw,
        HOST_FORM: True,
    }
