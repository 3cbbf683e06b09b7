"""The pure parts of the E2B surface: routing, credentials, the list's metadata filter.

Checked against the E2B SDK's own functions where it has them (its URL signing), so a
signature the SDK makes is one sandgate accepts.
"""

from __future__ import annotations

import urllib.parse
from typing import Literal

import httpx
import pytest
from e2b.sandbox.signature import get_signature

from sandgate.api.e2b.rest import _metadata_filter
from sandgate.api.e2b.routing import Route, route, sandbox_of_host
from sandgate.core import e2b_auth


def headers(**given: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in given.items()]


def test_routing_by_header_by_host_and_by_path() -> None:
    envd = route("/files", headers(E2b_Sandbox_Id="sbx-abc", E2b_Sandbox_Port="49983"), None)
    assert envd == Route("envd", "sbx-abc", "49983")
    # the header wins over the path: /health and /sandboxes exist on both sides
    assert route("/sandboxes", headers(E2b_Sandbox_Id="sbx-a"), None).to == "envd"
    assert route("/v2/sandboxes", headers(Host="x"), None).to == "e2b_rest"
    assert route("/sandboxes/sbx-a/timeout", [], None).to == "e2b_rest"
    assert route("/templates/t/builds", [], None).to == "e2b_rest"
    assert route("/api/v1/sandboxes", [], None).to == "native"
    assert route("/sandboxesx", [], None).to == "native"
    assert route("/health", [], None).to == "native"
    by_host = route("/files", headers(Host="49983-sbx-abc.e2b.test:443"), "e2b.test")
    assert by_host == Route("envd", "sbx-abc", "49983")
    # without a domain configured, a Host routes nothing
    assert route("/files", headers(Host="49983-sbx-abc.e2b.test"), None).to == "native"


@pytest.mark.parametrize(
    ("host", "found"),
    [
        ("49983-sbx-abc.e2b.test", ("49983", "sbx-abc")),
        ("8080-sbx-abc.E2B.test.", ("8080", "sbx-abc")),
        ("49983-sbx-abc.e2b.test:8443", ("49983", "sbx-abc")),
        ("api.e2b.test", None),
        ("e2b.test", None),
        ("49983-sbx-abc.other.test", None),
        ("x49983-sbx-abc.e2b.test", None),
        ("4998300-sbx-abc.e2b.test", None),
        ("49983-.e2b.test", None),
        ("49983-sbx_bad!.e2b.test", None),
        ("49983-a.b.e2b.test", None),  # a sandbox name has no dot
        ("49983-sbx-abc.evil-e2b.test", None),
    ],
)
def test_sandbox_of_host(host: str, found: tuple[str, str] | None) -> None:
    assert sandbox_of_host(host, "e2b.test") == found


def test_tokens_are_per_sandbox_and_per_secret() -> None:
    token = e2b_auth.envd_token("secret", "sbx-a")
    assert e2b_auth.token_matches("secret", "sbx-a", token)
    assert not e2b_auth.token_matches("secret", "sbx-b", token)
    assert not e2b_auth.token_matches("other", "sbx-a", token)
    assert not e2b_auth.token_matches("secret", "sbx-a", None)
    assert not e2b_auth.token_matches("secret", "sbx-a", token[:-1])
    assert not e2b_auth.token_matches("", "sbx-a", e2b_auth.envd_token("", "sbx-a"))


@pytest.mark.parametrize("user", [None, "user"])
@pytest.mark.parametrize("expires_in", [None, 60])
def test_signatures_the_sdk_makes_are_accepted(user: str | None, expires_in: int | None) -> None:
    token = e2b_auth.envd_token("secret", "sbx-a")
    path = "/home/user/a b.txt"
    made = get_signature(path, "read", user, token, expires_in)
    expiration = made["expiration"]

    def check(
        *, operation: Literal["read", "write"] = "read", expires: str | None, now: float
    ) -> None:
        e2b_auth.check_file_signature(
            token=token,
            path=path,
            operation=operation,
            username=user,
            signature=made["signature"],
            expiration=expires,
            now=now,
        )

    given = None if expiration is None else str(expiration)
    check(expires=given, now=0 if expiration is None else expiration - 1)
    with pytest.raises(e2b_auth.SignatureRefused):
        check(operation="write", expires=given, now=0)
    if expiration is not None:
        with pytest.raises(e2b_auth.SignatureRefused, match="expired"):
            check(expires=given, now=expiration + 1)
        for bad in ("1e9", "-5", "nan", "１２３"):
            with pytest.raises(e2b_auth.SignatureRefused):
                check(expires=bad, now=0)


def test_the_metadata_filter_decodes_what_the_sdk_encodes() -> None:
    wanted = {"a b": "c&d", "k=1": "v%2", "ünï": "ok"}
    # the SDK's encoding (e2b/sandbox_sync/paginator.py): each key and value quoted, the
    # pairs urlencoded, then the whole sent as one query parameter
    quoted = {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in wanted.items()}
    url = httpx.URL("http://x/v2/sandboxes", params={"metadata": urllib.parse.urlencode(quoted)})
    received = httpx.QueryParams(url.query).get("metadata")
    assert _metadata_filter(received) == wanted
    assert _metadata_filter(None) == {} and _metadata_filter("") == {}
