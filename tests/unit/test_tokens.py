from __future__ import annotations

import pytest

from sandgate.core.tokens import TokenError, sign, verify


def test_round_trip_and_refusals() -> None:
    token = sign("s3cret", {"purpose": "pty", "exp": 100, "sandbox": "sbx-a", "tenant": "t"})
    claims = verify("s3cret", token, now=99, purpose="pty")
    assert claims["sandbox"] == "sbx-a"
    with pytest.raises(TokenError, match="expired"):
        verify("s3cret", token, now=100, purpose="pty")
    with pytest.raises(TokenError, match="signature"):
        verify("other", token, now=1, purpose="pty")
    with pytest.raises(TokenError, match="not for this use"):
        verify("s3cret", token, now=1, purpose="files")
    _body, mac = token.split(".")
    forged = sign("x", {"purpose": "pty", "exp": 10**12, "sandbox": "sbx-b", "tenant": "t"})
    with pytest.raises(TokenError):
        verify("s3cret", forged.split(".")[0] + "." + mac, now=1, purpose="pty")
    for bad in ("", ".", "abc", "a.b.c", "!!!.???", "x" * 5000):
        with pytest.raises(TokenError):
            verify("s3cret", bad, now=1, purpose="pty")
