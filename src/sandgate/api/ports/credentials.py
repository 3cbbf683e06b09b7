"""Who may reach a port of a sandbox: the credential of one proxied request.

In this order, the first one present decides:

1. a preview token in the query (`?sandgate_preview=TOKEN`, the preview URL): it must be
   valid (401) and for this sandbox and port (403); the answer then sets it as a cookie
   scoped to the preview (the path prefix, or the whole preview host), so the page's own
   requests (assets, fetches, WebSockets) carry it;
2. that cookie, if valid (a stale one is passed over when an API key is sent too);
3. E2B's `E2B-Traffic-Access-Token` header: the `trafficAccessToken` of this sandbox, as E2B
   sends it for restricted public traffic (`sandbox.get_host(port)`);
4. the API key (`Authorization: Bearer`, `X-API-Key`), as on every route.

None: 401. The sandbox must then be the tenant's and running (404 / 409), as everywhere.
Which one it was decides what goes on to the sandbox's server: an API key used as the
credential is removed, while an `Authorization` sent along with a preview token is the app's
own and is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from starlette.requests import HTTPConnection

from sandgate.api.deps import Services, presented_key, resolve_key, tenant_of
from sandgate.api.ports.headers import PREVIEW_COOKIE, PREVIEW_PARAM
from sandgate.core import e2b_auth
from sandgate.core.ports import PreviewGrant, check_preview
from sandgate.errors import AuthError, NotFoundError, SandgateError
from sandgate.store.base import TenantId

TRAFFIC_HEADER = "e2b-traffic-access-token"


@dataclass(frozen=True)
class Caller:
    tenant: TenantId
    via: Literal["preview", "cookie", "traffic", "key"]
    grant: PreviewGrant | None = None  # a preview token's
    token: str = ""  # a token from the query, set as the cookie by the answer

    @property
    def key_used(self) -> bool:
        return self.via == "key"


async def caller(conn: HTTPConnection, svc: Services, sandbox: str, port: int) -> Caller:
    """The credential of a request for `port` of `sandbox` (see the module's docstring)."""
    secret = svc.settings.secret
    now = time.time()
    queried = conn.query_params.get(PREVIEW_PARAM)
    if queried is not None:
        grant = check_preview(secret, queried, sandbox=sandbox, port=port, now=now)
        return Caller(TenantId(grant.tenant), "preview", grant, queried)
    cookie = conn.cookies.get(PREVIEW_COOKIE)
    key = presented_key(conn.headers)
    if cookie:
        try:
            grant = check_preview(secret, cookie, sandbox=sandbox, port=port, now=now)
            return Caller(TenantId(grant.tenant), "cookie", grant)
        except SandgateError:
            if key is None and TRAFFIC_HEADER not in conn.headers:
                raise
    traffic = conn.headers.get(TRAFFIC_HEADER)
    if traffic is not None:
        if not e2b_auth.traffic_token_matches(secret, sandbox, traffic):
            raise AuthError(f"this {TRAFFIC_HEADER} is not sandbox {sandbox}'s")
        owner = await svc.sandboxes.owner(sandbox)
        if owner is None:
            raise NotFoundError(f"no sandbox {sandbox}")
        return Caller(owner, "traffic")
    if key is None:
        raise AuthError(
            "missing credentials: send Authorization: Bearer <api key>, or open a preview URL "
            f"(POST /api/v1/sandboxes/{sandbox}/ports/{port}/preview makes one)"
        )
    return Caller(tenant_of(await resolve_key(svc, key)), "key")
