"""E2B's surface on the wire: routing by header and by Host, credentials, bad input.

Raw requests (what E2B's SDKs send, and what they must never be sent) against the real app
and worker of the in-process deployment; the SDKs themselves run in
tests/integration/api/test_e2b_sdk.py.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from sandgate.core import e2b_auth
from tests.fast.conftest import Fast, fast_deployment

pytestmark = pytest.mark.anyio
DOMAIN = "e2b.example.test"


@pytest.fixture
async def fast(tmp_path: Path) -> AsyncIterator[Fast]:
    async with fast_deployment(tmp_path, e2b_domain=DOMAIN) as deployment:
        yield deployment


async def create(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    created = await client.post("/v2/sandboxes", json={"templateID": "base", **body})
    assert created.status_code == 201, created.text
    found: dict[str, Any] = created.json()
    return found


def envd(sandbox: dict[str, Any], token: str | None = "own") -> dict[str, str]:
    headers = {"E2b-Sandbox-Id": sandbox["sandboxID"], "E2b-Sandbox-Port": "49983"}
    if token == "own":
        headers["X-Access-Token"] = sandbox["envdAccessToken"]
    elif token is not None:
        headers["X-Access-Token"] = token
    return headers


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(data)) + data


def frames(body: bytes) -> list[tuple[int, dict[str, Any]]]:
    out = []
    while body:
        flags, size = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5 : 5 + size])))
        body = body[5 + size :]
    return out


async def start(fast: Fast, headers: dict[str, str], cmd: str, **extra: str) -> httpx.Response:
    body = envelope({"process": {"cmd": "/bin/bash", "args": ["-c", cmd]}, "stdin": False})
    return await fast.api.post(
        "/process.Process/Start",
        content=body,
        headers={
            **headers,
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            **extra,
        },
    )


async def test_rest_errors_are_shaped_as_the_sdk_parses(fast: Fast) -> None:
    unknown = await fast.api.get("/sandboxes/sbx-nosuchsandbox")
    assert unknown.status_code == 404 and unknown.json()["code"] == 404
    bad = await fast.api.post("/v2/sandboxes", json={"envVars": {"1BAD": "x"}})
    assert bad.status_code == 400 and bad.json()["code"] == 400, bad.text
    assert "env" in bad.json()["message"]
    malformed = await fast.api.post(
        "/v2/sandboxes", content=b"{nope", headers={"Content-Type": "application/json"}
    )
    assert malformed.status_code == 400 and isinstance(malformed.json()["code"], int)
    template = await fast.api.post("/v2/sandboxes", json={"templateID": "nope"})
    assert template.status_code == 404 and "base" in template.json()["message"]
    paused = await fast.api.post("/v2/sandboxes", json={"autoPause": True})
    assert paused.status_code == 501 and "pausing" in paused.json()["message"]
    nokey = await httpx.AsyncClient(
        transport=fast.api._transport, base_url="http://sandgate.test"
    ).get("/v2/sandboxes")
    assert nokey.status_code == 401 and nokey.json()["code"] == 401
    sandbox = await create(fast.api)
    for path in ("pause", "fork", "snapshots"):
        answer = await fast.api.post(f"/sandboxes/{sandbox['sandboxID']}/{path}", json={})
        assert answer.status_code == 501 and answer.json()["code"] == 501, answer.text
    network = await fast.api.put(f"/sandboxes/{sandbox['sandboxID']}/network", json={})
    assert network.status_code == 501
    templates = await fast.api.post("/v3/templates", json={})
    assert templates.status_code == 501 and "templates" in templates.json()["message"]
    # another tenant's sandbox is an unknown one
    theirs = await fast.beta.get(f"/sandboxes/{sandbox['sandboxID']}")
    assert theirs.status_code == 404 and theirs.json() == unknown.json() | {
        "message": theirs.json()["message"]
    }
    assert (await fast.beta.delete(f"/sandboxes/{sandbox['sandboxID']}")).status_code == 404
    # the native API keeps its own shape on its own paths
    native = await fast.api.get("/api/v1/sandboxes/sbx-nosuchsandbox")
    assert native.status_code == 404 and native.json()["error"]["code"] == "not_found"


async def test_envd_credentials(fast: Fast) -> None:
    sandbox = await create(fast.api)
    ours = envd(sandbox)
    assert (await fast.api.get("/health", headers=ours)).status_code == 204
    missing = await fast.api.get("/health", headers=envd(sandbox, token=None))
    assert missing.status_code == 401 and "X-Access-Token" in missing.json()["message"]
    wrong = await fast.api.get("/health", headers=envd(sandbox, token="sgt_forged"))
    assert wrong.status_code == 502
    assert wrong.json()["message"] == f"The sandbox {sandbox['sandboxID']} was not found"
    # another tenant's sandbox, with that tenant's own valid token: as if it did not exist
    theirs = await create(fast.beta)
    borrowed = {**envd(theirs, token=sandbox["envdAccessToken"])}
    answer = await fast.api.get("/health", headers=borrowed)
    assert answer.status_code == 502 and "was not found" in answer.json()["message"]
    unknown_id = {"sandboxID": "sbx-unknownunknown", "envdAccessToken": "x"}
    token = e2b_auth.envd_token(fast.services.settings.secret, "sbx-unknownunknown")
    unknown = await fast.api.get("/health", headers=envd(unknown_id, token=token))
    assert unknown.status_code == 502 and "was not found" in unknown.json()["message"]
    # a user that is not the sandbox's
    root = await fast.api.get("/health", headers={**ours, "Authorization": "Basic cm9vdDo="})
    assert root.status_code == 400 and "unprivileged" in root.json()["message"]
    # killed: not found, with its own token
    assert (await fast.api.delete(f"/sandboxes/{sandbox['sandboxID']}")).status_code == 204
    dead = await fast.api.get("/health", headers=ours)
    assert dead.status_code == 502 and "was not found" in dead.json()["message"]


async def test_connect_bad_input_is_never_a_500(fast: Fast) -> None:
    sandbox = await create(fast.api)
    ours = envd(sandbox)
    unary = {**ours, "Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    malformed = await fast.api.post("/process.Process/List", content=b"{", headers=unary)
    assert malformed.status_code == 400, malformed.text
    assert malformed.json()["code"] == "invalid_argument"
    method = await fast.api.post("/process.Process/Nope", content=b"{}", headers=unary)
    assert method.status_code == 404 or method.json()["code"] == "unimplemented", method.text
    service = await fast.api.post("/nope.Service/Call", content=b"{}", headers=unary)
    assert service.status_code == 404 and isinstance(service.json()["code"], int)
    wrong_type = await fast.api.post(
        "/filesystem.Filesystem/Stat", content=b'{"path": 5}', headers=unary
    )
    assert wrong_type.status_code == 400 and wrong_type.json()["code"] == "invalid_argument"
    missing = await fast.api.post(
        "/filesystem.Filesystem/Stat", content=b'{"path": "/home/user/none"}', headers=unary
    )
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    outside = await fast.api.post(
        "/filesystem.Filesystem/Stat", content=b'{"path": "/etc/passwd"}', headers=unary
    )
    assert outside.status_code == 403 and outside.json()["code"] == "permission_denied"
    huge = await fast.api.post(
        "/process.Process/SendInput", content=b"{" + b" " * (5 << 20) + b"}", headers=unary
    )
    assert huge.status_code in (413, 429), huge.text  # over the body or the message cap
    stream = {**ours, "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    for body in (b"\x00\x00\x00", b"\x00\x00\x00\x00\x01{"):  # torn; not JSON
        torn = await fast.api.post("/process.Process/Start", content=body, headers=stream)
        assert torn.status_code == 200, torn.text  # a stream's error is its end message
        error = frames(torn.content)[-1][1]["error"]
        assert error["code"] in ("invalid_argument", "unimplemented"), error


async def test_start_stream_on_the_wire(fast: Fast) -> None:
    sandbox = await create(fast.api, envVars={"WHO": "wire"})
    answer = await start(fast, envd(sandbox), "echo $WHO; echo err >&2; exit 4")
    assert answer.status_code == 200, answer.text
    got = frames(answer.content)
    assert "start" in got[0][1]["event"] and got[0][1]["event"]["start"]["pid"] > 0
    assert got[-1] == (2, {})
    ends = [m["event"]["end"] for _, m in got[:-1] if "end" in m["event"]]
    assert ends == [{"exitCode": 4, "exited": True, "status": "exit status 4"}]
    out = b"".join(
        base64.b64decode(m["event"]["data"].get("stdout", ""))
        for _, m in got[:-1]
        if "data" in m["event"]
    )
    assert out == b"wire\n"


async def test_host_routing_and_signed_urls(fast: Fast) -> None:
    sandbox = await create(fast.api)
    sid, token = sandbox["sandboxID"], sandbox["envdAccessToken"]
    assert sandbox["domain"] == DOMAIN
    bare = httpx.AsyncClient(transport=fast.api._transport, base_url="http://x")
    host = {"Host": f"49983-{sid}.{DOMAIN}"}
    # no E2b-Sandbox-Id header: the Host names the sandbox
    health = await bare.get("/health", headers={**host, "X-Access-Token": token})
    assert health.status_code == 204
    # another port is a server in the sandbox (the port proxy), never public: a credential
    other_port = await bare.get("/", headers={"Host": f"8080-{sid}.{DOMAIN}"})
    assert other_port.status_code == 401 and "preview" in other_port.json()["error"]["message"]
    # an upload and a download by signed URL only, as a browser or curl would
    path = "/home/user/signed.txt"
    signed = e2b_auth.file_signature(path, "write", None, token, None)
    put = await bare.post(
        "/files?" + urlencode({"path": path, "signature": signed}),
        content=b"signed bytes",
        headers={**host, "Content-Type": "application/octet-stream"},
    )
    assert put.status_code == 200, put.text
    assert put.json() == [{"name": "signed.txt", "type": "file", "path": "/workspace/signed.txt"}]
    read = e2b_auth.file_signature(path, "read", None, token, 4_000_000_000)
    query = {"path": path, "signature": read, "signature_expiration": "4000000000"}
    got = await bare.get("/files?" + urlencode(query), headers=host)
    assert got.status_code == 200 and got.content == b"signed bytes"
    # the read signature does not write, nor read another path, nor outlive its expiry
    wrong_op = await bare.post(
        "/files?" + urlencode({"path": path, "signature": read}), content=b"x", headers=host
    )
    assert wrong_op.status_code == 401
    other = await bare.get("/files?" + urlencode({**query, "path": "/home/user/x"}), headers=host)
    assert other.status_code == 401
    old = e2b_auth.file_signature(path, "read", None, token, 1000)
    expired = {"path": path, "signature": old, "signature_expiration": "1000"}
    late = await bare.get("/files?" + urlencode(expired), headers=host)
    assert late.status_code == 401 and "expired" in late.json()["message"]
    missing = await bare.get(
        "/files?" + urlencode({"path": "/home/user/none"}),
        headers={**host, "X-Access-Token": token},
    )
    assert missing.status_code == 404 and missing.json()["code"] == 404
    # a Host of another domain is the native API's
    native = await bare.get("/healthz", headers={"Host": f"49983-{sid}.elsewhere.test"})
    assert native.status_code in (200, 404)
    assert "code" not in native.json() or not isinstance(native.json().get("code"), int)


async def test_multipart_uploads_with_directories(fast: Fast) -> None:
    sandbox = await create(fast.api)
    files = [
        ("file", ("/home/user/up/one.txt", b"one", "application/octet-stream")),
        ("file", ("up/deeper/two.bin", b"\x00\x01two", "application/octet-stream")),
    ]
    answer = await fast.api.post("/files", files=files, headers=envd(sandbox))
    assert answer.status_code == 200, answer.text
    assert [e["path"] for e in answer.json()] == [
        "/workspace/up/one.txt",
        "/workspace/up/deeper/two.bin",
    ]
    got = await fast.api.get("/files", params={"path": "up/deeper/two.bin"}, headers=envd(sandbox))
    assert got.content == b"\x00\x01two"
    torn = await fast.api.post(
        "/files?path=x",
        content=b"--b\r\nContent-Disposition: form-data; name=file; filename=x\r\n\r\nabc",
        headers={**envd(sandbox), "Content-Type": "multipart/form-data; boundary=b"},
    )
    assert torn.status_code == 400, torn.text
    assert (
        await fast.api.get("/files", params={"path": "x"}, headers=envd(sandbox))
    ).status_code == 404, "a torn upload leaves no file"


async def test_a_user_other_than_the_sandboxes_is_a_connect_error(fast: Fast) -> None:
    sandbox = await create(fast.api)
    root = {**envd(sandbox), "Authorization": "Basic cm9vdDo="}  # "root:"
    unary = {**root, "Content-Type": "application/json", "Connect-Protocol-Version": "1"}
    listed = await fast.api.post("/process.Process/List", content=b"{}", headers=unary)
    assert listed.status_code == 400, listed.text
    assert listed.json()["code"] == "invalid_argument"
    assert "unprivileged" in listed.json()["message"]
    streamed = await start(fast, root, "echo never")
    assert streamed.status_code == 200
    assert frames(streamed.content)[-1][1]["error"]["code"] == "invalid_argument"
    user = {**envd(sandbox), "Authorization": "Basic dXNlcjo="}  # "user:": the sandbox's
    assert (await start(fast, user, "echo fine")).status_code == 200
    upload = await fast.api.post(
        "/files", params={"path": "x", "username": "root"}, content=b"x", headers=envd(sandbox)
    )
    assert upload.status_code == 400 and upload.json()["code"] == 400


async def test_stream_input_feeds_a_process(fast: Fast) -> None:
    sandbox = await create(fast.api)
    headers = {
        **envd(sandbox),
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
    }
    body = envelope({"process": {"cmd": "/bin/bash", "args": ["-c", "cat"]}, "stdin": True})
    events: list[dict[str, Any]] = []

    async def follow() -> None:
        async with fast.api.stream(
            "POST", "/process.Process/Start", content=body, headers=headers
        ) as answer:
            events.extend(m for _, m in frames(await answer.aread()))

    task = asyncio.create_task(follow())
    pid = None
    for _ in range(500):
        processes = await fast.api.post(
            "/process.Process/List",
            content=b"{}",
            headers={**envd(sandbox), "Content-Type": "application/json"},
        )
        running = processes.json().get("processes", [])
        if running:
            pid = running[0]["pid"]
            break
        await asyncio.sleep(0.01)
    assert pid is not None
    chunk = base64.b64encode(b"streamed in\n").decode()
    stream = b"".join(
        [
            envelope({"start": {"process": {"pid": pid}}}),
            envelope({"data": {"input": {"stdin": chunk}}}),
            envelope({"keepalive": {}}),
        ]
    )
    fed = await fast.api.post("/process.Process/StreamInput", content=stream, headers=headers)
    assert fed.status_code == 200, fed.text
    assert frames(fed.content)[-1] == (2, {})
    closed = await fast.api.post(
        "/process.Process/CloseStdin",
        content=json.dumps({"process": {"pid": pid}}).encode(),
        headers={**envd(sandbox), "Content-Type": "application/json"},
    )
    assert closed.status_code == 200, closed.text
    await asyncio.wait_for(task, 10)
    out = b"".join(
        base64.b64decode(m["event"]["data"]["stdout"])
        for m in events
        if "event" in m and "data" in m["event"]
    )
    assert out == b"streamed in\n"
    ends = [m["event"]["end"] for m in events if "event" in m and "end" in m["event"]]
    assert ends and ends[0].get("exitCode", 0) == 0


async def test_a_gzip_upload_is_inflated_into_the_file(fast: Fast) -> None:
    """An octet-stream upload with `Content-Encoding: gzip` (E2B's SDK may send one): the file
    is the inflated bytes, here 40 MiB from a body of ~40 KiB, inflated a piece at a time."""
    sandbox = await create(fast.api)
    sid, token = sandbox["sandboxID"], sandbox["envdAccessToken"]
    bare = httpx.AsyncClient(transport=fast.api._transport, base_url="http://x")
    host = {"Host": f"49983-{sid}.{DOMAIN}", "X-Access-Token": token}
    data = b"sandgate " * 1000 + bytes(40 << 20)
    put = await bare.post(
        "/files?" + urlencode({"path": "/home/user/big.bin"}),
        content=gzip.compress(data),
        headers={**host, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"},
    )
    assert put.status_code == 200, put.text
    got = await bare.get("/files?" + urlencode({"path": "/home/user/big.bin"}), headers=host)
    assert got.status_code == 200 and got.content == data
