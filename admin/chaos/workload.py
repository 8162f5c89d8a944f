"""The request stream of a chaos run: a seeded mix of reserve / confirm / release / restock with replays,
a flash sale (bursts of reservations of the hot SKU), and stocktakes (after the sale's bursts, if there is
one): every regular SKU counted, then each replenished to par and a delivery of each put away. Counts and
replenishments are writes their worker decides from what it reads under the lease.
Both runs of a seed send the same stream. The HTTP run's stream is what the front door takes: reservations,
and confirms and releases of the reservations made (no restocks, no stocktakes), under the keys of the
caller space the door stores them in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from admin.chaos.options import FLASH_BURST, HOT_SKU, INITIAL_STOCK, STOP_FOR, Options
from reservations.inventory import Inventory

# Every SKU's par level: well above the initial stock, so a replenishment orders units from the start
# and, with restocks rarer than reservations, mostly after that too.
PAR = 2 * INITIAL_STOCK
# A count finds up to this many units fewer than its worker reads (theft, damage, miscounted picks).
MAX_SHRINKAGE = 2
# A stocktake's second burst follows its counts this long after them (stream time): while a worker that
# froze before writing a count would still hold its figure, whether it took the count at once or only
# after a pause of its own (a frozen worker's prefetched message waits for it).
STEP_AFTER = 0.8 * STOP_FOR
# The rush over, the shelves are counted: a stocktake follows a flash-sale burst with this chance. Sent
# right after a burst, its counts come when every worker is waiting for work, the ones that freeze
# before writing included, so those freeze on counts about as often as on the sale's reservations.
STOCKTAKE_CHANCE = 0.6
# Without a flash sale, a draw is a stocktake with this chance.
QUIET_STOCKTAKE_CHANCE = 0.1


@dataclass
class Sent:
    key: str  # as stored: in the HTTP run, in the anonymous caller's space
    operation: str
    kwargs: dict[str, Any]
    on: str = ""  # a confirm's or release's: the key of the reservation it acts on (the HTTP path names it)


def flash_stock(options: Options) -> int:
    """The hot SKU's stock: about two thirds of a unit per flash-sale request expected, each asking for 1
    or 2, so it sells out partway through the sale (released reservations put some units back)."""
    return max(10, round(0.6 * options.requests * options.hot))


def regular_stock(options: Options) -> int:
    """A regular SKU's stock: INITIAL_STOCK, or in the HTTP run (where nothing restocks) about a third of
    a unit per regular request expected, so that the SKUs sell out late in the stream, if at all."""
    if not options.http:
        return INITIAL_STOCK
    share = 1 - min(max(options.hot, 0.0), 0.95)
    return max(INITIAL_STOCK, round(0.35 * options.requests * share / max(1, options.skus)))


class Workload:
    """A seeded stream of requests; confirm and release pick reservations whose outcome came back.

    With ``hot`` > 0, bursts of FLASH_BURST reservations of the hot SKU make up about that share of the
    new requests; with 0, the seed draws the plain mixed stream over the other SKUs.
    """

    def __init__(self, options: Options, skus: list[str], inventory: Inventory, space: str = "") -> None:
        self.random = random.Random(options.seed)
        self.space = space  # what the keys are stored under: "*:" for the front door's anonymous callers
        self.http = options.http
        self.skus = skus
        self.inventory = inventory
        self.sent: dict[str, Sent] = {}
        self.replays = 0
        self.pending_reserves: list[str] = []
        self.open_reservations: list[tuple[str, str]] = []  # (reservation id, the key that made it)
        self.counter = 0
        hot = min(max(options.hot, 0.0), 0.95)
        # A draw is a burst with this chance, so that bursts of FLASH_BURST are ``hot`` of the requests.
        self.burst_chance = hot / (FLASH_BURST * (1 - hot) + hot) if hot > 0 else 0.0
        # The stream sends requests evenly over the duration: a delay as a number of requests.
        step_after = STEP_AFTER * options.stop_for / STOP_FOR  # scaled with the run's lease ttl
        self.step_after = max(1, round(step_after * options.requests / max(options.duration, 1e-3)))
        self.emitted = 0  # requests handed out so far, replays included
        # A stocktake's second burst still to send, each due when this many requests were handed out.
        self.later: list[tuple[int, list[Sent]]] = []
        self.after_sale = False  # the last requests handed out were a flash-sale burst

    def _key(self, operation: str) -> str:
        self.counter += 1
        return f"{self.space}chaos-{self.counter:05d}-{operation}"

    def _harvest(self) -> None:
        still = []
        for key in self.pending_reserves:
            outcome = self.inventory.request_outcome(key)
            if outcome is None:
                still.append(key)
            elif outcome.status == "reserved":
                ids = outcome.detail.get("reservation_ids") or []
                self.open_reservations.extend((made, key) for made in ids)
        self.pending_reserves = still

    def next(self, room: int = FLASH_BURST) -> list[tuple[Sent, bool]]:
        """The next requests (one, or a burst of the flash sale or of a stocktake; at most ``room``), each
        with whether it replays an earlier key (same key, same arguments)."""
        found = self._next(room)
        self.emitted += len(found)
        return found

    def _next(self, room: int) -> list[tuple[Sent, bool]]:
        if self.later and self.later[0][0] <= self.emitted:
            return self._burst(self.later.pop(0)[1], room)
        if (self.after_sale or not self.burst_chance) and not self.http:
            self.after_sale = False
            if self.random.random() < (STOCKTAKE_CHANCE if self.burst_chance else QUIET_STOCKTAKE_CHANCE):
                return self._burst(self._stocktake(), room)
        if self.sent and self.random.random() < 0.1:
            self.replays += 1
            return [(self.random.choice(list(self.sent.values())), True)]
        self._harvest()
        if self.burst_chance and self.random.random() < self.burst_chance:
            self.after_sale = True
            return [(self._flash(), False) for _ in range(max(1, min(room, FLASH_BURST)))]
        return [(self._regular(), False)]

    def _burst(self, burst: list[Sent], room: int) -> list[tuple[Sent, bool]]:
        sending = burst[: max(1, room)]
        self.sent.update((request.key, request) for request in sending)
        return [(request, False) for request in sending]

    def _flash(self) -> Sent:
        sent = Sent(self._key("reserve"), "reserve", {"sku": HOT_SKU, "quantity": self.random.randint(1, 2)})
        self.pending_reserves.append(sent.key)
        self.sent[sent.key] = sent
        return sent

    def _regular(self) -> Sent:
        roll = self.random.random()
        sku = self.random.choice(self.skus)
        if self.open_reservations and roll < 0.35:
            reservation, made_by = self.open_reservations.pop(
                self.random.randrange(len(self.open_reservations))
            )
            operation = "confirm" if self.random.random() < 0.6 else "release"
            sent = Sent(self._key(operation), operation, {"reservation_id": reservation}, on=made_by)
        elif 0.35 <= roll < 0.5 and not self.http:
            sent = Sent(self._key("restock"), "restock", {"sku": sku, "quantity": self.random.randint(1, 4)})
        else:
            sent = Sent(self._key("reserve"), "reserve", {"sku": sku, "quantity": self.random.randint(1, 3)})
            self.pending_reserves.append(sent.key)
        self.sent[sent.key] = sent
        return sent

    def _stocktake(self) -> list[Sent]:
        """Every regular SKU counted, sent as shrinkage (the worker counts what it reads, less the units
        missing); the burst of their replenishments to par and deliveries is sent when due. A worker
        frozen on a count holds at most one message of that burst, so its SKU's replenishment or its
        delivery overtakes the count; the SKUs come in a turned order in each half, so the message that
        the longest waiting worker (a frozen one's) takes is seldom its own count's SKU's."""
        counts = [
            Sent(
                self._key("count"), "count", {"sku": sku, "shrinkage": self.random.randint(0, MAX_SHRINKAGE)}
            )
            for sku in self.skus
        ]
        turned = self.skus[1:] + self.skus[:1]
        then = [Sent(self._key("replenish"), "replenish", {"sku": sku, "par": PAR}) for sku in turned]
        turned = turned[1:] + turned[:1]
        then += [
            Sent(self._key("restock"), "restock", {"sku": sku, "quantity": self.random.randint(1, 4)})
            for sku in turned
        ]
        self.later.append((self.emitted + self.step_after, then))
        return counts
