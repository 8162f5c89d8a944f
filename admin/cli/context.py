"""Where the command line reads and writes: the settings object the workers build (from the same
environment variables, set once by the root options, which override them) and the inventory and lease
coordinator opened on it.
"""

from __future__ import annotations

from fencing import LeaseManager
from fencing.urls import mask_url
from reservations.inventory import Inventory
from tasks.settings import DEFAULT, Settings


class Config:
    """The CLI's view of its :class:`Settings`: the URLs it reads and writes."""

    def __init__(self) -> None:
        self.settings = Settings()

    @property
    def database_url(self) -> str:
        return self.settings.database_url

    @property
    def lease_url(self) -> str | None:
        """None: the leases live in the database (no lease URL of their own)."""
        return None if self.settings.source("lease_url") == DEFAULT else self.settings.lease_url

    @property
    def lease_prefix(self) -> str:
        return self.settings.lease_prefix

    @property
    def broker_url(self) -> str:
        return self.settings.broker_url

    @property
    def result_backend(self) -> str:
        return self.settings.result_backend


config = Config()


def inventory() -> Inventory:
    return Inventory.from_url(config.database_url, pooling=config.settings.database_pooling)


def leases() -> LeaseManager:
    if config.lease_url:
        return LeaseManager.from_url(config.lease_url, prefix=config.lease_prefix)
    # The leases live in the database: its engine, through the same pooler.
    return LeaseManager.from_url(
        config.database_url, prefix=config.lease_prefix, pooling=config.settings.database_pooling
    )


def lease_url_shown() -> str:
    return mask_url(config.lease_url or config.database_url)


def given_urls() -> dict[str, bool]:
    """Which URLs were given (by environment, file or option) rather than left at their defaults."""
    settings = config.settings
    return {
        name: settings.source(field) != DEFAULT
        for name, field in (
            ("database", "database_url"),
            ("leases", "lease_url"),
            ("broker", "broker_url"),
            ("result backend", "result_backend"),
        )
    }
