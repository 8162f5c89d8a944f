"""The settings of workers, producers, the HTTP service and the command line: one frozen object built
once from the ``RESERVATIONS_*`` environment. Each field of :class:`Settings` is the one declaration of its
variable (:func:`setting`: its help, range, whether it is a URL; the annotation its type), which parses,
shows and reports it; every problem is reported at once, each by its variable's name. ``reservations
config`` prints every value in effect and where it came from.

A URL that can carry a password may take it from a file (a compose secret):
``RESERVATIONS_DATABASE_PASSWORD_FILE`` for ``RESERVATIONS_DATABASE_URL``, the URL naming the user without
a password.
"""

from __future__ import annotations

import difflib
import math
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlsplit

from fencing import InvalidLeaseRequest
from fencing.engines import POOLING_MODES
from fencing.etcd_backend import ETCD_MIN_TTL, whole_seconds
from fencing.etcd_gateway import ETCD_SCHEMES
from fencing.manager import lease_backend
from fencing.redis_backend import validate_prefix
from fencing.urls import mask_url, normalize_url
from reservations import numerals
from tasks import tracing

if TYPE_CHECKING:
    from celery import Celery

PREFIX = "RESERVATIONS_"

# Where a value came from, as ``reservations config`` reports it.
DEFAULT, ENVIRONMENT, FILE, OPTION, GIVEN = "default", "environment", "file", "option", "given"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# The form kombu's Sentinel transport and Celery's Sentinel result backend both read.
_SENTINELS = ";"

T = TypeVar("T")


# Read by the command line's chaos run only (``reservations chaos``), not a setting of this object, but a
# name of ours all the same: it is never reported as unknown.
CHAOS_POSTGRES_URL = PREFIX + "CHAOS_POSTGRES_URL"

# The transports a worker is built and tested for (a kombu or Celery scheme's first part): Redis, alone
# or through Sentinel, RabbitMQ and, for the embedded demo, SQLAlchemy; results in Redis or a database.
BROKER_SCHEMES = ("redis", "rediss", "sentinel", "amqp", "amqps", "pyamqp", "sqla")
REDIS = ("redis", "rediss", "sentinel")
REDELIVERING = (*REDIS, "sqs")
AMQP = ("amqp", "amqps", "pyamqp")
RESULT_SCHEMES = ("redis", "rediss", "sentinel", "db")


class SettingsError(ValueError):
    """Settings that cannot be used; ``problems`` holds one line per variable, each naming it."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class Variable:
    """One environment variable: the settings field it sets, its type, default, range and help."""

    field: str
    type: str  # the field's annotation: "str", "float", "float | None", "int" or "bool"
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    url: bool = False  # a URL that may carry a password, read from ``password_file`` when that is set
    default_from: str = ""  # unset: the value of this other field

    @property
    def name(self) -> str:
        return PREFIX + self.field.upper()

    @property
    def password_file(self) -> str:
        return self.name.removesuffix("_URL") + "_PASSWORD_FILE" if self.url else ""

    def parse(self, raw: str) -> Any:
        """``raw`` (non-empty) as this variable's type, or SettingsError naming it."""
        if self.type == "str":
            return raw
        if self.type == "bool":
            word = raw.strip().lower()
            if word not in _TRUE + _FALSE:
                raise SettingsError(f"{self.name} must be 1 or 0, got {raw!r}")
            return word in _TRUE
        # The command line's grammar (reservations.numerals): digits 0-9, a fraction only for seconds.
        whole = self.type == "int"
        number = numerals.whole(raw) if whole else numerals.decimal(raw)
        if number is None:
            like = "a whole number" if whole else "a number"
            example = "" if whole else ", like 2 or 0.5"
            raise SettingsError(
                f"{self.name} must be {like} written with the digits 0-9{example}, got {raw!r}"
            )
        low = -math.inf if self.low is None else self.low
        high = math.inf if self.high is None else self.high
        if not low <= number <= high:
            raise SettingsError(f"{self.name} must be between {low:g} and {high:g}, got {raw}")
        return number

    def show(self, value: Any) -> str:
        """``value`` as it may be printed: a URL's password masked, seconds with their unit."""
        if value is None:
            return ""
        if self.url:
            return mask_url(str(value))
        if self.type == "bool":
            return "1" if value else "0"
        if self.type.startswith("float"):
            return f"{value:g}s"
        return str(value)


