"""`GET /api/v1/admission`: the create queue, the scheduling breaker and the caller's limits."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from sandgate.api.deps import Services, services, tenant
from sandgate.api.routes.sandboxes import error_docs
from sandgate.store.base import TenantId

router = APIRouter(prefix="/api/v1", tags=["admission"])

Tenant = Annotated[TenantId, Depends(tenant)]
Svc = Annotated[Services, Depends(services)]


@router.get("/admission", responses=error_docs())
async def admission_status(who: Tenant, svc: Svc) -> dict[str, Any]:
    """Deployment-wide: queue length, breaker state and recent scheduling timeouts (another
    tenant's sandbox names are left out); and the limits configured for the caller."""
    return await svc.admission.status(who)
