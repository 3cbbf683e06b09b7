"""E2B's control REST API (`/v2/sandboxes`, `/sandboxes/{id}`...) over sandgate's own services.

The same create pipeline (admission, idempotency, placement), lifecycle and toolbox as the
native API: this module only translates E2B's JSON shapes. Authenticated by `X-API-KEY` as a
sandgate tenant key. Errors answer in the body E2B's SDKs parse, `{"code": <status>,
"message": ...}` (`errors.install(shape=e2b_body)`), and what sandgate cannot serve yet answers
501 saying so. A sandbox E2B's SDK asks about is one that is pending or running: an ended one
is 404, as E2B answers for a killed sandbox.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import State

from sandgate.api import errors
from sandgate.api.deps import Services, services, tenant
from sandgate.api.e2b import volumes
from sandgate.api.routes.sandboxes import create_request
from sandgate.api.schemas import CreateSandbox, WorkspaceMountIn
from sandgate.core import e2b_auth
from sandgate.core.clock import utcnow
from sandgate.core.egress_policy import parse_policy
from sandgate.errors import ConflictError, InvalidRequestError, NotFoundError, NotSupportedError
from sandgate.store.base import Sandbox, SandboxFilter, SandboxName, SandboxState, TenantId

ENVD_VERSION = "0.6.4"  # the envd features the SDK may use (e2b/envd/versions.py) are served
# E2B's default template is sandgate's default
# E2B's code interpreter SDK asks for code-interpreter-v1: sandgate's code-interpreter template
# (the host root, its default context's kernel started at boot: worker/pool.py)
TEMPLATE_ALIASES = MappingProxyType({"base": "default", "code-interpreter-v1": "code-interpreter"})
LIVE: tuple[SandboxState, ...] = ("pending", "running")
MAX_PAGE = 1000


Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]

router = APIRouter(tags=["e2b"])


class NewSandbox(BaseModel):
    """`POST /v2/sandboxes` as the SDK sends it; keys it may send that sandgate has no
    counterpart for are accepted when they ask for nothing (false, empty, null)."""

    model_config = ConfigDict(extra="allow")

    templateID: str = Field(default="base", min_length=1, max_length=128)
    timeout: int | None = Field(default=None, ge=0)
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None  # allowOut, denyOut (the rest: see e2b_network)
    secure: bool | None = None  # sandgate always issues an envd access token
    autoPause: bool | None = None
    volumeMounts: list[Any] | None = None  # [{name, path}]: workspaces (api.e2b.volumes)


# what only E2B's infrastructure has; named so the refusal can say which key asked for it
UNSUPPORTED_KEYS = MappingProxyType(
    {
        "autoPause": "pausing sandboxes",
        "autoPauseMemory": "pausing sandboxes",
        "autoResume": "pausing sandboxes",
        "lifecycle": "pausing sandboxes",
        "mcp": "MCP gateways",
        "iam": "IAM roles",
    }
)


# the keys of E2B's network config sandgate has no counterpart for, when they ask for something
NETWORK_UNSUPPORTED = MappingProxyType(
    {
        "egressProxy": "an egress SOCKS proxy",
        "maskRequestHost": "masking the Host of requests",
        "rules": "per-domain request transforms",
    }
)


def e2b_network(allow_internet: bool | None, network: dict[str, Any] | None) -> Any:
    """E2B's `allowInternetAccess` and `network` {allowOut, denyOut} as a sandgate policy
    (core/egress_policy). E2B's order is sandgate's: allowOut wins over denyOut. E2B's
    allowOut with no denyOut restricts nothing (everything is allowed anyway): the internet.
    allowOut as exceptions to a denyOut narrower than 0.0.0.0/0 are not kept (stricter than
    E2B: only denyOut applies). `dnsServers` needs nothing: the gate's DNS answers any
    address. `allowPublicTraffic` and `httpsPorts` are about ports coming in, not out."""
    config = network or {}
    for key, what in NETWORK_UNSUPPORTED.items():
        if config.get(key) not in (None, False, {}, [], ""):
            raise NotSupportedError(f"network.{key}: sandgate does not support {what} yet")
    allow = list(config.get("allowOut") or [])
    deny = list(config.get("denyOut") or [])
    if allow_internet is False:
        deny.append("0.0.0.0/0")
    everything = any(str(d).strip() in ("0.0.0.0/0", "0.0.0.0") for d in deny)
    if everything:
        return {"allow_out": allow} if allow else False
    if deny:
        return {"deny_out": deny}
    return True


def e2b_network_out(sandbox: Sandbox) -> dict[str, Any]:
    """A sandbox's policy the way E2B's detail reports it."""
    rules = sandbox.network_policy or {}
    out: dict[str, Any] = {}
    if rules.get("allow_out"):
        out["allowOut"] = list(rules["allow_out"])
        out["denyOut"] = ["0.0.0.0/0", *rules.get("deny_out", [])]
    elif rules.get("deny_out"):
        out["denyOut"] = list(rules["deny_out"])
    elif not sandbox.network:
        out["denyOut"] = ["0.0.0.0/0"]
    return out


class NetworkUpdate(BaseModel):
    """`PUT /sandboxes/{id}/network`: the whole egress config, replaced at once."""

    model_config = ConfigDict(extra="allow")
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    allowInternetAccess: bool | None = None


class TimeoutBody(BaseModel):
    timeout: int = Field(ge=0)


class ConnectBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # `memory` (resume mode): nothing to resume here
    timeout: int | None = Field(default=None, ge=0)


def create_e2b_rest_app(state: State) -> FastAPI:
    """The app the dispatcher (api.e2b.dispatch) hands E2B's REST paths to. `state`: the
    native app's, where its lifespan puts the services both share."""
    app = FastAPI(title="sandgate E2B-compatible API", openapi_url=None, docs_url=None)
    app.state = state
    errors.install(app, shape=errors.e2b_body, validation_status=400)
    app.include_router(router)
    app.include_router(volumes.router)
    return app


