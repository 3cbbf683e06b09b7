"""`GET /api/v1/admin/state`: this instance's in-process state (docs/state.md), with the size
of each piece now, for an admin key (the portal's admin view)."""

from __future__ import annotations

from collections.abc import Sized
from typing import Annotated, Any

from fastapi import APIRouter, Depends

from sandgate.api.deps import Services, Viewer, services, viewer
from sandgate.api.responses import VIEWER, error_docs
from sandgate.control.admission import instance_label
from sandgate.control.state import SERVER_STATE
from sandgate.errors import ForbiddenError

router = APIRouter(prefix="/api/v1/admin", tags=["admin"])

Who = Annotated[Viewer, Depends(viewer)]
Svc = Annotated[Services, Depends(services)]


@router.get("/state", responses=error_docs(VIEWER, 403))
async def server_state(who: Who, svc: Svc) -> dict[str, Any]:
    """Each row of the server's state table: what it holds, its bound, what it becomes with N
    instances, and `size` (entries held now by the instance that answered; null where the
    piece is not a collection)."""
    if not who.admin:
        raise ForbiddenError("the state table takes an admin key")
    rows = []
    for name, row in SERVER_STATE.items():
        owner, _, attribute = name.partition(".")
        held = getattr(svc.state, attribute, None) if owner == "ServerLocalState" else None
        rows.append(
            {
                "name": name,
                "holds": row.holds,
                "bound": row.bound,
                "under_n_instances": row.under_n_instances,
                "size": len(held) if isinstance(held, Sized) else None,
            }
        )
    return {"instance": instance_label(svc.workers.node_url), "rows": rows}
