"""The API's description: `/openapi.json` with its security schemes and the endpoints
OpenAPI cannot list itself, and `/docs` (Swagger UI) served from the package's own assets,
so it works offline (no CDN).

FastAPI builds the document from the routes; this adds what it does not know:
- the two ways to present a key (`Authorization: Bearer`, `X-API-Key`), for every route but
  the system ones, so Swagger UI has an Authorize button;
- the raw request bodies of file uploads and stdin (they are read as streams, not models);
- the WebSocket endpoints (the PTY, the tunnel), described where OpenAPI has room: the
  description of the API and of their tags.

And it takes out what FastAPI adds that is not so: a 422 of its own `{"detail": [...]}` on
every route with a parameter. Errors are `ErrorOut`, and each route lists its own statuses
(`api/responses.py`), 422 where it validates something.
"""

from __future__ import annotations

import json
from typing import Any, Final

import swagger_ui_bundle  # type: ignore[import-untyped]
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS: Final = "/docs/assets"
PUBLIC: Final = ("/healthz", "/readyz", "/metrics")  # no API key (metrics: its own token)


def _raw_body() -> dict[str, Any]:
    binary = {"schema": {"type": "string", "format": "binary"}}
    return {"required": True, "content": {"application/octet-stream": binary}}


def _security_schemes() -> dict[str, Any]:
    return {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "A tenant API key (`sandgate keys create --tenant NAME`), or an "
            "admin key for the fleet-wide views.",
        },
        "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
    }


DESCRIPTION: Final = """Control plane for code-execution sandboxes.

Authenticate with `Authorization: Bearer <api key>` or `X-API-Key: <api key>`. Errors are
`{"error": {"code", "message"}}`; a `Retry-After` header comes with 429 and 503.

WebSocket endpoints (not listed below, OpenAPI has no words for them):
- `GET /api/v1/sandboxes/{name}/toolbox/pty?token=...` — a terminal; get the token from
  `POST /api/v1/sandboxes/{name}/toolbox/pty`. Binary frames are the terminal's bytes, text
  frames JSON control messages (`{"resize": [cols, rows]}`).
- `GET /api/v1/sandboxes/{name}/ports/{port}/...` with `Upgrade: websocket` — a WebSocket
  server inside the sandbox, proxied.
- `GET /tunnel` — where workers dial in (worker tokens only).

The E2B-compatible surface shares the port (see docs/e2b.md); `/internal/*` is for peer
instances only.
"""


def install(app: FastAPI) -> None:
    """`/docs` from the package's Swagger UI, and the document's extras."""
    app.mount(ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")

    async def docs(_request: Request) -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="sandgate API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
        )

    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe(
                get_openapi(
                    title=app.title,
                    version=app.version,
                    description=DESCRIPTION,
                    routes=app.routes,
                )
            )
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]


def describe(doc: dict[str, Any]) -> dict[str, Any]:
    """Add the security schemes, the raw bodies, the system routes' openness."""
    doc.setdefault("components", {})["securitySchemes"] = _security_schemes()
    doc["security"] = [{"bearer": []}, {"apiKey": []}]
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            if path in PUBLIC:
                operation["security"] = []
            raw = (method == "put" and path.endswith("/toolbox/files")) or path.endswith("/stdin")
            if raw and "requestBody" not in operation:
                operation["requestBody"] = _raw_body()
            _drop_framework_422(operation)
    schemas = doc["components"].get("schemas", {})
    if _FRAMEWORK_422 not in json.dumps(doc.get("paths", {})):
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
    return doc


_FRAMEWORK_422: Final = "#/components/schemas/HTTPValidationError"


def _drop_framework_422(operation: dict[str, Any]) -> None:
    """FastAPI's 422 (`{"detail": [...]}`): never our answer (`api/errors.py` gives ErrorOut)."""
    responses = operation.get("responses", {})
    if _FRAMEWORK_422 in json.dumps(responses.get("422", {})):
        del responses["422"]