# -- create ---------------------------------------------------------------------------------
@router.post("/v2/sandboxes", status_code=201)
@router.post("/sandboxes", status_code=201)
async def create(
    http: Request,
    body: NewSandbox,
    who: Tenant,
    svc: Svc,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    _refuse_unsupported(body)
    template = TEMPLATE_ALIASES.get(body.templateID, body.templateID)
    try:
        resolved = await svc.templates.resolve(who, template)
    except NotFoundError:
        known = ", ".join(svc.settings.templates)
        raise NotFoundError(
            f"template {body.templateID!r} not found; this server has: {known} and the "
            "templates imported with sandgate templates import"
        ) from None
    wanted = volumes.volume_mounts(body.volumeMounts)
    try:  # the native create's checks: reserved metadata keys, env names, sizes
        native = CreateSandbox(
            template=template,
            timeout=float(body.timeout) if body.timeout else None,
            metadata=body.metadata or {},
            env=body.envVars or {},
            network=e2b_network(body.allow_internet_access, body.network),
            workspaces=[WorkspaceMountIn(name=m.name, path=m.path) for m in wanted] or None,
        )
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(x) for x in problem.get("loc", ())) or "body"
        raise InvalidRequestError(f"{where}: {problem.get('msg', 'invalid')}") from None
    mounts = await svc.workspaces.resolve(who, wanted)  # as the native create does
    request = create_request(native, svc.settings, resolved, mounts)
    result = await svc.creates.create(who, request, idempotency_key, http.is_disconnected)
    if mounts[0] and result.sandbox.worker is not None:
        await svc.workspaces.placed(mounts[0], result.sandbox.worker)
    svc.metrics.created(result.sandbox, replayed=result.replayed)
    headers = {"Idempotent-Replayed": "true"} if result.replayed else None
    # E2B answers 201 to a retry too (its SDK reads any other status as no sandbox)
    return JSONResponse(_created(svc, result.sandbox), status_code=201, headers=headers)


def _refuse_unsupported(body: NewSandbox) -> None:
    given = {"autoPause": body.autoPause, **(body.model_extra or {})}
    for key, value in given.items():
        if key in UNSUPPORTED_KEYS and value not in (None, False, {}, [], ""):
            raise NotSupportedError(
                f"{key}: sandgate does not support {UNSUPPORTED_KEYS[key]} yet; "
                "create the sandbox without it (docs/e2b.md lists what works)"
            )


def _created(svc: Services, sandbox: Sandbox) -> dict[str, Any]:
    return {
        "templateID": _template_of(sandbox),
        "sandboxID": sandbox.name,
        "clientID": "sandgate",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": e2b_auth.envd_token(svc.settings.secret, sandbox.name),
        "trafficAccessToken": e2b_auth.traffic_token(svc.settings.secret, sandbox.name),
        "domain": svc.settings.e2b_domain,
        "alias": None,
    }


