"""The create queue's rules: tenants take turns, a tenant at its share waits behind others."""

from __future__ import annotations

import pytest

from sandgate.core.fair_queue import Waiting, at_share, order


def tickets(spec: str) -> list[Waiting]:
    """'BBA' -> B's ticket 1, B's ticket 2, A's ticket 3."""
    return [Waiting(i + 1, tenant) for i, tenant in enumerate(spec)]


def served(spec: str, placed: dict[str, int] | None = None, held: tuple[str, ...] = ()) -> str:
    by_id = {t.id: t.tenant for t in tickets(spec)}
    return "".join(by_id[i] for i in order(tickets(spec), placed, held))


def test_one_tenant_is_first_in_first_out() -> None:
    assert order(tickets("AAAA")) == [1, 2, 3, 4]
    assert order(tickets("AAAA"), {"A": 3}) == [1, 2, 3, 4]


def test_tenants_take_turns_whatever_their_number_of_tickets() -> None:
    # B flooded the queue with 10 before A came: A is served second, not eleventh
    assert order(tickets("B" * 10 + "A")) == [1, 11, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert served("BBBAAC") == "BACBAB"
    assert served("ABAB") == "ABAB"


def test_a_turn_does_not_change_when_a_ticket_places() -> None:
    b2, b3, a1 = Waiting(2, "B"), Waiting(3, "B"), Waiting(4, "A")
    # B1 (ticket 1) placed and left: by rank alone B2 would slip back ahead of A1...
    assert order([b2, b3, a1]) == [2, 4, 3]
    # ...but B placed one during its streak: A1 is next
    assert order([b2, b3, a1], {"B": 1}) == [4, 2, 3]
    # A1 placed too, A2 queued meanwhile: B2 and A2 alternate again
    assert order([b2, b3, Waiting(5, "A")], {"B": 1, "A": 1}) == [2, 5, 3]


def test_order_depends_on_ticket_ids_not_on_how_they_are_listed() -> None:
    listed = list(reversed(tickets("BBBAAC")))
    assert order(listed) == order(tickets("BBBAAC"))


def test_a_held_tenant_waits_behind_every_other_tenant() -> None:
    assert served("BBBA", held=("B",)) == "ABBB"
    assert served("BBACA", held=("B",)) == "ACABB"
    assert served("BAA", {"A": 5}, held=("B",)) == "AAB"
    # when only held tenants wait they take turns again: nothing is left idle
    assert served("BBAA", held=("A", "B")) == "BABA"
    assert served("BBB", held=("B",)) == "BBB"


def test_at_share_is_at_least_the_fraction_of_the_capacity() -> None:
    assert not at_share(14, 16, None)  # no share configured
    assert at_share(8, 16, 0.5) and not at_share(7, 16, 0.5)
    assert at_share(3, 10, 0.3)  # exactly at a share that is not exact in binary
    assert not at_share(2, 10, 0.3)
    assert at_share(1, 3, 1 / 3)
    assert at_share(16, 16, 1.0) and not at_share(15, 16, 1.0)
    assert not at_share(0, 16, 0.01)  # a tenant holding nothing is never held


@pytest.mark.parametrize("capacity", [0, -1])
def test_no_connected_capacity_holds_nobody(capacity: int) -> None:
    assert not at_share(5, capacity, 0.5)
