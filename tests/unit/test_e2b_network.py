"""E2B's allowInternetAccess and network config as sandgate policies (api/e2b/rest.py)."""

from __future__ import annotations

import pytest

from sandgate.api.e2b.rest import e2b_network
from sandgate.core.egress_policy import parse_policy
from sandgate.errors import NotSupportedError


def test_defaults_and_switches() -> None:
    assert e2b_network(None, None) is True  # E2B's default: the internet
    assert e2b_network(True, None) is True
    assert e2b_network(False, None) is False
    assert e2b_network(False, {"allowOut": ["pypi.org"]}) == {"allow_out": ["pypi.org"]}


def test_allow_out_wins_over_deny_out() -> None:
    allowlist = e2b_network(None, {"allowOut": ["pypi.org", "1.2.3.4"], "denyOut": ["0.0.0.0/0"]})
    assert allowlist == {"allow_out": ["pypi.org", "1.2.3.4"]}
    assert parse_policy(allowlist).allow_out.domains == ("pypi.org",)
    # allowOut alone restricts nothing in E2B
    assert e2b_network(None, {"allowOut": ["pypi.org"]}) is True
    assert e2b_network(None, {"denyOut": ["10.0.0.0/8"]}) == {"deny_out": ["10.0.0.0/8"]}
    # exceptions to a narrower denyOut are dropped: stricter than E2B
    assert e2b_network(None, {"allowOut": ["10.1.0.0/16"], "denyOut": ["10.0.0.0/8"]}) == {
        "deny_out": ["10.0.0.0/8"]
    }


def test_what_sandgate_does_not_do_is_refused() -> None:
    with pytest.raises(NotSupportedError, match="maskRequestHost"):
        e2b_network(None, {"maskRequestHost": "x.com"})
    assert e2b_network(None, {"dnsServers": ["8.8.8.8"], "allowPublicTraffic": True}) is True
