"""Each request's id and context (api/request_context.py, log_context.py): answered in
`X-Request-Id`, on every line logged while it is served (the access log's included), and on
the worker's lines for the tunnel calls it made."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from sandgate.cli import logs
from tests.fast.conftest import Fast

pytestmark = pytest.mark.anyio


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """The lines the JSON format writes, kept here (the handler logs.setup makes, with its
    formatter, writing to a buffer instead of stderr)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logs.setup("INFO", "json")
    buffer = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(buffer)
    try:
        yield buffer
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def records(buffer: io.StringIO) -> list[dict[str, object]]:
    found = []
    text, _ = buffer.getvalue(), buffer.truncate(0)
    buffer.seek(0)
    for line in text.splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


async def test_a_request_id_is_answered_and_on_every_line(
    fast: Fast, json_logs: io.StringIO
) -> None:
    made = await fast.api.post(
        "/api/v1/sandboxes", json={}, headers={"X-Request-Id": "client-chose-this"}
    )
    assert made.status_code == 201, made.text
    assert made.headers["x-request-id"] == "client-chose-this"
    name = made.json()["name"]
    lines = records(json_logs)
    access = [r for r in lines if r.get("message") == "http.request"]
    assert access[-1]["request_id"] == "client-chose-this"
    assert access[-1]["route"] == "/api/v1/sandboxes" and access[-1]["status"] == 201
    assert access[-1]["tenant"] and access[-1]["instance"]
    # the worker's own line for the provision this request made carries the same id
    started = [r for r in lines if r.get("message") == "sandbox.started"]
    assert [(r["sandbox"], r["request_id"]) for r in started] == [(name, "client-chose-this")]

    # no id, or one that is not an id: a new one, answered
    for sent in ({}, {"X-Request-Id": "a b\tc" * 20}):
        got = await fast.api.get(f"/api/v1/sandboxes/{name}", headers=sent)
        rid = got.headers["x-request-id"]
        assert len(rid) == 16 and rid.isalnum()
    lines = records(json_logs)
    looked = [r for r in lines if r.get("message") == "http.request"]
    assert all(r.get("sandbox") == name for r in looked)  # bound once the sandbox is known
    assert len({r["request_id"] for r in looked}) == 2
