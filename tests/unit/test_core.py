"""Pure decisions: idempotency digest and fingerprint, names, credentials."""

from __future__ import annotations

import hashlib

import pytest

from sandgate.core import credentials, idempotency, names


def test_digest_includes_the_tenant() -> None:
    assert idempotency.digest("t1", "k") != idempotency.digest("t2", "k")
    assert idempotency.digest("t1", "k") == idempotency.digest("t1", "k")
    expected = hashlib.sha256(b"tenant:t1\x00key:k").hexdigest()
    assert idempotency.digest("t1", "k") == expected
    assert idempotency.short_digest(expected) == expected[:8]


def test_digest_has_no_ambiguous_concatenation() -> None:
    assert idempotency.digest("a", "bc") != idempotency.digest("ab", "c")


def test_fingerprint_ignores_key_order_only() -> None:
    a = idempotency.fingerprint({"a": 1, "b": {"x": [1, 2]}})
    assert a == idempotency.fingerprint({"b": {"x": [1, 2]}, "a": 1})
    assert a != idempotency.fingerprint({"a": 1, "b": {"x": [2, 1]}})
    assert idempotency.fingerprint({"timeout": 60}) != idempotency.fingerprint({"timeout": 61})


@pytest.mark.parametrize("key", ["", "x" * 256, "a b", "tab\t", "é", "\x00"])
def test_bad_keys_are_named(key: str) -> None:
    assert idempotency.validate_key(key)


@pytest.mark.parametrize("key", ["a", "x" * 255, "550e8400-e29b-41d4-a716-446655440000", "k:1/2"])
def test_good_keys(key: str) -> None:
    assert idempotency.validate_key(key) is None


def test_names_are_hostnames_and_unique() -> None:
    made = {names.new_sandbox_name() for _ in range(2000)}
    assert len(made) == 2000
    assert all(names.is_valid_name(n) and len(n) <= 63 for n in made)
    assert not names.is_valid_name("-bad")
    assert not names.is_valid_name("Bad")


def test_credentials() -> None:
    tenant_key = credentials.new_key("tenant")
    worker_key = credentials.new_key("worker")
    assert tenant_key.startswith("sg_") and worker_key.startswith("sgw_")
    assert len(tenant_key) > 40
    assert credentials.key_hash(tenant_key) == hashlib.sha256(tenant_key.encode()).hexdigest()
    assert credentials.key_hash(tenant_key) != credentials.key_hash(worker_key)
    admin_key = credentials.new_key("admin")
    assert admin_key.startswith("sga_") and len(admin_key) > 40
    # three distinct prefixes: none is a prefix of another
    prefixes = (credentials.TENANT_PREFIX, credentials.WORKER_PREFIX, credentials.ADMIN_PREFIX)
    assert all(a == b or not b.startswith(a) for a in prefixes for b in prefixes)
