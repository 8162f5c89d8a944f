"""Where the command line reads and writes: the URLs (set once by the root options, from the same
environment variables the workers use) and the inventory and lease coordinator opened on them.
"""

from __future__ import annotations

from fencing import LeaseManager, mask_url
from reservations.inventory import Inventory


class Config:
    """Where the CLI reads and writes: the same environment variables the workers use."""

    database_url: str = "sqlite:///var/reservations.sqlite3"
    lease_url: str | None = None
    lease_prefix: str = "fencing"
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str = "redis://127.0.0.1:6379/1"


config = Config()


def inventory() -> Inventory:
    return Inventory.from_url(config.database_url)


def leases() -> LeaseManager:
    return LeaseManager.from_url(config.lease_url or config.database_url, prefix=config.lease_prefix)


def lease_url_shown() -> str:
    return mask_url(config.lease_url or config.database_url)


def given_urls() -> dict[str, bool]:
    """Which URLs were given (by environment or option) rather than left at their defaults."""
    return {
        "database": config.database_url != Config.database_url,
        "leases": config.lease_url is not None,
        "broker": config.broker_url != Config.broker_url,
        "result backend": config.result_backend != Config.result_backend,
    }
