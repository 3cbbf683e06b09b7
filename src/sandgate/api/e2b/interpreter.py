"""E2B's code interpreter (`E2b-Sandbox-Port: 49999`) over the code contexts of the sandbox.

`POST /execute` `{code, context_id?, language?, env_vars?}` streams NDJSON lines as the
`e2b_code_interpreter` SDK parses them: `number_of_executions`, `stdout`/`stderr` `{text,
timestamp}`, `result` (a MIME bundle), `error` `{name, value, traceback}`, and
`end_of_execution` last; `keepalive` whenever 5 s pass without a line (a quiet cell),
which the SDK skips. Without a context it runs in the sandbox's default one. `/contexts`
creates, lists, deletes and restarts contexts; `/health` answers 204. Errors are plain text
with their status, which is what this SDK reads (404 NotFound, 502 timeout, others raised
with the text).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from sandgate.api import errors as api_errors
from sandgate.api.beats import keep_alive
from sandgate.api.deps import Services
from sandgate.api.e2b.caller import EnvdCaller
from sandgate.control.contexts import LANGUAGES, Context
from sandgate.errors import InvalidRequestError, SandgateError

INTERPRETER_PORT = 49999
MAX_BODY = 8 << 20
KEEPALIVE_SECONDS = 5.0  # E2B's own server beats this often
KEEPALIVE_LINE = b'{"type":"keepalive"}\n'


def _context_out(context: Context) -> dict[str, str]:
    return {"id": context.id, "language": context.language, "cwd": context.cwd}


async def _json(request: Request) -> dict[str, Any]:
    body = await request.body()
    if len(body) > MAX_BODY:
        raise InvalidRequestError(f"the request body is over {MAX_BODY} bytes")
    try:
        found = json.loads(body or b"{}")
    except ValueError:
        raise InvalidRequestError("the request body is not JSON") from None
    if not isinstance(found, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return found


async def serve(request: Request, svc: Services, who: EnvdCaller) -> Response:
    try:
        return await _route(request, svc, who)
    except SandgateError as exc:
        # plain text, as E2B's own server answers; and when to retry, as ours always do
        return PlainTextResponse(
            exc.message,
            status_code=api_errors.status_of(exc),
            headers=api_errors.retry_headers(exc),
        )


async def _route(request: Request, svc: Services, who: EnvdCaller) -> Response:
    path, method = request.url.path.rstrip("/") or "/", request.method
    contexts = svc.contexts
    if path == "/health":
        return Response(status_code=204)
    if path == "/execute" and method == "POST":
        return await _execute(await _json(request), svc, who)
    if path == "/contexts" and method == "POST":
        body = await _json(request)
        context = await contexts.create(
            who.tenant,
            who.sandbox,
            language=str(body.get("language") or "python"),
            cwd=str(body["cwd"]) if body.get("cwd") else None,
        )
        return Response(json.dumps(_context_out(context)), media_type="application/json")
    if path == "/contexts" and method == "GET":
        found = [_context_out(c) for c in await contexts.list(who.tenant, who.sandbox)]
        return Response(json.dumps(found), media_type="application/json")
    parts = path.split("/")
    if len(parts) == 3 and parts[1] == "contexts" and method == "DELETE":
        await contexts.delete(who.tenant, who.sandbox, parts[2])
        return Response(status_code=204)
    if len(parts) == 4 and parts[1] == "contexts" and parts[3] == "restart" and method == "POST":
        await contexts.restart(who.tenant, who.sandbox, parts[2])
        return Response(status_code=204)
    return PlainTextResponse(f"the code interpreter has no {method} {path}", status_code=404)


async def _execute(body: dict[str, Any], svc: Services, who: EnvdCaller) -> Response:
    code = body.get("code")
    if not isinstance(code, str):
        raise InvalidRequestError("code (a string) is required")
    context_id, language = body.get("context_id"), body.get("language")
    if context_id and language:
        raise InvalidRequestError("give a context_id or a language, not both")
    env = body.get("env_vars") or {}
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise InvalidRequestError("env_vars must be an object of strings")
    if language not in (None, *LANGUAGES):
        raise InvalidRequestError(
            f"language {language!r} has no kernel here; use one of {', '.join(LANGUAGES)}"
        )
    events = await svc.contexts.start_run(
        who.tenant,
        who.sandbox,
        str(context_id) if context_id else None,
        code,
        env=env,
        language=str(language) if language else None,
    )

    async def lines() -> AsyncIterator[bytes]:
        async for event in keep_alive(events, KEEPALIVE_SECONDS):
            if event is None:
                yield KEEPALIVE_LINE
            else:
                yield (json.dumps(event, separators=(",", ":")) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")
