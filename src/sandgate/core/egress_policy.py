"""A sandbox's network policy and the operator's bounds on it: what the egress gate
(`worker/egress.py`) lets through. Pure: names, addresses and rules in, verdicts out.

A tenant's policy is one of:

* ``false``: no network (the sandbox has loopback only);
* ``true``: the public internet (whatever the operator allows);
* ``{"allow_out": [...], "deny_out": [...]}``: rules, each a domain (``pypi.org``,
  ``*.github.com``, ``*``), an IPv4 address or a CIDR (``10.1.2.0/24``).

A connection is judged by its name (TLS SNI or HTTP ``Host``, when it has one) and by the
address it was sent to, in this order, as E2B does: an ``allow_out`` match lets it through;
otherwise a ``deny_out`` match refuses it; otherwise it passes only if ``allow_out`` is empty
(``deny_out`` alone is a blocklist, ``allow_out`` an allowlist). A connection let through by
a domain is dialed by that name, not at the address the sandbox chose, so a spoofed address
cannot reach another host under an allowed name.

The operator's bounds (`OperatorBounds`) apply after that to every address the gate is about
to dial: never loopback, private, link-local, shared or reserved ranges (the cloud metadata
address is link-local) unless the operator permits a range explicitly.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from sandgate.errors import InvalidRequestError

MAX_RULES = 256  # entries in one of allow_out / deny_out
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")

# what no sandbox reaches unless the operator permits it (`--egress-permit`)
DEFAULT_DENY: tuple[str, ...] = (
    "0.0.0.0/8",  # "this" network
    "10.0.0.0/8",  # private
    "100.64.0.0/10",  # shared (carrier-grade NAT, Tailscale)
    "127.0.0.0/8",  # loopback
    "169.254.0.0/16",  # link-local, the cloud metadata address 169.254.169.254 included
    "172.16.0.0/12",  # private
    "192.0.0.0/24",  # IETF protocol assignments
    "192.0.2.0/24",  # documentation
    "192.168.0.0/16",  # private
    "198.18.0.0/15",  # benchmarking
    "198.51.100.0/24",  # documentation
    "203.0.113.0/24",  # documentation
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, broadcast
)

IPv4Net = ipaddress.IPv4Network

# what a worker numbers its sandboxes' links from (worker/netns.py): 16,384 /30s
DEFAULT_SANDBOX_SUBNET = "10.211.0.0/16"


class PolicyError(InvalidRequestError):
    code = "invalid_network_policy"


@dataclass(frozen=True)
class Rules:
    domains: tuple[str, ...] = ()  # "pypi.org", "*.github.com", "*"
    networks: tuple[IPv4Net, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.domains or self.networks)

    def name_matches(self, name: str) -> bool:
        return any(domain_matches(pattern, name) for pattern in self.domains)

    def address_matches(self, address: ipaddress.IPv4Address) -> bool:
        return any(address in net for net in self.networks)

    def as_list(self) -> list[str]:
        return [*self.domains, *(_net_text(net) for net in self.networks)]


@dataclass(frozen=True)
class NetworkPolicy:
    enabled: bool = False
    allow_out: Rules = Rules()
    deny_out: Rules = Rules()

    @property
    def open(self) -> bool:
        """True for the plain public internet: no rule of the tenant's."""
        return self.enabled and not self.allow_out and not self.deny_out

    @property
    def uses_names(self) -> bool:
        """Whether a verdict can depend on a connection's name (then the gate reads it)."""
        return bool(self.allow_out.domains or self.deny_out.domains)

    def to_json(self) -> bool | dict[str, list[str]]:
        return self.rules() or self.enabled

    def rules(self) -> dict[str, list[str]] | None:
        """Its rules as JSON, None when it has none (off, or the plain internet)."""
        if not self.enabled or self.open:
            return None
        return {"allow_out": self.allow_out.as_list(), "deny_out": self.deny_out.as_list()}


NO_NETWORK = NetworkPolicy()
OPEN = NetworkPolicy(enabled=True)


class Verdict(NamedTuple):
    allowed: bool
    reason: str  # why, for the log and the sandbox's refusal list
    dial_name: str | None = None  # dial this name (resolved by the gate), not the address


def normalize_name(name: str) -> str:
    return name.strip().rstrip(".").lower()


def domain_matches(pattern: str, name: str) -> bool:
    """``*`` matches every name; ``*.x.y`` every name below x.y (not x.y itself)."""
    name = normalize_name(name)
    if pattern == "*":
        return bool(name)
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and len(name) > len(pattern) - 1
    return name == pattern


def _net_text(net: IPv4Net) -> str:
    return str(net.network_address) if net.prefixlen == 32 else str(net)


