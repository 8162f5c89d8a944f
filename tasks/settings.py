"""One frozen settings object, built from environment variables, shared by workers, producers and the CLI.

Variables (prefix ``RESERVATIONS_``), with defaults:

- BROKER_URL: redis://127.0.0.1:6379/0 (Celery broker)
- RESULT_BACKEND: redis://127.0.0.1:6379/1 (Celery result backend)
- DATABASE_URL: sqlite:///var/reservations.sqlite3 (inventory; SQLite or PostgreSQL)
- DATABASE_PASSWORD_FILE, BROKER_PASSWORD_FILE: unset (a file holding the password of that URL, such as a
  compose secret; the URL then names the user without a password)
- LEASE_URL: the database URL (lease backend: redis://... or a SQL URL)
- LEASE_PREFIX: fencing (Redis key prefix of the leases)
- LEASE_TTL: 30 (seconds a task's SKU lease lasts without renewal)
- LEASE_RENEW_EVERY: ttl/3 (seconds between background renewals while a task holds its lease)
- MAX_EPOCHS: 3 (attempts of one request that may lose ownership; at that many it is dead-lettered)
- MAX_RETRIES: 200 (lease-busy retries before dead-letter)
- MAX_TRANSIENT_RETRIES: 20 (retries while Redis or the database is unreachable, backing off to 30 s;
  then the request is dead-lettered, as soon as its outcome can be written)
- VISIBILITY_TIMEOUT: 300 (seconds before an unacknowledged message is redelivered: the bound on how long
  the requests of a worker host that died wait; at least 4 lease ttls)
- HEARTBEAT_FILE: unset (a worker touches this file every 5 s while it consumes: a health check's signal)
- EXPIRY_INTERVAL: 30 (seconds between hold-expiry sweeps by celery beat)
- ENFORCE_FENCE: 1 (0 drops the token condition from stock writes: lease-only, for chaos comparisons only)
- BATCHING: 1 (a reservation that finds its SKU's lease busy waits for the holder to serve it in a batch;
  0 retries it through the broker until it gets the lease itself)
- BATCH_SIZE: 100 (pending reservations served per fenced transaction)
- HANDOFF_CHECK: 1 (seconds until a SKU's queue is first looked after by its watch task, should its
  holder not serve it; then doubling up to the lease ttl until the queue is empty)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from fencing import mask_url

PREFIX = "RESERVATIONS_"


class SettingsError(ValueError):
    """A setting that cannot be used; names the variable."""


def _number(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = env.get(PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{PREFIX}{name} must be a number, got {raw!r}") from None
    if not low <= value <= high:
        raise SettingsError(f"{PREFIX}{name} must be between {low} and {high}, got {value}")
    return value


def url_with_password_file(env: Mapping[str, str], name: str, url: str) -> str:
    """``url`` (the setting ``<name>_URL``) with the password read from the file that
    ``RESERVATIONS_<name>_PASSWORD_FILE`` names, when that variable is set: a secret mounted as a file never
    sits in the environment or the compose file. One trailing newline of the file is not part of it."""
    variable = f"{PREFIX}{name}_PASSWORD_FILE"
    path = env.get(variable)
    if not path:
        return url
    try:
        password = Path(path).read_text().removesuffix("\n").removesuffix("\r")
    except OSError as exc:
        raise SettingsError(f"{variable}: cannot read {path}: {exc.strerror}") from None
    parts = urlsplit(url)
    if not password or parts.password is not None or not parts.hostname:
        raise SettingsError(
            f"{variable} needs a non-empty file, and a {PREFIX}{name}_URL with a host and no password"
        )
    userinfo, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{userinfo}:{quote(password, safe='')}@{host}").geturl()


@dataclass(frozen=True)
class Settings:
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str = "redis://127.0.0.1:6379/1"
    database_url: str = "sqlite:///var/reservations.sqlite3"
    lease_url: str = ""  # empty: the SQL lease backend on the database
    lease_prefix: str = "fencing"
    lease_ttl: float = 30.0
    lease_renew_every: float | None = None  # None: a third of the ttl
    max_epochs: int = 3
    max_retries: int = 200
    max_transient_retries: int = 20
    visibility_timeout: float = 300.0
    expiry_interval: float = 30.0
    enforce_fence: bool = True
    batching: bool = True
    batch_size: int = 100
    handoff_check: float = 1.0
    heartbeat_file: str = ""
    extra: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.lease_url:
            object.__setattr__(self, "lease_url", self.database_url)
        # Redelivery must never overtake a live attempt: an unacked message comes back only after the
        # longest a lease can be held plus the retry countdowns in between.
        if self.visibility_timeout < 4 * self.lease_ttl:
            raise SettingsError(
                f"{PREFIX}VISIBILITY_TIMEOUT ({self.visibility_timeout}s) must be at least 4x the lease "
                f"ttl ({self.lease_ttl}s)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        defaults = cls()
        database = url_with_password_file(
            env, "DATABASE", env.get(PREFIX + "DATABASE_URL") or defaults.database_url
        )
        broker = url_with_password_file(env, "BROKER", env.get(PREFIX + "BROKER_URL") or defaults.broker_url)
        return cls(
            broker_url=broker,
            result_backend=env.get(PREFIX + "RESULT_BACKEND") or defaults.result_backend,
            database_url=database,
            lease_url=env.get(PREFIX + "LEASE_URL") or database,
            lease_prefix=env.get(PREFIX + "LEASE_PREFIX") or defaults.lease_prefix,
            lease_ttl=_number(env, "LEASE_TTL", defaults.lease_ttl, 0.05, 3600),
            lease_renew_every=(
                _number(env, "LEASE_RENEW_EVERY", 0, 0.01, 3600)
                if env.get(PREFIX + "LEASE_RENEW_EVERY")
                else None
            ),
            max_epochs=int(_number(env, "MAX_EPOCHS", defaults.max_epochs, 1, 100)),
            max_retries=int(_number(env, "MAX_RETRIES", defaults.max_retries, 0, 100_000)),
            max_transient_retries=int(
                _number(env, "MAX_TRANSIENT_RETRIES", defaults.max_transient_retries, 0, 1000)
            ),
            visibility_timeout=_number(env, "VISIBILITY_TIMEOUT", defaults.visibility_timeout, 1, 7 * 86400),
            expiry_interval=_number(env, "EXPIRY_INTERVAL", defaults.expiry_interval, 0.1, 86400),
            enforce_fence=bool(_number(env, "ENFORCE_FENCE", 1, 0, 1)),
            batching=bool(_number(env, "BATCHING", 1, 0, 1)),
            batch_size=int(_number(env, "BATCH_SIZE", defaults.batch_size, 1, 1000)),
            handoff_check=_number(env, "HANDOFF_CHECK", defaults.handoff_check, 0.01, 3600),
            heartbeat_file=env.get(PREFIX + "HEARTBEAT_FILE") or "",
        )

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    def __repr__(self) -> str:
        # Celery prints its configuration (``celery report``); this object must not leak passwords there.
        return f"Settings({', '.join(f'{k}={v}' for k, v in self.masked().items())})"

    def masked(self) -> dict[str, str]:
        """The settings as they may be printed: every URL with its password hidden."""
        return {
            "broker_url": mask_url(self.broker_url),
            "result_backend": mask_url(self.result_backend),
            "database_url": mask_url(self.database_url),
            "lease_url": mask_url(self.lease_url),
            "lease_ttl": f"{self.lease_ttl:g}s",
            "max_epochs": str(self.max_epochs),
            "visibility_timeout": f"{self.visibility_timeout:g}s",
            "batching": f"on, {self.batch_size} per batch" if self.batching else "off",
        }
