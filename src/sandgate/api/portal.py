"""The web portal at `/ui`: the single-page app built from `portal/` (Vite) into
`api/portal_static/`, shipped in the package, so it works offline with no step of its own.

`/ui/assets/*` are the build's files (content-hashed names: cached for good); any other path
under `/ui` answers `index.html`, so the app's own paths survive a reload. The catch-all is
only under `/ui`: `/api`, `/internal`, `/tunnel` and E2B's paths never answer HTML, and a
missing asset is a 404, not the page. Not built (a checkout without npm): `/ui` says how.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import Scope

STATIC = Path(__file__).with_name("portal_static")
PREFIX = "/ui"
NOT_BUILT = (
    "The portal is not built in this installation. Build it with `scripts/install` "
    "(it runs `npm ci && npm run build` in portal/; needs Node.js 20 and npm). "
    "The API works without it: /docs.\n"
)


class _Assets(StaticFiles):
    """The build's hashed files: immutable, so browsers keep them."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        if response.status_code == 200:
            response.headers["Cache-Control"] = "public, max-age=31536000, immutable"
        return response


def install(app: FastAPI, static: Path = STATIC) -> None:
    index = static / "index.html"
    if (static / "assets").is_dir():
        app.mount(f"{PREFIX}/assets", _Assets(directory=static / "assets"), name="portal-assets")

    async def page(_request: Request) -> Response:
        if not index.is_file():
            return PlainTextResponse(NOT_BUILT, status_code=503)
        # the page names the current assets: never cached, so a new build is picked up
        return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})

    async def home(_request: Request) -> Response:
        return RedirectResponse(f"{PREFIX}/", status_code=307)

    app.add_api_route("/", home, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route(PREFIX, page, methods=["GET", "HEAD"], include_in_schema=False)
    app.add_api_route(
        PREFIX + "/{path:path}", page, methods=["GET", "HEAD"], include_in_schema=False
    )