def _template_of(sandbox: Sandbox) -> str:
    for alias, template in TEMPLATE_ALIASES.items():
        if template == sandbox.template:
            return alias
    return sandbox.template


# -- read -----------------------------------------------------------------------------------
def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")


def _listed(sandbox: Sandbox) -> dict[str, Any]:
    cpus = sandbox.resources.get("cpus")
    started = sandbox.started_at or sandbox.created_at
    ends = sandbox.expires_at or started + timedelta(seconds=sandbox.timeout)
    return {
        "templateID": _template_of(sandbox),
        "sandboxID": sandbox.name,
        "clientID": "sandgate",
        "alias": None,
        "startedAt": _iso(started),
        "endAt": _iso(ends),
        "cpuCount": max(1, math.ceil(cpus)) if isinstance(cpus, int | float) else 1,
        "memoryMB": int(sandbox.resources.get("memory_mb") or 0),
        "diskSizeMB": int(sandbox.resources.get("disk_mb") or 0),
        "metadata": sandbox.metadata,
        "state": "running",
        "envdVersion": ENVD_VERSION,
        "volumeMounts": volumes.mounts_out(sandbox),
    }


async def _live(svc: Services, who: TenantId, sandbox_id: str) -> Sandbox:
    sandbox = await svc.sandboxes.get(who, sandbox_id)
    if sandbox.state not in LIVE:
        raise NotFoundError(f"sandbox {sandbox_id} not found (it is {sandbox.state})")
    return sandbox


@router.get("/v2/sandboxes")
async def list_sandboxes(
    request: Request,
    who: Tenant,
    svc: Svc,
    state: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    nextToken: Annotated[str | None, Query(max_length=128)] = None,
) -> JSONResponse:
    wanted = {s.strip() for s in (state or "running,paused").split(",") if s.strip()}
    if unknown := wanted - {"running", "paused"}:
        raise InvalidRequestError(f"unknown state {sorted(unknown)[0]!r}; use running or paused")
    if "running" not in wanted:  # nothing is ever paused here
        return JSONResponse([])
    where = SandboxFilter(
        states=LIVE,
        metadata=_metadata_filter(request.query_params.get("metadata")),
        after=SandboxName(nextToken) if nextToken else None,
        limit=limit + 1,
    )
    found = await svc.sandboxes.list(who, where)
    page = found[:limit]
    headers = {"x-next-token": page[-1].name} if len(found) > limit else None
    return JSONResponse([_listed(s) for s in page], headers=headers)


@router.get("/sandboxes")
async def list_sandboxes_v1(request: Request, who: Tenant, svc: Svc) -> JSONResponse:
    return await list_sandboxes(request, who, svc, state="running", limit=MAX_PAGE)


def _metadata_filter(raw: str | None) -> dict[str, str]:
    """E2B sends `metadata=k=v&k2=v2` with keys and values percent-encoded once more."""
    if not raw:
        return {}
    pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=False)
    return {unquote(key): unquote(value) for key, value in pairs}


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, who: Tenant, svc: Svc) -> dict[str, Any]:
    sandbox = await _live(svc, who, sandbox_id)
    return _listed(sandbox) | {
        "envdAccessToken": e2b_auth.envd_token(svc.settings.secret, sandbox.name),
        "allowInternetAccess": sandbox.network,
        "network": e2b_network_out(sandbox),
        "domain": svc.settings.e2b_domain,
    }


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(sandbox_id: str, body: NetworkUpdate, who: Tenant, svc: Svc) -> Response:
    extra = body.model_extra or {}
    policy = parse_policy(
        e2b_network(body.allowInternetAccess, body.model_dump(exclude_none=True) | extra)
    )
    await svc.sandboxes.set_network(who, sandbox_id, policy)
    return Response(status_code=204)


# -- change ---------------------------------------------------------------------------------
@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(sandbox_id: str, who: Tenant, svc: Svc) -> Response:
    sandbox = await _live(svc, who, sandbox_id)
    await svc.sandboxes.stop(sandbox, "deleted", reason=None)
    return Response(status_code=204)


