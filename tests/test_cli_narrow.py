"""On a narrow terminal the command line's tables wrap whole values instead of cutting them with an
ellipsis: a SKU, a key, a holder or a setting's name can be read and typed back (SQLite and
PostgreSQL).
"""

from __future__ import annotations

import pytest

from fencing import LeaseManager, StaleToken
from reservations import Inventory, scope_of
from testing.support import run

LONG_SKU = "PALLET-RACK-BOLT-M12X80-GALVANISED-BOX-OF-100"
LONG_KEY = "restock-delivery-2026-12-03-warehouse-north-dock-7"
HOLDER = "worker-host-17.warehouse.example.internal:48213:5f0c8a1e-2b7d-4c1e-9a55-0b8e3c2d1f00"


@pytest.mark.parametrize("columns", [40, 60])
def test_narrow_tables_fold_whole_values_and_cut_none(
    inventory: Inventory, leases: LeaseManager, inventory_url: str, columns: int
) -> None:
    inventory.add_sku(LONG_SKU, on_hand=5)
    lease = leases.acquire(scope_of(LONG_SKU), ttl=30, holder=HOLDER)
    inventory.restock(lease, LONG_SKU, 3, key=LONG_KEY)
    leases.break_lease(scope_of(LONG_SKU), reason="the next holder's turn")
    later = leases.acquire(scope_of(LONG_SKU), ttl=30, holder="host-b:7:task-b")
    inventory.restock(later, LONG_SKU, 1, key="restock-b")
    with pytest.raises(StaleToken):
        inventory.restock(lease, LONG_SKU, 1, key=LONG_KEY + "-late")
    env = {"RESERVATIONS_DATABASE_URL": inventory_url}
    for args, at, whole in (
        (("stock",), 0, LONG_SKU),
        (("leases",), 0, LONG_SKU),
        (("tokens", LONG_SKU), 1, "worker-host-17:48213"),
        (("rejections", LONG_SKU), 4, "worker-host-17:48213"),
    ):
        done = run(*args, env=env, columns=columns)
        assert done.returncode == 0, (args, done.stderr)
        assert "…" not in done.stdout, (args, done.stdout)
        assert max(len(line) for line in done.stdout.splitlines()) <= columns, (args, done.stdout)
        assert whole in _column(done.stdout, at), (args, done.stdout)
    shown = run("config", env=env, columns=columns).stdout
    assert "…" not in shown and "RESERVATIONS_MAX_TRANSIENT_RETRIES" in shown


def _column(table: str, at: int) -> str:
    """The body cells of column ``at`` of the last Rich table printed, each cell's lines joined: a folded
    value whole."""
    body = table.split("┩")[-1]  # the last table printed
    cells = [line.split("│")[1:-1] for line in body.splitlines() if line.startswith("│")]
    return "".join(row[at].strip() for row in cells)
