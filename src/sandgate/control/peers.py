"""Calls to other instances (`/internal/*`), signed with the shared secret.

Only two things cross: tunnel requests for a worker whose tunnel the peer holds, and the
delivery of an accepted create (`POST /internal/provision`). Tunnel requests travel over one
long-lived WebSocket per peer (`/internal/peer`, signed at the handshake) carrying the same
frames and request/response channel as the tunnels themselves, so every toolbox path — files
in chunks, process output long-polls, terminal keys — is relayed the same way, with no new
connection per request. Targets come only from the store's `tunnel_owners`, never from
anything a client or worker sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

from sandgate import log_context
from sandgate.agent.frames import MAX_PAYLOAD_BYTES, Header, decode
from sandgate.control.state import ServerLocalState
from sandgate.core.signing import signed_headers
from sandgate.errors import TunnelUnavailableError, UnavailableError
from sandgate.tunnel.rpc import LinkClosedError, RpcChannel, remote_error

log = logging.getLogger(__name__)


class PeerMisconfiguredError(UnavailableError):
    code = "peer_misconfigured"


class PeerClient:
    def __init__(self, *, secret: str, state: ServerLocalState) -> None:
        self._secret = secret
        self._state = state
        self._links: set[asyncio.Task[None]] = set()  # serve loops of open peer links
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, connect=3.0),
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
        )

    async def aclose(self) -> None:
        for task in list(self._links):
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)
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
        channel = await self._link(node_url)
        request = {"worker": worker, "op_": op, "fields": fields, "wait": wait}
        return await channel.request("tunnel", request, payload, wait=wait + 5.0)

    async def _link(self, node_url: str) -> RpcChannel:
        """The open link to a peer, dialing it once (concurrent callers share the dial)."""
        pending = self._state.peer_links.get(node_url)
        if pending is not None:
            if not pending.done():
                return await asyncio.shield(pending)
            if not pending.exception() and not pending.result().closed:
                return pending.result()
        future: asyncio.Future[RpcChannel] = asyncio.get_running_loop().create_future()
        self._state.peer_links[node_url] = future
        try:
            channel = await self._dial(node_url)
        except BaseException as exc:
            self._state.peer_links.pop(node_url, None)
            error = exc if isinstance(exc, Exception) else TunnelUnavailableError("cancelled")
            future.set_exception(error)
            future.exception()
            raise
        future.set_result(channel)
        return channel

    async def _dial(self, node_url: str) -> RpcChannel:
        path = "/internal/peer"
        url = node_url.rstrip("/").replace("https://", "wss://").replace("http://", "ws://") + path
        headers = signed_headers(self._secret, "GET", path, time.time(), b"")
        try:
            ws = await connect(
                url,
                additional_headers=headers,
                max_size=MAX_PAYLOAD_BYTES + (2 << 20),
                open_timeout=3,
                ping_interval=10,
                ping_timeout=20,
                compression=None,
            )
        except InvalidStatus as exc:
            raise self._refused(node_url, exc.response.status_code, exc.response.headers) from None
        except (OSError, TimeoutError, WebSocketException) as exc:
            raise TunnelUnavailableError(
                f"sandbox tunnel not available: its instance {node_url} did not answer ({exc!r})",
                retry_after=2.0,
            ) from None

        async def send(frame: bytes) -> None:
            try:
                await ws.send(frame)
            except (ConnectionClosed, OSError) as exc:
                # the peer link is gone: calls waiting on it fail now, callers get a 503
                lost = LinkClosedError(
                    f"sandbox tunnel not available: the link to its instance {node_url} "
                    f"dropped ({type(exc).__name__})",
                    retry_after=1.0,
                )
                channel.close(lost)
                raise lost from None

        async def frames() -> tuple[Header, bytes] | None:
            try:
                message = await ws.recv()
            except ConnectionClosed:
                return None
            return decode(message if isinstance(message, bytes) else message.encode())

        channel = RpcChannel(send, name=f"peer {node_url}")

        async def serve() -> None:
            try:
                await channel.serve(frames)
            except Exception:
                log.warning("peer.link_failed", extra={"peer": node_url}, exc_info=True)
            finally:
                await ws.close()
                link = self._state.peer_links.get(node_url)
                if link is not None and link.done() and not link.exception():
                    if link.result() is channel:
                        self._state.peer_links.pop(node_url, None)

        task = asyncio.create_task(serve())  # owned here; cancelled in aclose()
        self._links.add(task)
        task.add_done_callback(self._links.discard)
        self._state.peer_problems.pop(node_url, None)
        log.info("peer.linked", extra={"peer": node_url})
        return channel

    def _refused(self, node_url: str, status: int, headers: Any) -> Exception:
        if str(headers.get("content-type", "")).startswith("text/html"):
            return self._html(node_url, "/internal/peer")
        if status == 401:
            log.error("peer.refused_signature", extra={"peer": node_url})
            return PeerMisconfiguredError(
                f"peer {node_url} refused our signature; every instance needs the same "
                "--secret-file"
            )
        return PeerMisconfiguredError(f"peer {node_url} refused the peer link ({status})")

    def _html(self, node_url: str, path: str) -> PeerMisconfiguredError:
        problem = (
            f"peer {node_url} answered HTML to {path}: /internal/ must reach the sandgate "
            "server, not a static site or SPA catch-all in front of it"
        )
        self._state.peer_problems[node_url] = (problem, time.monotonic())
        log.error("peer.misconfigured", extra={"peer": node_url, "problem": problem})
        return PeerMisconfiguredError(problem, retry_after=30.0)

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
        if (rid := log_context.request_id()) is not None:  # the peer's lines say it too
            headers[log_context.HEADER] = rid
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
            raise self._html(node_url, path)
        self._state.peer_problems.pop(node_url, None)
        return response

    def _error(self, node_url: str, response: httpx.Response) -> Exception:
        try:
            error = response.json()["error"]
            message = str(error["message"])
            if not isinstance(error, dict) or not isinstance(error.get("code"), str):
                raise TypeError("no error code")
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
        return remote_error({"error": error})
