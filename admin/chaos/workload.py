"""The request stream of a chaos run: a seeded mix of reserve / confirm / release / restock with replays,
cycle counts and replenishments to par (writes their worker decides from what it reads under the lease),
and with a flash sale, bursts of reservations of the hot SKU. Both runs of a seed send the same stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from admin.chaos.options import FLASH_BURST, HOT_SKU, INITIAL_STOCK, Options
from reservations.inventory import Inventory

# Every SKU's par level: above the initial stock, so a replenishment orders units from the start.
PAR = INITIAL_STOCK + 10
# A count finds up to this many units fewer than its worker reads (theft, damage, miscounted picks).
MAX_SHRINKAGE = 2


@dataclass
class Sent:
    key: str
    operation: str
    kwargs: dict[str, Any]


def flash_stock(options: Options) -> int:
    """The hot SKU's stock: about two thirds of a unit per flash-sale request expected, each asking for 1
    or 2, so it sells out partway through the sale (released reservations put some units back)."""
    return max(10, round(0.6 * options.requests * options.hot))


class Workload:
    """A seeded stream of requests; confirm and release pick reservations whose outcome came back.

    With ``hot`` > 0, bursts of FLASH_BURST reservations of the hot SKU make up about that share of the
    new requests; with 0, the seed draws the plain mixed stream over the other SKUs.
    """

    def __init__(self, options: Options, skus: list[str], inventory: Inventory) -> None:
        self.random = random.Random(options.seed)
        self.skus = skus
        self.inventory = inventory
        self.sent: dict[str, Sent] = {}
        self.replays = 0
        self.pending_reserves: list[str] = []
        self.open_reservations: list[str] = []
        self.counter = 0
        hot = min(max(options.hot, 0.0), 0.95)
        # A draw is a burst with this chance, so that bursts of FLASH_BURST are ``hot`` of the requests.
        self.burst_chance = hot / (FLASH_BURST * (1 - hot) + hot) if hot > 0 else 0.0

    def _key(self, operation: str) -> str:
        self.counter += 1
        return f"chaos-{self.counter:05d}-{operation}"

    def _harvest(self) -> None:
        still = []
        for key in self.pending_reserves:
            outcome = self.inventory.request_outcome(key)
            if outcome is None:
                still.append(key)
            elif outcome.status == "reserved":
                self.open_reservations.extend(outcome.detail.get("reservation_ids") or [])
        self.pending_reserves = still

    def next(self, room: int = FLASH_BURST) -> list[tuple[Sent, bool]]:
        """The next requests (one, or a flash-sale burst of at most ``room``), each with whether it
        replays an earlier key (same key, same arguments)."""
        if self.sent and self.random.random() < 0.1:
            self.replays += 1
            return [(self.random.choice(list(self.sent.values())), True)]
        self._harvest()
        if self.burst_chance and self.random.random() < self.burst_chance:
            return [(self._flash(), False) for _ in range(max(1, min(room, FLASH_BURST)))]
        return [(self._regular(), False)]

    def _flash(self) -> Sent:
        sent = Sent(self._key("reserve"), "reserve", {"sku": HOT_SKU, "quantity": self.random.randint(1, 2)})
        self.pending_reserves.append(sent.key)
        self.sent[sent.key] = sent
        return sent

    def _regular(self) -> Sent:
        roll = self.random.random()
        sku = self.random.choice(self.skus)
        if self.open_reservations and roll < 0.35:
            reservation = self.open_reservations.pop(self.random.randrange(len(self.open_reservations)))
            operation = "confirm" if self.random.random() < 0.6 else "release"
            sent = Sent(self._key(operation), operation, {"reservation_id": reservation})
        elif roll < 0.45:
            sent = Sent(self._key("restock"), "restock", {"sku": sku, "quantity": self.random.randint(1, 4)})
        elif roll < 0.55:
            # Sent as shrinkage: the worker counts what it reads under the lease, less the units missing.
            shrinkage = self.random.randint(0, MAX_SHRINKAGE)
            sent = Sent(self._key("count"), "count", {"sku": sku, "shrinkage": shrinkage})
        elif roll < 0.65:
            sent = Sent(self._key("replenish"), "replenish", {"sku": sku, "par": PAR})
        else:
            sent = Sent(self._key("reserve"), "reserve", {"sku": sku, "quantity": self.random.randint(1, 3)})
            self.pending_reserves.append(sent.key)
        self.sent[sent.key] = sent
        return sent
