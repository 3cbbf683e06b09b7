"""Request dependencies: the app's services and who calls.

Three kinds of key (`sandgate keys create`): a tenant key (`sg_`) calls the API as its
tenant; a worker token (`sgw_`) only dials `/tunnel`; an admin key (`sga_`) is an operator's
and reads the fleet-wide views (`GET /api/v1/workers`, `GET /api/v1/admission`) and nothing
else: on a tenant's routes it is refused with 403, since it belongs to no tenant. A tenant key
on those views gets its own, tenant-scoped numbers, never a 403.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from sandgate import log_context
from sandgate.api.metrics import ApiMetrics
from sandgate.config import ServerSettings
from sandgate.control.admission import Admission
from sandgate.control.builds import BuildService
from sandgate.control.contexts import ContextService
from sandgate.control.create import CreatePipeline
from sandgate.control.exec_jobs import ExecJobService
from sandgate.control.ports import PortService
from sandgate.control.sandboxes import SandboxService
from sandgate.control.state import ServerLocalState
from sandgate.control.templates import TemplateService
from sandgate.control.toolbox import Toolbox
from sandgate.control.workers import WorkerRegistry
from sandgate.control.workspaces import WorkspaceService
from sandgate.core.credentials import key_hash
from sandgate.errors import AuthError, ForbiddenError
from sandgate.store.base import ApiKey, Store, TenantId


@dataclass
class Services:
    settings: ServerSettings
    store: Store
    state: ServerLocalState
    workers: WorkerRegistry
    sandboxes: SandboxService
    creates: CreatePipeline  # the idempotent create: accept, deliver, recover
    toolbox: Toolbox  # every call into a running sandbox
    exec_jobs: ExecJobService
    admission: Admission
    contexts: ContextService  # code contexts (kernels) inside sandboxes
    templates: TemplateService  # what a create may start from; image imports
    builds: BuildService  # templates built from steps, in the tenants' sandboxes
    ports: PortService  # connections to servers inside sandboxes (previews)
    workspaces: WorkspaceService  # persistent trees with a git history
    metrics: ApiMetrics  # this instance's Prometheus series (GET /metrics)


def services_of(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


async def services(request: Request) -> Services:
    """The app's services, as a dependency. A coroutine on purpose: FastAPI runs a plain
    function dependency in its thread pool, a hop per request that cost more than the rest
    of the dependency work (the profile in docs/benchmarks.md)."""
    return services_of(request)


def presented_key(headers: dict[str, str] | object) -> str | None:
    get = getattr(headers, "get")  # noqa: B009 - Headers and dict share .get
    auth = get("authorization")
    if auth:
        scheme, _, value = str(auth).partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    api_key = get("x-api-key")
    return str(api_key).strip() if api_key else None


async def resolve_key(svc: Services, key: str | None) -> ApiKey:
    if not key:
        raise AuthError("missing credentials: send Authorization: Bearer <api key> or X-API-Key")
    digest = key_hash(key)
    record = svc.state.cached_key(digest, svc.settings.auth_cache_ttl)
    if record is None:
        record = await svc.store.find_api_key(digest)
        if record is None:
            raise AuthError("unknown API key; create one with `sandgate keys create --tenant NAME`")
        svc.state.cache_key(record)
    return record


def tenant_of(record: ApiKey) -> TenantId:
    """The tenant of a tenant API key; any other kind of key is refused."""
    if record.kind == "admin":
        raise ForbiddenError(
            "this is an admin key: it reads only the fleet-wide views (GET /api/v1/workers, "
            "GET /api/v1/admission); a tenant's routes take that tenant's API key "
            "(sandgate keys create --tenant NAME)"
        )
    if record.kind != "tenant" or record.tenant_id is None:
        raise AuthError("this is a worker token; the API takes tenant API keys")
    return record.tenant_id


async def tenant(request: Request) -> TenantId:
    """The tenant of a tenant API key, within its rate limit. Worker tokens cannot call the API;
    admin keys are refused (403)."""
    svc = services_of(request)
    who = tenant_of(await resolve_key(svc, presented_key(request.headers)))
    log_context.bind(tenant=who)
    await svc.admission.check_rate(who)
    return who


@dataclass(frozen=True)
class Viewer:
    """Who reads a view that is fleet-wide for an admin key and scoped for a tenant key:
    `tenant` is the tenant whose numbers are shown, None for an admin (the whole fleet)."""

    tenant: TenantId | None

    @property
    def admin(self) -> bool:
        return self.tenant is None


async def viewer(request: Request) -> Viewer:
    """An admin key (the fleet-wide view) or a tenant key (its own view, within its rate limit)."""
    svc = services_of(request)
    record = await resolve_key(svc, presented_key(request.headers))
    if record.kind == "admin":
        return Viewer(None)
    who = tenant_of(record)
    await svc.admission.check_rate(who)
    return Viewer(who)
