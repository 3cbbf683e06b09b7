"""core/egress_policy: tenant rules, their order, and the operator's bounds."""

from __future__ import annotations

from ipaddress import IPv4Address

import pytest

from sandgate.core.egress_policy import (
    NO_NETWORK,
    OPEN,
    OperatorBounds,
    PolicyError,
    decide,
    domain_matches,
    parse_policy,
    resolves,
)

A = IPv4Address


def test_parse_and_round_trip() -> None:
    assert parse_policy(False) is NO_NETWORK and parse_policy(None) is NO_NETWORK
    assert parse_policy(True) is OPEN
    policy = parse_policy({"allow_out": ["PyPI.org.", "*.github.com", "10.1.2.3/24", "1.2.3.4"]})
    assert policy.to_json() == {
        "allow_out": ["pypi.org", "*.github.com", "10.1.2.0/24", "1.2.3.4"],
        "deny_out": [],
    }
    assert parse_policy(policy.to_json()) == policy
    assert parse_policy({}).to_json() is True  # no rules: the public internet


@pytest.mark.parametrize(
    "bad",
    [
        {"allow_out": "pypi.org"},
        {"allow_out": [""]},
        {"allow_out": ["not a name"]},
        {"allow_out": ["localhost"]},
        {"allow_out": ["::1/128"]},
        {"allow_out": ["a.*.com"]},
        {"allow": ["pypi.org"]},
        {"allow_out": ["x.com"] * 0 + [f"h{i}.com" for i in range(300)]},
        "yes",
    ],
)
def test_bad_policies_are_refused(bad: object) -> None:
    with pytest.raises(PolicyError):
        parse_policy(bad)


def test_domain_patterns() -> None:
    assert domain_matches("pypi.org", "PYPI.org.")
    assert not domain_matches("pypi.org", "files.pypi.org")
    assert domain_matches("*.github.com", "api.github.com")
    assert domain_matches("*.github.com", "a.b.github.com")
    assert not domain_matches("*.github.com", "github.com")
    assert not domain_matches("*.github.com", "evilgithub.com")
    assert domain_matches("*", "anything.test")


def test_allowlist_dials_allowed_names_by_name_and_refuses_the_rest() -> None:
    policy = parse_policy({"allow_out": ["allowed.test", "10.9.0.0/16"]})
    verdict = decide(policy, name="Allowed.Test", address=A("1.1.1.1"))
    assert verdict.allowed and verdict.dial_name == "allowed.test"
    assert not decide(policy, name="denied.test", address=A("1.1.1.1")).allowed
    assert not decide(policy, name=None, address=A("1.1.1.1")).allowed  # a raw address
    by_cidr = decide(policy, name=None, address=A("10.9.3.4"))
    assert by_cidr.allowed and by_cidr.dial_name is None
    assert resolves(policy, "allowed.test") and not resolves(policy, "denied.test")


def test_allow_wins_over_deny_and_deny_alone_is_a_blocklist() -> None:
    policy = parse_policy({"allow_out": ["ok.test"], "deny_out": ["0.0.0.0/0"]})
    assert decide(policy, name="ok.test", address=A("8.8.8.8")).allowed
    assert not decide(policy, name="no.test", address=A("8.8.8.8")).allowed
    block = parse_policy({"deny_out": ["*.evil.test", "9.9.9.0/24"]})
    assert not decide(block, name="www.evil.test", address=A("1.1.1.1")).allowed
    assert not decide(block, name=None, address=A("9.9.9.9")).allowed
    fine = decide(block, name="good.test", address=A("1.1.1.1"))
    assert fine.allowed and fine.dial_name == "good.test"  # so its name cannot be spoofed
    assert decide(block, name=None, address=A("1.1.1.1")).allowed
    assert resolves(block, "good.test") and not resolves(block, "x.evil.test")


def test_open_and_off() -> None:
    verdict = decide(OPEN, name="x.test", address=A("1.1.1.1"))
    assert verdict.allowed and verdict.dial_name is None  # dialed where the sandbox asked
    assert not decide(NO_NETWORK, name="x.test", address=A("1.1.1.1")).allowed
    assert resolves(OPEN, "x.test") and not resolves(NO_NETWORK, "x.test")


def test_operator_bounds() -> None:
    bounds = OperatorBounds.of(permit=["10.77.0.0/16"])
    for forbidden in ("127.0.0.1", "10.0.0.1", "169.254.169.254", "192.168.1.1", "172.20.0.1"):
        assert not bounds.permits(A(forbidden)), forbidden
    assert bounds.permits(A("10.77.3.4"))
    assert bounds.permits(A("93.184.216.34"))
    with pytest.raises(PolicyError):
        OperatorBounds.of(permit=["example.com"])
