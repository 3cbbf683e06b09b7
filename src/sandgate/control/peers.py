"""Calls to other instances (`/internal/*`), signed with the shared secret.

Only two things cross: a tunnel request for a worker whose tunnel the peer holds
(`/internal/tunnel-call`, a frame in and a frame out, so every toolbox path — files in
chunks, process output long-polls, terminal keys — is relayed the same way), and the
delivery of an accepted create (`/internal/provision`). Targets come only from the store's
`tunnel_owners`, never from anything a client or worker sent.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from sandgate.agent.frames import FrameError, Header, decode, encode
from sandgate.core.signing import signed_headers
from sandgate.errors import TunnelUnavailableError, UnavailableError
from sandgate.local_state import ServerLocalState
from sandgate.tunnel.rpc import remote_error

log = logging.getLogger(__name__)

FRAME_TYPE = "application/x-sandgate-frame"


class PeerMisconfiguredError(UnavailableError):
    code = "peer_misconfigured"


class PeerClient:
    def __init__(self, *, secret: str, state: ServerLocalState) -> None:
        self._secret = secret
        self._state = state
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, connect=3.0),
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def tunnel_call(
        self,
        node_url: str,
        worker: str,
        op: str,
        fields: dict[str, Any],
        payload: bytes,
        *,
        wait: float,
    ) -> tuple[Header, bytes]:
        body = encode({"worker": worker, "op": op, "fields": fields, "wait": wait}, payload)
        response = await self._post(node_url, "/internal/tunnel-call", body, FRAME_TYPE, wait)
        if response.headers.get("content-type", "").startswith(FRAME_TYPE):
            try:
                header, data = decode(response.content)
            except FrameError as exc:
                raise PeerMisconfiguredError(f"peer {node_url} sent a bad frame: {exc}") from None
            if not header.get("ok"):
                raise remote_error(header)
            return header, data
        raise self._error(node_url, response)

    async def provision(self, node_url: str, job_id: str, *, wait: float) -> dict[str, Any]:
        body = httpx.Request("POST", "/", json={"job_id": job_id}).content
        response = await self._post(node_url, "/internal/provision", body, "application/json", wait)
        if response.status_code == 200:
            sandbox: dict[str, Any] = response.json()
            return sandbox
        raise self._error(node_url, response)

    async def _post(
        self, node_url: str, path: str, body: bytes, content_type: str, wait: float
    ) -> httpx.Response:
        headers = signed_headers(self._secret, "POST", path, time.time(), body)
        headers["content-type"] = content_type
        try:
            response = await self._http.post(
                node_url.rstrip("/") + path,
                content=body,
                headers=headers,
                timeout=httpx.Timeout(wait + 5.0, connect=3.0),
            )
        except httpx.HTTPError as exc:
            raise TunnelUnavailableError(
                f"sandbox tunnel not available: its instance {node_url} did not answer ({exc!r})",
                retry_after=2.0,
            ) from None
        if response.headers.get("content-type", "").startswith("text/html"):
            problem = (
                f"peer {node_url} answered HTML to {path}: /internal/ must reach the sandgate "
                "server, not a static site or SPA catch-all in front of it"
            )
            self._state.peer_problems[node_url] = problem
            log.error("peer.misconfigured", extra={"peer": node_url, "problem": problem})
            raise PeerMisconfiguredError(problem, retry_after=30.0)
        self._state.peer_problems.pop(node_url, None)
        return response

    def _error(self, node_url: str, response: httpx.Response) -> Exception:
        try:
            error = response.json()["error"]
            code, message = str(error["code"]), str(error["message"])
        except (ValueError, KeyError, TypeError):
            return PeerMisconfiguredError(
                f"peer {node_url} answered {response.status_code} without a sandgate error"
            )
        if response.status_code == 401:
            log.error("peer.refused_signature", extra={"peer": node_url, "error": message})
            return PeerMisconfiguredError(
                f"peer {node_url} refused our signature ({message}); every instance needs the "
                "same --secret-file"
            )
        return remote_error({"error": {"code": code, "message": message}})