def setting(
    default: T,
    help: str,
    low: float | None = None,
    high: float | None = None,
    *,
    url: bool = False,
    default_from: str = "",
) -> T:
    """A settings field that is an environment variable, declared with its help and range."""
    meta = {"help": help, "low": low, "high": high, "url": url, "default_from": default_from}
    return field(default=default, metadata={"setting": meta})


@dataclass(frozen=True)
class Settings:
    """Every setting, each field declaring its ``RESERVATIONS_<FIELD>`` variable. ``from_env`` reads them;
    constructing one directly (tests, tools that start workers) takes the defaults for the rest."""

    broker_url: str = setting("redis://127.0.0.1:6379/0", "Celery broker (Redis or RabbitMQ)", url=True)
    result_backend: str = setting("redis://127.0.0.1:6379/1", "Celery result backend", url=True)
    result_expires: int = setting(
        0,
        "seconds a request task's Celery result is kept, for callers of AsyncResult.get(); 0: request "
        "tasks store none (their outcome is the database row the client reads)",
        0,
        7 * 86400,
    )
    sentinel_master: str = setting(
        "",
        "the Sentinel service (master name) of the broker and result backend when their URLs are "
        "sentinel://host:port;sentinel://host:port;...",
    )
    database_url: str = setting(
        "sqlite:///var/reservations.sqlite3", "inventory database (SQLite or PostgreSQL)", url=True
    )
    database_pooling: str = setting(
        "session",
        "session or transaction: how the database's sessions are held; transaction behind PgBouncer's "
        "pool_mode=transaction (no prepared statements, and a worker checks at start that the database "
        "or role bounds idle transactions and lock waits by the lease ttl); also for a SQL lease backend",
    )
    lease_url: str = setting(
        "", "lease backend, redis://... or SQL (unset: the database)", url=True, default_from="database_url"
    )
    lease_prefix: str = setting("fencing", "Redis key prefix of the leases")
    lease_ttl: float = setting(30.0, "seconds a task's SKU lease lasts without renewal", 0.05, 3600)
    lease_renew_every: float | None = setting(
        None, "seconds between renewals while a task holds its lease (unset: a third of the ttl)", 0.01, 3600
    )
    max_epochs: int = setting(
        3, "attempts of one request that may lose ownership; at that many it is dead-lettered", 1, 100
    )
    max_retries: int = setting(200, "lease-busy retries before dead-letter", 0, 100_000)
    max_transient_retries: int = setting(
        30,
        "retries while Redis or the database is down (backing off to 30 s: 6 to 12 minutes in all, past the "
        "HTTP service's default deadline, so such a request ends expired there), then dead-letter",
        0,
        1000,
    )
    visibility_timeout: float = setting(
        300.0,
        "seconds before an unacknowledged message is redelivered: how long the requests of a dead worker "
        "host wait; at least 4 lease ttls",
        1,
        7 * 86400,
    )
    republish_after: float = setting(
        10.0,
        "seconds after a request is recorded and published before the relay first looks at it: one "
        "without an outcome whose message the broker no longer carries is published again (same key and "
        "task id); then again at this spacing (doubling where the broker cannot be looked into)",
        0.05,
        3600,
    )
    relay_every: float = setting(
        5.0,
        "seconds between the relay's passes in each worker (jittered down to half); 0: this worker runs "
        "no relay",
        0,
        3600,
    )
    max_publishes: int = setting(
        6,
        "publications of one request (the first included) after which a request the broker keeps losing "
        "ends dead_lettered (past its deadline it ends expired first)",
        1,
        1000,
    )
    http_wait: float = setting(
        5.0,
        "seconds the HTTP service waits for a request's outcome before it answers 202 with the request's "
        "Location (a caller's Prefer: wait=N asks for another, up to RESERVATIONS_HTTP_MAX_WAIT)",
        0,
        300,
    )
    http_max_wait: float = setting(
        30.0, "the longest wait a caller's Prefer: wait=N gets from the HTTP service", 0, 300
    )
    request_deadline: float = setting(
        300.0,
        "seconds after which a request the HTTP service enqueued is no longer wanted when its caller sends "
        "no Request-Deadline: a worker reaching it later ends it expired without touching stock; 0: none",
        0,
        7 * 86400,
    )
    queue_bound: int = setting(
        10_000,
        "requests waiting in the broker's queue above which the HTTP service answers 503 with Retry-After "
        "instead of enqueueing; 0: no bound",
        0,
        10_000_000,
    )
    http_caller_bound: int = setting(
        1_000,
        "write requests one caller may have in flight in one HTTP service process (being admitted, "
        "published or waited on; the anonymous callers count as one) above which it answers that caller "
        "429 with Retry-After, so no caller takes every other's room; 0: no bound",
        0,
        10_000_000,
    )
    console_password_file: str = setting(
        "",
        "a file holding the password of the operator's console, served under /console/ by the HTTP service "
        "(HTTP Basic: any user name, recorded as the operator's with each action); unset: no console",
    )
    expiry_interval: float = setting(30.0, "seconds between hold-expiry sweeps by celery beat", 0.1, 86400)
    enforce_fence: bool = setting(
        True, "0 drops the token condition from stock writes: lease-only, for chaos comparisons only"
    )
    batching: bool = setting(
        True,
        "a reservation that finds its SKU's lease busy waits for the holder to serve it in a batch; 0 "
        "retries it through the broker until it gets the lease itself",
    )
    batch_size: int = setting(100, "pending reservations served per fenced transaction", 1, 1000)
    handoff_check: float = setting(
        1.0,
        "seconds until a SKU's queue is first looked after by its watch task, should its holder not serve "
        "it; then doubling up to the lease ttl",
        0.01,
        3600,
    )
    heartbeat_file: str = setting("", "a consuming worker touches this file every 5 s (health checks)")
    log_format: str = setting(
        "text", "text or json: json writes each log line of workers, beat and the CLI as one JSON object"
    )
    tracing: str = setting(
        "",
        "what a request's W3C trace adds to the trace_id and span_id of its log lines (always there), "
        "comma-separated: sql, a sqlcommenter comment on each of the worker's statements (statements are "
        "then never prepared); otel, OpenTelemetry spans (needs the otel extra)",
    )
    metrics_port: int = setting(
        0,
        "a worker serves Prometheus metrics on this port (0: off); PROMETHEUS_MULTIPROC_DIR, if set, must "
        "be the worker's own directory",
        0,
        65535,
    )
    metrics_host: str = setting(
        "127.0.0.1",
        "the address a worker's metrics listener binds: this host only by default; 0.0.0.0 (every "
        "interface) where a scraper on another host or container reads it",
    )
    task_events: bool = setting(
        False,
        "1: workers send task events, as celery worker -E does (Flower, celery events); a request's event "
        "names its outcome",
    )
    # Fault injection (tasks.failpoints reads these two from the environment at each point).
    failpoints: str = setting("", "fault-injection points, e.g. before_write=stop,once (tests, chaos runs)")
    failpoint_dir: str = setting("", "a directory for this run's once-only failpoint markers")
    # Where each value came from, by field (absent: default, or given to the constructor).
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    password_files: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.lease_url:
            object.__setattr__(self, "lease_url", self.database_url)
        # What a worker could not build from these URLs and the key prefix, found without connecting by
        # the parsers the clients use: nothing that passes here fails when the worker builds them.
        problems = []
        checks: list[tuple[str, Callable[[str], object]]] = [("database_url", normalize_url)]
        if self.lease_url != self.database_url:  # the same URL would be reported twice
            checks.append(("lease_url", lease_backend))
        for name, check in checks:
            try:
                check(getattr(self, name))
            except InvalidLeaseRequest as exc:
                problems.append(f"{_BY_FIELD[name].name}: {exc}")
        try:
            validate_prefix(self.lease_prefix)
        except InvalidLeaseRequest as exc:
            problems.append(f"{PREFIX}LEASE_PREFIX {self.lease_prefix!r}: {exc}")
        for name, schemes in (("broker_url", BROKER_SCHEMES), ("result_backend", RESULT_SCHEMES)):
            problem = scheme_problem(_BY_FIELD[name].name, getattr(self, name), schemes)
            if problem:
                problems.append(problem)
            elif is_sentinel(getattr(self, name)) and not self.sentinel_master:
                # kombu and Celery would fail only at the first connection, inside a running worker.
                problems.append(
                    f"{_BY_FIELD[name].name} is a sentinel:// URL: {PREFIX}SENTINEL_MASTER must name the "
                    "Sentinel service of its Redis"
                )
        postgres = scheme_of(self.database_url) in ("postgresql", "postgres")
        if self.database_pooling not in POOLING_MODES:
            problems.append(
                f"{PREFIX}DATABASE_POOLING must be session or transaction, got {self.database_pooling!r}"
            )
        elif self.database_pooling == "transaction" and not postgres:
            problems.append(f"{PREFIX}DATABASE_POOLING=transaction needs a PostgreSQL {PREFIX}DATABASE_URL")
        if self.log_format not in ("text", "json"):
            problems.append(f"{PREFIX}LOG_FORMAT must be text or json, got {self.log_format!r}")
        try:
            tracing.modes(self.tracing)
        except ValueError as exc:
            problems.append(f"{PREFIX}TRACING: {exc}")
        # Redelivery must never overtake a live attempt: an unacked message comes back only after the
        # longest a lease can be held plus the retry countdowns in between.
        if self.visibility_timeout < 4 * self.lease_ttl:
            problems.append(
                f"{PREFIX}VISIBILITY_TIMEOUT ({self.visibility_timeout:g}s) must be at least 4x the lease "
                f"ttl ({self.lease_ttl:g}s, {PREFIX}LEASE_TTL)"
            )
        problems.extend(self._lease_problems())
        if problems:
            raise SettingsError(problems)

    def _lease_problems(self) -> Iterator[str]:
        # A renewal due only after the lease ran out never keeps it: every long task would lose its SKU.
        if self.lease_renew_every is not None and self.lease_renew_every >= self.lease_ttl:
            yield (
                f"{PREFIX}LEASE_RENEW_EVERY ({self.lease_renew_every:g}s) must be shorter than the lease "
                f"ttl ({self.lease_ttl:g}s, {PREFIX}LEASE_TTL)"
            )
        # etcd keeps whole-second leases of at least its minimum: a worker would be refused every lease.
        if scheme_of(self.lease_url) in ETCD_SCHEMES:
            try:
                whole_seconds(self.lease_ttl)
            except InvalidLeaseRequest:
                yield (
                    f"{PREFIX}LEASE_TTL ({self.lease_ttl:g}s) must be whole seconds, {ETCD_MIN_TTL} or more, "
                    "on etcd"
                )

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, options: Mapping[str, str] | None = None
    ) -> Settings:
        """The settings ``env`` (the process environment by default) gives, with ``options`` (by field,
        as text: a command line's own options) winning over it. Raises SettingsError naming every problem."""
        env = os.environ if env is None else env
        options = options or {}
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        files: dict[str, str] = {}
        problems: list[str] = []
        for variable in VARIABLES:
            raw = options.get(variable.field) or env.get(variable.name) or ""
            try:
                if raw:
                    values[variable.field] = variable.parse(raw)
                    sources[variable.field] = OPTION if options.get(variable.field) else ENVIRONMENT
                if variable.url and env.get(variable.password_file):
                    # A URL left unset is its default, or the value of the field it defaults to.
                    origin = _BY_FIELD[variable.default_from] if variable.default_from else variable
                    url = values.get(variable.field) or values.get(origin.field) or origin.default
                    values[variable.field] = with_password(env, variable, url)
                    sources[variable.field], files[variable.field] = FILE, env[variable.password_file]
            except SettingsError as exc:
                problems.extend(exc.problems)
        if problems:
            raise SettingsError(problems)
        return cls(**values, sources=sources, password_files=files)

    def source(self, name: str) -> str:
        """Where field ``name`` came from: environment, file (a password), option, default or given."""
        if name in self.sources:
            return self.sources[name]
        variable = _BY_FIELD[name]
        default = getattr(self, variable.default_from) if variable.default_from else variable.default
        return DEFAULT if getattr(self, name) == default else GIVEN

    def with_(self, **changes: Any) -> Settings:
        """A copy with ``changes``; a lease URL left to default follows a new database URL."""
        if "database_url" in changes and "lease_url" not in changes and self.source("lease_url") == DEFAULT:
            changes["lease_url"] = ""
        kept = {k: v for k, v in self.sources.items() if k not in changes}
        files = {k: v for k, v in self.password_files.items() if k not in changes}
        return replace(self, **changes, sources=kept, password_files=files)

    def __repr__(self) -> str:
        # Celery prints its configuration (``celery report``); this object must not leak passwords there.
        return f"Settings({', '.join(f'{k}={v}' for k, v in self.masked().items())})"

    @property
    def tracing_modes(self) -> frozenset[str]:
        """What ``RESERVATIONS_TRACING`` names (checked when the settings were made)."""
        return tracing.modes(self.tracing)

    def transport_options(self, url: str, *, broker: bool) -> dict[str, Any]:
        """The kombu transport options a broker or result backend URL takes, and only those: py-amqp and
        the SQLAlchemy transport would pass visibility_timeout on as a connection argument (RabbitMQ
        redelivers when the channel closes instead). Publisher confirms make a publish to RabbitMQ return
        once the broker has the message, as a Redis LPUSH does."""
        scheme = scheme_of(url)
        if scheme in REDELIVERING:
            master = {"master_name": self.sentinel_master} if scheme == "sentinel" else {}
            return {"visibility_timeout": self.visibility_timeout, **master}
        if broker and scheme in AMQP:
            return {"confirm_publish": True}
        return {}

    def masked(self) -> dict[str, str]:
        """Every setting as it may be printed, by field: URLs with their passwords hidden."""
        return {v.field: v.show(getattr(self, v.field)) for v in VARIABLES}

    def report(self) -> list[dict[str, str]]:
        """Every variable with its value as it may be printed and where it came from (``reservations
        config``); a password read from a file names that file."""
        return [
            {
                "name": v.name,
                "value": v.show(getattr(self, v.field)),
                "source": self.source(v.field),
                **({"password_file": self.password_files[v.field]} if v.field in self.password_files else {}),
            }
            for v in VARIABLES
        ]

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce these settings (those not at their defaults), for starting workers.
        A password read from a file stays in its file: the URL goes without it, with the file's variable."""
        env: dict[str, str] = {}
        for variable in VARIABLES:
            value = getattr(self, variable.field)
            if self.source(variable.field) == DEFAULT or value is None:
                continue
            if variable.field in self.password_files:
                env[variable.password_file] = self.password_files[variable.field]
                value = without_password(value)
            env[variable.name] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        return env


