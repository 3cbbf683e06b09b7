"""`GET /api/v1/admission`: the create queue, the scheduling breaker and the caller's limits."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from sandgate.api.deps import Services, Viewer, services, viewer
from sandgate.api.responses import VIEWER, error_docs

router = APIRouter(prefix="/api/v1", tags=["admission"])

Who = Annotated[Viewer, Depends(viewer)]
Svc = Annotated[Services, Depends(services)]


@router.get("/admission", responses=error_docs(VIEWER))
async def admission_status(who: Who, svc: Svc) -> dict[str, Any]:
    """A tenant key: its own queued creates, its own recent scheduling timeouts and its limits,
    with the deployment's breaker (it answers every tenant's creates). An admin key: the
    fleet-wide view, the whole queue and every recent timeout."""
    return await svc.admission.status(who.tenant)
