"""Request dependencies: the app's services and the caller's tenant."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from sandgate.config import ServerSettings
from sandgate.control.admission import Admission
from sandgate.control.exec_jobs import ExecJobService
from sandgate.control.sandboxes import SandboxService
from sandgate.control.workers import WorkerRegistry
from sandgate.core.credentials import key_hash
from sandgate.errors import AuthError
from sandgate.local_state import ServerLocalState
from sandgate.store.base import ApiKey, Store, TenantId


@dataclass
class Services:
    settings: ServerSettings
    store: Store
    state: ServerLocalState
    workers: WorkerRegistry
    sandboxes: SandboxService
    exec_jobs: ExecJobService
    admission: Admission


def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


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


async def tenant(request: Request) -> TenantId:
    """The tenant of a tenant API key, within its rate limit. Worker tokens cannot call the API."""
    svc = services(request)
    record = await resolve_key(svc, presented_key(request.headers))
    if record.kind != "tenant" or record.tenant_id is None:
        raise AuthError("this is a worker token; the API takes tenant API keys")
    await svc.admission.check_rate(record.tenant_id)
    return record.tenant_id
