"""Who is next in the create queue: tenants take turns, and a tenant at its share waits.

The rules, as pure functions. The store evaluates them in one SQL statement over the live
tickets (`sandgate.store.sql_admission`, `queue_position`), so every instance sees the same
order; the store tests check that the statement and `order` agree.

- **Turns** (round robin). A tenant's *streak* starts when its oldest live ticket was taken;
  a ticket's turn is its rank among its tenant's live tickets (1 for the oldest) plus the
  tenant's sandboxes placed during the streak (its live sandboxes created since then). The
  queue is served by turn, then by age (ticket id): with B's tickets B1..B10 queued before
  A's A1 the order is B1, A1, B2, B3, ... A turn does not change when a ticket places (its
  tenant has placed one more, its next ticket ranks one less), so B's next ticket never slips
  back ahead of A1: a tenant flooding the queue only lengthens its own line, and every
  waiting tenant places once per round.
- **Share** (`--tenant-share F`, unset by default). A tenant whose live sandboxes are at least
  F of the total capacity of the connected workers is *held*: its tickets come after every
  ticket of a tenant that is not held. It waits while others wait; it is not refused, and
  when only held tenants wait they are served in turn again (capacity is never left idle
  because of the share).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    """A live ticket: its id (the order it was taken in) and its tenant."""

    id: int
    tenant: str


def at_share(live: int, capacity: int, share: float | None) -> bool:
    """A tenant holding `live` of `capacity` slots is at (or over) its share. No share, or
    no capacity at all (nothing can place anyway): never."""
    if share is None or capacity <= 0:
        return False
    # live / capacity is rounded once, like `share` was: at exactly F it compares equal
    return live / capacity >= share


def order(
    tickets: Iterable[Waiting],
    served: Mapping[str, int] | None = None,
    held: Collection[str] = (),
) -> list[int]:
    """The ticket ids in the order the queue serves them; the first may place. `served`:
    each tenant's sandboxes placed during its streak (absent: none); `held`: the tenants at
    their share."""
    served = served or {}
    ranks: dict[str, int] = {}
    keyed: list[tuple[bool, int, int]] = []
    for ticket in sorted(tickets, key=lambda t: t.id):
        rank = ranks[ticket.tenant] = ranks.get(ticket.tenant, 0) + 1
        keyed.append((ticket.tenant in held, served.get(ticket.tenant, 0) + rank, ticket.id))
    return [ticket_id for _, _, ticket_id in sorted(keyed)]
