"""api/hot.py answers `execute` and a file's upload and download as the FastAPI routes do:
the same requests, sent to a deployment with the hot path and to one without it
(`hot_paths=False`), get the same status, media type, file headers and body (the sandbox's
name and the run's duration aside). And the hot path is the one answering: a valid request
never reaches the app behind it, an invalid one does."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandgate.api.hot import HotPaths
from tests.fast.conftest import Fast, fast_deployment

pytestmark = pytest.mark.anyio

JSON = {"Content-Type": "application/json"}
# (what it checks, tenant, headers, body, sandbox name or None for the tenant's own)
CASES: list[tuple[str, str, dict[str, str], bytes, str | None]] = [
    ("sh", "alpha", JSON, b'{"language": "sh", "code": "echo ok"}', None),
    ("bash, stderr, exit code", "alpha", JSON, b'{"code": "echo e >&2; exit 3"}', None),
    ("python", "alpha", JSON, b'{"language": "python", "code": "print(6*7)"}', None),
    (
        "env and cwd",
        "alpha",
        JSON,
        b'{"code": "echo $FOO; basename $PWD", "env": {"FOO": "b\\u00e4r"}, "cwd": "/tmp"}',
        None,
    ),
    (
        "charset",
        "alpha",
        {"Content-Type": "application/json; charset=utf-8"},
        b'{"code": "true"}',
        None,
    ),
    ("not UTF-8 output", "alpha", JSON, b'{"code": "printf \'\\\\377ok\'"}', None),
    ("timed out", "alpha", JSON, b'{"code": "sleep 5", "timeout": 0.3}', None),
    ("past the operator's bound", "alpha", JSON, b'{"code": "true", "timeout": 1e9}', None),
    ("no such cwd", "alpha", JSON, b'{"code": "true", "cwd": "/nowhere/at/all"}', None),
    ("no such sandbox", "alpha", JSON, b'{"code": "true"}', "sbx-nope"),
    ("another tenant's sandbox", "beta", JSON, b'{"code": "true"}', None),
    ("a wrong key", "wrong", JSON, b'{"code": "true"}', None),
    ("a wrong key and a bad body", "wrong", JSON, b'{"code": ""}', None),
    ("not JSON", "alpha", JSON, b"{", None),
    ("empty code", "alpha", JSON, b'{"code": ""}', None),
    ("unknown language", "alpha", JSON, b'{"language": "ruby", "code": "1"}', None),
    ("unknown field", "alpha", JSON, b'{"code": "true", "bogus": 1}', None),
    ("a list", "alpha", JSON, b"[]", None),
    ("a lone surrogate", "alpha", JSON, b'{"code": "echo \\ud800"}', None),
    ("no body", "alpha", JSON, b"", None),
    ("text/plain", "alpha", {"Content-Type": "text/plain"}, b'{"code": "true"}', None),
    ("no content type", "alpha", {}, b'{"code": "true"}', None),
]


BIG = bytes(range(256)) * (10 << 10)  # 2.5 MiB: streamed in chunks both ways
FILE = "/api/v1/sandboxes/{name}/toolbox/files"
# (what it checks, tenant, method, query, body, sandbox name or None for the tenant's own)
FILE_CASES: list[tuple[str, str, str, dict[str, str], bytes, str | None]] = [
    ("upload", "alpha", "PUT", {"path": "a.bin"}, b"\x00\xffdata", None),
    ("download", "alpha", "GET", {"path": "a.bin"}, b"", None),
    ("upload empty", "alpha", "PUT", {"path": "/tmp/empty"}, b"", None),
    ("download empty", "alpha", "GET", {"path": "/tmp/empty"}, b"", None),
    ("upload big", "alpha", "PUT", {"path": "big.bin"}, BIG, None),
    ("download big", "alpha", "GET", {"path": "big.bin"}, b"", None),
    ("unicode name", "alpha", "PUT", {"path": "d\u00e9j\u00e0 vu.txt"}, b"x", None),
    ("download unicode name", "alpha", "GET", {"path": "d\u00e9j\u00e0 vu.txt"}, b"", None),
    ("download missing", "alpha", "GET", {"path": "nope.txt"}, b"", None),
    ("download a directory", "alpha", "GET", {"path": "/workspace"}, b"", None),
    ("upload makes its directories", "alpha", "PUT", {"path": "no/such/dir/f"}, b"x", None),
    ("upload outside", "alpha", "PUT", {"path": "/etc/passwd"}, b"x", None),
    ("no path", "alpha", "GET", {}, b"", None),
    ("empty path", "alpha", "PUT", {"path": ""}, b"x", None),
    ("path too long", "alpha", "GET", {"path": "a" * 4097}, b"", None),
    ("no such sandbox file", "alpha", "GET", {"path": "a.bin"}, b"", "sbx-nope"),
    ("another tenant's file", "beta", "GET", {"path": "a.bin"}, b"", None),
    ("a wrong key file", "wrong", "PUT", {"path": "a.bin"}, b"x", None),
]
FILE_HEADERS = ("content-type", "content-length", "content-disposition")


def comparable(answer: httpx.Response, name: str) -> tuple[int, str, Any]:
    if not answer.headers.get("content-type", "").startswith("application/json"):
        kept = tuple(answer.headers.get(h) for h in FILE_HEADERS)
        return answer.status_code, str(kept), answer.content
    body = answer.json()
    if isinstance(body, dict):
        body.pop("duration_ms", None)
        body.pop("mtime", None)  # an upload's entry: when it was written
    text = json.dumps(body, sort_keys=True).replace(name, "<sandbox>")
    return answer.status_code, answer.headers.get("content-type", ""), json.loads(text)


async def left_mid_body(fast: Fast, name: str) -> tuple[int, str, Any]:
    """What an execute whose client left before its body came answers (status, body)."""
    key = fast.api.headers["authorization"].encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": f"/api/v1/sandboxes/{name}/execute",
        "raw_path": f"/api/v1/sandboxes/{name}/execute".encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"authorization", key)],
        "client": ("127.0.0.1", 1),
        "server": ("sandgate.test", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await fast.app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], "", json.loads(body)


async def answers(fast: Fast) -> dict[str, tuple[int, str, Any]]:
    made = await fast.api.post("/api/v1/sandboxes", json={})
    assert made.status_code == 201, made.text
    own = made.json()["name"]
    got: dict[str, Any] = {"left mid-body": await left_mid_body(fast, own)}
    clients = {"alpha": fast.api, "beta": fast.beta}
    for what, tenant, headers, body, name in CASES:
        client = clients.get(tenant, fast.api)
        if tenant not in clients:
            headers = {**headers, "Authorization": "Bearer sg_not_a_key"}
        answer = await client.post(
            f"/api/v1/sandboxes/{name or own}/execute", content=body, headers=headers
        )
        assert answer.headers.get("x-request-id"), what
        got[what] = comparable(answer, own)
    for what, tenant, method, query, body, name in FILE_CASES:
        client = clients.get(tenant, fast.api)
        headers = {} if tenant in clients else {"Authorization": "Bearer sg_not_a_key"}
        url = FILE.format(name=name or own)
        answer = await client.request(method, url, params=query, content=body, headers=headers)
        assert answer.headers.get("x-request-id"), what
        got[what] = comparable(answer, own)
    return got


async def test_the_hot_path_answers_as_the_route_does(tmp_path: Path) -> None:
    async with fast_deployment(tmp_path / "hot") as hot:
        with_hot = await answers(hot)
    async with fast_deployment(tmp_path / "cold", hot_paths=False) as cold:
        without = await answers(cold)
    assert with_hot == without
    # the cases cover each way out: a run, the route's refusal, auth, FastAPI's validation
    statuses = {what: status for what, (status, _, _) in with_hot.items()}
    assert statuses["sh"] == statuses["timed out"] == 200
    assert with_hot["sh"][2]["stdout"] == "ok\n"
    assert with_hot["not UTF-8 output"][2]["stdout"] == "\ufffdok"
    assert statuses["past the operator's bound"] == 400
    assert statuses["no such sandbox"] == statuses["another tenant's sandbox"] == 404
    assert statuses["a wrong key"] == statuses["a wrong key and a bad body"] == 401
    assert statuses["empty code"] == statuses["unknown language"] == 422
    assert statuses["not JSON"] == 400
    assert with_hot["left mid-body"][0] == 400  # FastAPI's answer to a body it cannot read
    assert with_hot["download big"][2] == BIG and with_hot["download"][2] == b"\x00\xffdata"
    assert statuses["download missing"] == statuses["another tenant's file"] == 404
    assert statuses["no path"] == statuses["empty path"] == statuses["path too long"] == 422
    assert statuses["upload outside"] == 403 and statuses["a wrong key file"] == 401


async def test_a_valid_request_never_reaches_the_app_behind(fast: Fast) -> None:
    reached: list[str] = []

    async def behind(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    made = await fast.api.post("/api/v1/sandboxes", json={})
    execute = f"/api/v1/sandboxes/{made.json()['name']}/execute"
    hot = HotPaths(behind, fastapi=fast.app)
    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=hot),
        base_url="http://sandgate.test",
        headers=fast.api.headers,
    )
    async with client:
        ran = await client.post(execute, json={"code": "echo hot"})
        assert (ran.status_code, ran.json()["stdout"]) == (200, "echo hot\n".split()[1] + "\n")
        assert reached == []
        for body in (b'{"code": ""}', b"{"):
            sent = await client.post(execute, content=body, headers=JSON)
            assert sent.status_code == 599
        assert (await client.get(execute)).status_code == 599
        assert (await client.post(execute + "/x", json={"code": "true"})).status_code == 599
        files = execute.replace("/execute", "/toolbox/files")
        put = await client.put(files, params={"path": "h.txt"}, content=b"hot")
        assert (put.status_code, put.json()["size"]) == (200, 3)
        got = await client.get(files, params={"path": "h.txt"})
        assert (got.status_code, got.content) == (200, b"hot")
        assert reached[4:] == []
        for query in ({}, {"path": ""}, {"path": ["a", "b"]}):
            assert (await client.get(files, params=query)).status_code == 599
        assert (await client.delete(files, params={"path": "h.txt"})).status_code == 599
    assert len(reached) == 8
    assert all(
        re.fullmatch(r"/api/v1/sandboxes/[^/]+/(execute(/x)?|toolbox/files)", p) for p in reached
    )