VARIABLES = tuple(
    Variable(field=f.name, type=str(f.type), default=f.default, **f.metadata["setting"])
    for f in fields(Settings)
    if "setting" in f.metadata
)
_BY_FIELD = {variable.field: variable for variable in VARIABLES}


def variable(name: str) -> Variable:
    """The variable of field ``name`` (``variable("lease_ttl").name == "RESERVATIONS_LEASE_TTL"``)."""
    return _BY_FIELD[name]


def json_logs() -> bool:
    """Whether ``RESERVATIONS_LOG_FORMAT`` asks for JSON lines, read from the environment itself: the lines
    said before the settings are parsed (or when they cannot be) follow it too."""
    return os.environ.get(variable("log_format").name, "").strip() == "json"


def unknown_names(env: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """The ``RESERVATIONS_*`` names in ``env`` that are not ours, each with the closest one (or None)."""
    env = os.environ if env is None else env
    known = [*(v.name for v in VARIABLES), *(v.password_file for v in VARIABLES if v.url), CHAOS_POSTGRES_URL]
    # Compared without the prefix they all share, which would make any two names look alike.
    stems = [name.removeprefix(PREFIX) for name in known]

    def closest(name: str) -> str | None:
        found = difflib.get_close_matches(name.removeprefix(PREFIX), stems, n=1, cutoff=0.6)
        return PREFIX + found[0] if found else None

    return [(name, closest(name)) for name in sorted(env) if name.startswith(PREFIX) and name not in known]


def unknown_name_warnings(env: Mapping[str, str] | None = None) -> list[str]:
    """One line per unknown name, as workers log them and the command line prints them."""
    return [
        f"{name} is not a setting" + (f"; did you mean {closest}?" if closest else "")
        for name, closest in unknown_names(env)
    ]


def settings_of(app: Celery) -> Settings:
    """The settings a Celery app was configured with (tasks.app.configure keeps them in its conf)."""
    settings: Settings = app.conf.reservations_settings
    return settings


def stores_request_results(app: Celery) -> bool:
    """Whether request tasks store their Celery result (``RESERVATIONS_RESULT_EXPIRES`` above 0)."""
    return settings_of(app).result_expires > 0


# -- URLs: schemes, sentinel lists, passwords from files --------------------------------------------------


def scheme_of(url: str) -> str:
    return urlsplit(url).scheme.partition("+")[0].lower()


def is_sentinel(url: str) -> bool:
    """Whether ``url`` reaches its Redis through Sentinel (``sentinel://host:port;sentinel://...``)."""
    return scheme_of(url) == "sentinel"


def _parts(url: str) -> list[str]:
    """A sentinel:// URL's part for each sentinel; any other URL whole (a ";" is no separator there)."""
    return url.split(_SENTINELS) if is_sentinel(url) else [url]


def scheme_problem(name: str, url: str, schemes: tuple[str, ...]) -> str | None:
    """What is wrong with the URL of the variable ``name`` for a client taking only ``schemes`` (a
    kombu or Celery scheme's first part), or None: found without connecting."""
    parts = url.split(_SENTINELS)
    for part in parts:
        if "://" not in part or scheme_of(part) not in schemes:
            wanted = ", ".join(f"{s}+<database>://" if s in ("sqla", "db") else f"{s}://" for s in schemes)
            return f"{name}: unsupported URL {mask_url(url)}; use one of {wanted}"
        try:
            urlsplit(part).port  # noqa: B018  (raises for a port that is no number)
        except ValueError:
            return f"{name}: the URL's port is not a number"
    if len(parts) > 1 and not all(is_sentinel(part) for part in parts):
        return f"{name}: only a sentinel:// URL names several hosts (joined by ;): {mask_url(url)}"
    return None


# A password file holds one password: anything longer is the wrong file.
_PASSWORD_FILE_LIMIT = 4096


def read_password_file(name: str, path: str) -> str:
    """The text of the password file ``path`` (named by the variable ``name``), or SettingsError naming
    the variable. Only a regular file is read: a directory, or a FIFO nobody writes to, would otherwise
    fail with a traceback or block the worker's start forever (open does not wait with O_NONBLOCK)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise SettingsError(f"{name}: cannot read {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SettingsError(f"{name}: {path} is not a regular file")
        if info.st_size > _PASSWORD_FILE_LIMIT:
            raise SettingsError(f"{name}: {path} is larger than {_PASSWORD_FILE_LIMIT} bytes")
        data = os.read(fd, _PASSWORD_FILE_LIMIT + 1)
    except OSError as exc:
        raise SettingsError(f"{name}: cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SettingsError(f"{name}: {path} is not UTF-8 text") from None


def with_password(env: Mapping[str, str], variable: Variable, url: str) -> str:
    """``url`` with the password read from the file ``variable.password_file`` names: a secret mounted
    as a file never sits in the environment or the compose file. One trailing newline is not part of it.
    A sentinel:// URL gets it in every sentinel's part: kombu takes the Redis password from the part it
    currently connects through (it moves to the next after a failed connection), Celery from the first."""
    path = env[variable.password_file]
    password = read_password_file(variable.password_file, path).removesuffix("\n").removesuffix("\r")
    given = [urlsplit(part) for part in _parts(url)]
    if not password or any(parts.password is not None or not parts.hostname for parts in given):
        raise SettingsError(
            f"{variable.password_file} needs a non-empty file, and a {variable.name} with a host and no "
            "password"
        )
    with_password = []
    for parts in given:
        userinfo, _, host = parts.netloc.rpartition("@")
        with_password.append(parts._replace(netloc=f"{userinfo}:{quote(password, safe='')}@{host}").geturl())
    return _SENTINELS.join(with_password)


def without_password(url: str) -> str:
    """The inverse of :func:`with_password`: the URL as it was given."""
    given = []
    for parts in map(urlsplit, _parts(url)):
        userinfo, _, host = parts.netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        given.append(parts._replace(netloc=f"{user}@{host}" if user else host).geturl())
    return _SENTINELS.join(given)