async def _extend(svc: Services, who: TenantId, sandbox_id: str, seconds: float) -> Sandbox:
    if seconds > svc.settings.max_timeout:
        raise InvalidRequestError(f"timeout is at most {svc.settings.max_timeout:g} seconds")
    try:
        return await svc.sandboxes.extend(who, sandbox_id, seconds)
    except ConflictError as exc:
        if exc.code == "not_running":
            raise NotFoundError(f"sandbox {sandbox_id} not found ({exc.message})") from None
        raise


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: TimeoutBody, who: Tenant, svc: Svc) -> Response:
    await _extend(svc, who, sandbox_id, float(body.timeout))
    return Response(status_code=204)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/connect")
async def connect(sandbox_id: str, body: ConnectBody, who: Tenant, svc: Svc) -> JSONResponse:
    """A running sandbox answers at once; a timeout only ever lengthens its life."""
    sandbox = await _live(svc, who, sandbox_id)
    if sandbox.state != "running":
        raise ConflictError(f"sandbox {sandbox_id} is still starting; connect again shortly")
    if body.timeout:
        wanted = utcnow() + timedelta(seconds=body.timeout)
        if sandbox.expires_at is None or wanted > sandbox.expires_at:
            sandbox = await _extend(svc, who, sandbox_id, float(body.timeout))
    return JSONResponse(_created(svc, sandbox), status_code=200)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(sandbox_id: str, who: Tenant, svc: Svc) -> list[dict[str, Any]]:
    """One sample, measured now by the sandbox's worker (sandgate keeps no history)."""
    await _live(svc, who, sandbox_id)
    sample = await svc.toolbox.metrics(who, sandbox_id)
    return [
        {
            "timestamp": _iso(datetime.fromtimestamp(sample.timestamp, tz=UTC)),
            "timestampUnix": int(sample.timestamp),
            "cpuCount": sample.cpu_count,
            "cpuUsedPct": round(sample.cpu_used_pct, 2),
            "memUsed": sample.mem_used,
            "memTotal": sample.mem_total,
            "memCache": sample.mem_cache,
            "diskUsed": sample.disk_used,
            "diskTotal": sample.disk_total,
        }
    ]


# -- not yet --------------------------------------------------------------------------------
# what is asked for -> (what it is, what to do instead, if anything)
NOT_YET = MappingProxyType(
    {
        "pause": ("pausing a sandbox (pause/resume)", "kill it and create a new one instead"),
        "resume": ("pausing a sandbox (pause/resume)", "kill it and create a new one instead"),
        "fork": ("forking a sandbox", ""),
        "snapshots": ("snapshots", ""),
        "refreshes": ("refreshes", "use set_timeout instead"),
        "logs": ("sandbox logs", ""),
    }
)


def _not_yet(what: str, instead: str = "") -> None:
    message = f"sandgate does not support {what} yet (see docs/e2b.md)"
    raise NotSupportedError(f"{message}: {instead}" if instead else message)


@router.api_route("/sandboxes/{sandbox_id}/{action}", methods=["GET", "POST", "PUT"])
@router.api_route("/v2/sandboxes/{sandbox_id}/{action}", methods=["GET", "POST", "PUT"])
async def unsupported_action(sandbox_id: str, action: str, who: Tenant) -> None:
    if action not in NOT_YET:
        raise NotFoundError(f"no E2B endpoint /sandboxes/{{id}}/{action} here (see docs/e2b.md)")
    _not_yet(*NOT_YET[action])


@router.api_route("/snapshots", methods=["GET", "POST"])
@router.api_route("/snapshots/{rest:path}", methods=["GET", "POST", "DELETE"])
async def unsupported_snapshots(who: Tenant) -> None:
    _not_yet("snapshots")


@router.api_route("/templates", methods=["GET", "POST"])
@router.api_route("/templates/{rest:path}", methods=["GET", "POST", "PATCH", "DELETE"])
@router.api_route("/v2/templates", methods=["GET", "POST"])
@router.api_route("/v2/templates/{rest:path}", methods=["GET", "POST", "PATCH", "DELETE"])
@router.api_route("/v3/templates", methods=["GET", "POST"])
@router.api_route("/v3/templates/{rest:path}", methods=["GET", "POST", "PATCH", "DELETE"])
async def unsupported_templates(who: Tenant) -> None:
    _not_yet(
        "building or managing templates through E2B's API",
        "import images with sandgate templates import or POST /api/v1/templates, then pass "
        "their name as templateID",
    )
