from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import time

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from sandgate.api.internal_auth import InternalAuth
from sandgate.core.signing import SignatureError, sign, signed_headers, verify


def check(
    headers: dict[str, str],
    *,
    secret: str = "s",
    body: bytes = b"x",
    now: float = 1000.0,
    path: str = "/internal/provision",
) -> None:
    verify(
        secret,
        "POST",
        path,
        body,
        timestamp=headers.get("x-sandgate-timestamp"),
        signature=headers.get("x-sandgate-signature"),
        now=now,
    )


def test_valid_and_refused() -> None:
    headers = signed_headers("s", "POST", "/internal/provision", 1000.0, b"x")
    check(headers)
    check(headers, now=1299.0)
    with pytest.raises(SignatureError, match="too old"):
        check(headers, now=1301.0)
    with pytest.raises(SignatureError, match="does not match"):
        check(headers, body=b"y")
    with pytest.raises(SignatureError, match="does not match"):
        check(headers, path="/internal/other")
    with pytest.raises(SignatureError, match="does not match"):
        check(headers, secret="other")
    with pytest.raises(SignatureError, match="unsigned"):
        check({})
    with pytest.raises(SignatureError, match="no shared secret"):
        check(headers, secret="")
    with pytest.raises(SignatureError, match="bad timestamp"):
        check({**headers, "x-sandgate-timestamp": "soon"})
    assert sign("s", "post", "/p", 1.0, b"") == sign("s", "POST", "/p", 1.0, b"")


def hmac_over(timestamp: str, *, secret: str = "s", body: bytes = b"x") -> str:
    """The HMAC a holder of the secret computes over `timestamp` spelled as given."""
    digest = hashlib.sha256(body).hexdigest()
    message = "\n".join(("POST", "/internal/provision", timestamp, digest))
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


# `float()` reads all but "abc" as a number. Each is signed with the real secret, over its own
# spelling and over the one `sign()` gives it, so only the timestamp check can refuse them
NOT_A_FRESH_TIMESTAMP = [
    "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e999", "-1e999", "1e3", "abc",
    " 1000.000", "1000.000\n", "1_000.000", "+1000.000", "1000", "1000.0", "1000.0000",
    "\u0661\u0660\u0660\u0660.000",  # ARABIC-INDIC DIGITS: float() reads 1000.0
]  # fmt: skip


@pytest.mark.parametrize("timestamp", NOT_A_FRESH_TIMESTAMP)
def test_timestamp_not_spelled_by_signed_headers_is_refused(timestamp: str) -> None:
    signatures = {hmac_over(timestamp)}
    try:
        signatures.add(sign("s", "POST", "/internal/provision", float(timestamp), b"x"))
    except ValueError:
        pass  # not a float at all
    for signature in signatures:
        headers = {"x-sandgate-timestamp": timestamp, "x-sandgate-signature": signature}
        with pytest.raises(SignatureError, match="bad timestamp"):
            check(headers)


def test_empty_timestamp_is_refused() -> None:
    headers = {"x-sandgate-timestamp": "", "x-sandgate-signature": hmac_over("")}
    with pytest.raises(SignatureError, match="unsigned"):
        check(headers)


def test_nan_clock_accepts_nothing() -> None:
    headers = signed_headers("s", "POST", "/internal/provision", 1000.0, b"x")
    with pytest.raises(SignatureError, match="too old"):
        check(headers, now=math.nan)


def test_internal_auth_answers_401_for_a_nan_timestamp() -> None:
    reached: list[str] = []

    async def handler(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def post(headers: dict[str, str]) -> httpx.Response:
        app = InternalAuth(handler, secret="s")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as client:
            return await client.post("/internal/provision", content=b"x", headers=headers)

    fresh = signed_headers("s", "POST", "/internal/provision", time.time(), b"x")
    assert asyncio.run(post(fresh)).status_code == 200
    for stamp in ("nan", "inf"):
        forged = {"x-sandgate-timestamp": stamp, "x-sandgate-signature": hmac_over(stamp)}
        response = asyncio.run(post(forged))
        assert response.status_code == 401, response.text
        assert "bad timestamp" in response.json()["error"]["message"]
    assert reached == ["/internal/provision"]
