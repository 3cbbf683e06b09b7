"""Credentials of the E2B-compatible envd surface. Pure functions, the clock passed in.

E2B's SDKs authenticate envd traffic (processes, files, watches) with no API key: create and
connect answer an `envdAccessToken`, which the SDK then sends as `X-Access-Token`. Here that
token is an HMAC of the sandbox's name under the deployment's shared secret, so every instance
accepts a token another issued, and checking one needs no lookup: a request with a wrong or
missing token is refused before anything is read about the sandbox it names, whether or not
that sandbox exists.

File URLs (`Sandbox.download_url` / `upload_url`) carry a signature instead of the header:
"v1_" + base64 (standard alphabet, unpadded) of SHA-256 over
"{path}:{read|write}:{username or ''}:{token}" with ":{expiration}" appended when the URL
expires (unix seconds). The format is E2B's, so URLs the SDK signs are accepted as they are.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Literal

TOKEN_CONTEXT = b"sandgate e2b envd access token v1\n"
TRAFFIC_CONTEXT = b"sandgate e2b traffic access token v1\n"  # the code interpreter's
SIGNATURE_PREFIX = "v1_"

FileOperation = Literal["read", "write"]


def envd_token(secret: str, sandbox: str) -> str:
    """The access token of one sandbox: the same on every instance sharing `secret`."""
    mac = hmac.new(secret.encode(), TOKEN_CONTEXT + sandbox.encode(), hashlib.sha256).digest()
    return "sgt_" + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def traffic_token(secret: str, sandbox: str) -> str:
    """The token of a sandbox's other ports (E2B's `trafficAccessToken`): the code
    interpreter sends it on every request, where it sends the access token on some only."""
    mac = hmac.new(secret.encode(), TRAFFIC_CONTEXT + sandbox.encode(), hashlib.sha256).digest()
    return "sgp_" + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def token_matches(secret: str, sandbox: str, presented: str | None) -> bool:
    if not presented or not secret:
        return False
    return hmac.compare_digest(envd_token(secret, sandbox).encode(), presented.encode())


def traffic_token_matches(secret: str, sandbox: str, presented: str | None) -> bool:
    if not presented or not secret:
        return False
    return hmac.compare_digest(traffic_token(secret, sandbox).encode(), presented.encode())


def file_signature(
    path: str, operation: FileOperation, username: str | None, token: str, expiration: int | None
) -> str:
    raw = f"{path}:{operation}:{username or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    digest = hashlib.sha256(raw.encode()).digest()
    return SIGNATURE_PREFIX + base64.b64encode(digest).rstrip(b"=").decode()


class SignatureRefused(ValueError):
    """Why a signed file URL is not accepted (the message says what to do)."""


def check_file_signature(
    *,
    token: str,
    path: str,
    operation: FileOperation,
    username: str | None,
    signature: str,
    expiration: str | None,
    now: float,
) -> None:
    expires: int | None = None
    if expiration is not None:
        if not expiration.isascii() or not expiration.isdigit() or len(expiration) > 15:
            raise SignatureRefused("signature_expiration must be unix seconds")
        expires = int(expiration)
        if expires < now:
            raise SignatureRefused("this file URL has expired: ask the SDK for a new one")
    wanted = file_signature(path, operation, username, token, expires)
    if not hmac.compare_digest(wanted.encode(), signature.encode()):
        raise SignatureRefused(
            f"the signature does not match this {operation} of {path!r}: file URLs are signed "
            "for one path, operation and user"
        )
