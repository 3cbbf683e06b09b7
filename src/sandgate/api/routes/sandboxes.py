"""`/api/v1/sandboxes`: create, list, get, delete, extend, network, execute."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import JSONResponse

from sandgate.api.deps import Services, services, tenant
from sandgate.api.responses import (
    AGENT,
    JSON_BODY,
    PARAMS,
    SANDBOX,
    TENANT,
    WORKER,
    error_docs,
    replayed,
)
from sandgate.api.schemas import (
    CreateSandbox,
    Execute,
    ExecuteOut,
    ExtendTimeout,
    NetworkField,
    NetworkOut,
    NetworkRules,
    SandboxList,
    SandboxOut,
    SetNetwork,
)
from sandgate.config import ServerSettings
from sandgate.control.create import CreateRequest
from sandgate.control.templates import Resolved
from sandgate.core import caps
from sandgate.core.egress_policy import NetworkPolicy, parse_policy
from sandgate.core.workspaces import ResolvedMount, parse_mounts
from sandgate.errors import InvalidRequestError
from sandgate.store.base import Sandbox, SandboxFilter, SandboxName, TenantId

router = APIRouter(prefix="/api/v1", tags=["sandboxes"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]

STATES = ("pending", "running", "stopped", "error", "deleted")


def sandbox_out(sandbox: Sandbox) -> dict[str, Any]:
    return SandboxOut(
        name=sandbox.name,
        state=sandbox.state,
        template=sandbox.template,
        metadata=sandbox.metadata,
        worker=sandbox.worker,
        network=sandbox.network,
        network_policy=(
            None
            if sandbox.network_policy is None
            else NetworkRules.model_validate(sandbox.network_policy)
        ),
        resources=sandbox.resources,
        workspaces=[
            {"name": m.get("name", ""), "path": m.get("path", "")} for m in sandbox.workspaces or ()
        ],
        timeout=sandbox.timeout,
        created_at=sandbox.created_at,
        started_at=sandbox.started_at,
        expires_at=sandbox.expires_at,
        error=sandbox.error,
    ).model_dump(mode="json")


def create_request(
    body: CreateSandbox,
    settings: ServerSettings,
    template: Resolved,
    mounts: tuple[tuple[ResolvedMount, ...], str | None] = ((), None),
) -> CreateRequest:
    """What the create pipeline is asked for: the deployment's defaults filled in, its caps
    checked, its template resolved (the native API and E2B's both create through this)."""
    timeout = body.timeout if body.timeout is not None else settings.default_timeout
    if timeout > settings.max_timeout:
        raise InvalidRequestError(f"timeout is at most {settings.max_timeout:g} seconds")
    resources = caps.resolve(body.resources.model_dump(), settings.caps)
    policy = policy_of(body.network)
    return CreateRequest(
        template=template.name,
        timeout=timeout,
        metadata=body.metadata,
        env=body.env,
        network=policy.enabled,
        network_policy=policy.rules(),
        resources=resources,
        # fingerprinted with what it gets: a retry naming the defaults is the same request
        body=body.model_dump(mode="json") | {"timeout": timeout, "resources": resources},
        pool=body.pool,
        image=template.image,
        workspaces=mounts[0],
        worker=mounts[1],
    )


# a template or workspace not found (404), a workspace busy elsewhere or the sandbox deleted
# while it started (409), the queue or a quota full (429), no worker for it (501, 503), its
# start failed (502) or timed out (504)
@router.post(
    "/sandboxes",
    status_code=201,
    response_model=SandboxOut,
    responses={
        200: {
            "model": SandboxOut,
            "description": "A retry with the same Idempotency-Key: the sandbox it made.",
            "headers": replayed(),
        },
        **error_docs(TENANT, JSON_BODY, 404, 409, 501, 502, 504),
    },
)
async def create_sandbox(
    body: CreateSandbox,
    who: Tenant,
    svc: Svc,
    http: Request,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    template = await svc.templates.resolve(who, body.template)
    wanted = parse_mounts(
        body.workspace,
        None if body.workspaces is None else [m.model_dump() for m in body.workspaces],
    )
    mounts = await svc.workspaces.resolve(who, wanted)
    request = create_request(body, svc.settings, template, mounts)
    result = await svc.creates.create(who, request, idempotency_key, http.is_disconnected)
    if mounts[0] and result.sandbox.worker is not None:
        await svc.workspaces.placed(mounts[0], result.sandbox.worker)
    svc.metrics.created(result.sandbox, replayed=result.replayed)
    if result.replayed:
        return JSONResponse(
            sandbox_out(result.sandbox), status_code=200, headers={"Idempotent-Replayed": "true"}
        )
    return JSONResponse(sandbox_out(result.sandbox), status_code=201)


@router.get("/sandboxes", response_model=SandboxList, responses=error_docs(TENANT, PARAMS, 400))
async def list_sandboxes(
    request: Request,
    who: Tenant,
    svc: Svc,
    state: Annotated[str | None, Query(description="comma-separated states")] = None,
    cursor: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """The tenant's sandboxes, newest first, paged by `cursor`. Filter by metadata with any
    number of `metadata.KEY=VALUE` query parameters (all must match), e.g.
    `?metadata.agent=demo&metadata.run=7`."""
    states: tuple[Any, ...] = ()
    if state:
        states = tuple(s.strip() for s in state.split(",") if s.strip())
        unknown = [s for s in states if s not in STATES]
        if unknown:
            raise InvalidRequestError(
                f"unknown state {unknown[0]!r}; use one of {', '.join(STATES)}"
            )
    metadata = {
        key.removeprefix("metadata."): value
        for key, value in request.query_params.items()
        if key.startswith("metadata.") and len(key) > len("metadata.")
    }
    where = SandboxFilter(
        states=states,
        metadata=metadata,
        after=SandboxName(cursor) if cursor else None,
        limit=limit + 1,
    )
    found = await svc.sandboxes.list(who, where)
    page = found[:limit]
    next_cursor = page[-1].name if len(found) > limit else None
    return {"sandboxes": [sandbox_out(s) for s in page], "next_cursor": next_cursor}


@router.get("/sandboxes/{name}", response_model=SandboxOut, responses=error_docs(TENANT, 404))
async def get_sandbox(name: str, who: Tenant, svc: Svc) -> dict[str, Any]:
    return sandbox_out(await svc.sandboxes.get(who, name))


@router.delete("/sandboxes/{name}", status_code=204, responses=error_docs(TENANT, 404))
async def delete_sandbox(name: str, who: Tenant, svc: Svc) -> Response:
    await svc.sandboxes.delete(who, name)
    return Response(status_code=204)


@router.post(
    "/sandboxes/{name}/timeout",
    response_model=SandboxOut,
    responses=error_docs(TENANT, JSON_BODY, SANDBOX),
)
async def extend_timeout(name: str, body: ExtendTimeout, who: Tenant, svc: Svc) -> dict[str, Any]:
    if body.timeout > svc.settings.max_timeout:
        raise InvalidRequestError(f"timeout is at most {svc.settings.max_timeout:g} seconds")
    return sandbox_out(await svc.sandboxes.extend(who, name, body.timeout))


def policy_of(network: NetworkField) -> NetworkPolicy:
    """A request's `network` as a policy (bad rules: 400 invalid_network_policy)."""
    return parse_policy(network if isinstance(network, bool) else network.model_dump())


def network_out(state: dict[str, Any]) -> dict[str, Any]:
    return NetworkOut.model_validate(state).model_dump(mode="json")


@router.get(
    "/sandboxes/{name}/network",
    response_model=NetworkOut,
    responses=error_docs(TENANT, SANDBOX, WORKER),
)
async def get_network(name: str, who: Tenant, svc: Svc) -> dict[str, Any]:
    """The running sandbox's network policy, and what its worker's egress gate let through
    and refused (with the last refusals: target and reason)."""
    return network_out(await svc.sandboxes.network(who, name))


@router.put(
    "/sandboxes/{name}/network",
    response_model=NetworkOut,
    responses=error_docs(TENANT, JSON_BODY, SANDBOX, WORKER, 501),  # 501: the runtime cannot
)
async def set_network(name: str, body: SetNetwork, who: Tenant, svc: Svc) -> dict[str, Any]:
    """Change the running sandbox's network: new connections and DNS queries follow the new
    policy at once (open connections stay); false takes its interface away."""
    return network_out(await svc.sandboxes.set_network(who, name, policy_of(body.network)))


async def run_execute(name: str, body: Execute, who: TenantId, svc: Services) -> dict[str, Any]:
    """What `execute` answers (also served by api/hot.py, outside FastAPI's routing)."""
    timeout = body.timeout if body.timeout is not None else svc.settings.default_exec_timeout
    if timeout > svc.settings.max_exec_timeout:
        raise InvalidRequestError(f"timeout is at most {svc.settings.max_exec_timeout:g} seconds")
    started = time.perf_counter()
    try:
        ran = await svc.toolbox.execute(
            who,
            name,
            body.code,
            language=body.language,
            time_limit=timeout,
            env=body.env,
            cwd=body.cwd,
        )
    except BaseException:
        svc.metrics.execute.labels("error").observe(time.perf_counter() - started)
        raise
    outcome = "timed_out" if ran.timed_out else "ok"
    svc.metrics.execute.labels(outcome).observe(time.perf_counter() - started)
    return {
        "stdout": ran.stdout,
        "stderr": ran.stderr,
        "exit_code": ran.exit_code,
        "duration_ms": ran.duration_ms,
        "timed_out": ran.timed_out,
        "stdout_truncated": ran.stdout_truncated,
        "stderr_truncated": ran.stderr_truncated,
        "oom_killed": ran.oom_killed,
    }


@router.post(
    "/sandboxes/execute", response_model=ExecuteOut, responses=error_docs(TENANT, JSON_BODY, AGENT)
)
async def execute_by_query(
    body: Execute, who: Tenant, svc: Svc, sandbox: Annotated[str, Query(min_length=1)]
) -> JSONResponse:
    # built from the validated reply already: skip a second validation on the hot path
    return JSONResponse(await run_execute(sandbox, body, who, svc))


@router.post(
    "/sandboxes/{name}/execute",
    response_model=ExecuteOut,
    responses=error_docs(TENANT, JSON_BODY, AGENT),
)
async def execute(name: str, body: Execute, who: Tenant, svc: Svc) -> JSONResponse:
    return JSONResponse(await run_execute(name, body, who, svc))