def parse_rule(text: object) -> str | IPv4Net:
    """One rule: a domain pattern (normalized) or an IPv4 network; refuses anything else."""
    if not isinstance(text, str) or not text.strip():
        raise PolicyError(f"a network rule must be a domain or a CIDR, not {text!r}")
    value = text.strip().lower()
    try:
        net = ipaddress.ip_network(value, strict=False)
    except ValueError:
        pass
    else:
        if net.version != 4:
            raise PolicyError(
                f"{text!r}: sandboxes have IPv4 only (IPv6 is not routed); give an IPv4 CIDR"
            )
        return ipaddress.IPv4Network(net)
    name = value.rstrip(".")
    if name == "*":
        return name
    labels = name.removeprefix("*.").split(".")
    if len(name) > 253 or len(labels) < 2 or not all(_LABEL.match(label) for label in labels):
        raise PolicyError(
            f"{text!r} is neither a domain (like pypi.org or *.github.com) nor an IPv4 CIDR"
        )
    return name


def parse_rules(values: object, field: str) -> Rules:
    if values is None:
        return Rules()
    if not isinstance(values, list | tuple):
        raise PolicyError(f"{field} must be a list of domains and CIDRs")
    if len(values) > MAX_RULES:
        raise PolicyError(f"{field} holds {len(values)} rules; at most {MAX_RULES}")
    domains: list[str] = []
    networks: list[IPv4Net] = []
    for value in values:
        rule = parse_rule(value)
        if isinstance(rule, str):
            if rule not in domains:
                domains.append(rule)
        elif rule not in networks:
            networks.append(rule)
    return Rules(tuple(domains), tuple(networks))


def parse_policy(value: Any) -> NetworkPolicy:
    """A policy from what a request (or a stored row) says: a bool or a rules object."""
    if value is None or value is False:
        return NO_NETWORK
    if value is True:
        return OPEN
    if not isinstance(value, dict):
        raise PolicyError('network must be false, true or {"allow_out": [...], "deny_out": [...]}')
    unknown = set(value) - {"allow_out", "deny_out"}
    if unknown:
        raise PolicyError(f"unknown network field(s): {', '.join(sorted(unknown))}")
    return NetworkPolicy(
        enabled=True,
        allow_out=parse_rules(value.get("allow_out"), "allow_out"),
        deny_out=parse_rules(value.get("deny_out"), "deny_out"),
    )


def decide(policy: NetworkPolicy, *, name: str | None, address: ipaddress.IPv4Address) -> Verdict:
    """The tenant's verdict on one connection (the operator's bounds come after, on the
    address actually dialed: `OperatorBounds.permits`)."""
    if not policy.enabled:
        return Verdict(False, "the sandbox's network is off")
    if name is not None and policy.uses_names:
        name = normalize_name(name)
        if policy.allow_out.name_matches(name):
            return Verdict(True, f"{name} is in allow_out", dial_name=name)
        if policy.deny_out.name_matches(name):
            return Verdict(False, f"{name} is in deny_out")
    if policy.allow_out.address_matches(address):
        return Verdict(True, f"{address} is in allow_out")
    if policy.deny_out.address_matches(address):
        return Verdict(False, f"{address} is in deny_out")
    if policy.allow_out:
        what = f"{name} ({address})" if name else f"{address} (no name was sent)"
        return Verdict(False, f"{what} is not in allow_out")
    # a blocklist: a named connection is dialed by name, so the domains it denies cannot be
    # reached under another name's address either
    dial = normalize_name(name) if name is not None and policy.uses_names else None
    return Verdict(True, "not in deny_out", dial_name=dial)


def resolves(policy: NetworkPolicy, name: str) -> bool:
    """Whether the sandbox's DNS answers `name` (else NXDOMAIN). The gate decides anyway;
    this only spares a sandbox addresses it could not use."""
    if not policy.enabled:
        return False
    name = normalize_name(name)
    if policy.allow_out.name_matches(name):
        return True
    if policy.deny_out.name_matches(name):
        return False
    return not policy.allow_out


@dataclass(frozen=True)
class OperatorBounds:
    """What the operator lets any sandbox of a worker reach: every address outside `deny`,
    and inside it only what `permit` carves out."""

    deny: tuple[IPv4Net, ...]
    permit: tuple[IPv4Net, ...] = ()

    @classmethod
    def of(cls, deny: Iterable[str] = DEFAULT_DENY, permit: Iterable[str] = ()) -> OperatorBounds:
        def nets(values: Iterable[str]) -> tuple[IPv4Net, ...]:
            out = []
            for value in values:
                rule = parse_rule(value)
                if isinstance(rule, str):
                    raise PolicyError(f"operator bound {value!r}: give an IPv4 CIDR")
                out.append(rule)
            return tuple(out)

        return cls(deny=nets(deny), permit=nets(permit))

    def permits(self, address: ipaddress.IPv4Address) -> bool:
        if any(address in net for net in self.permit):
            return True
        return not any(address in net for net in self.deny)
