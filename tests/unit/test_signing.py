from __future__ import annotations

import pytest

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
