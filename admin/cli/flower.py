"""``reservations flower``: Flower (the ``flower`` extra) on the project's own Celery app, built from the
settings the workers read, so every broker form works as it does for them: Redis, RabbitMQ, and Redis
Sentinel (``sentinel://`` URLs and ``RESERVATIONS_SENTINEL_MASTER``), passwords from their files.

Flower's command is run in this process, as ``celery flower`` runs it (``flower.command``), with two
differences: it listens on loopback unless told otherwise (Flower's own default is every interface), and
its Broker tab reaches a Sentinel broker through the current primary, which every sentinel of the URL
may name (Flower's own asks only the first sentinel, and the tab fails once that one is down). Basic
auth comes from a file or Flower's ``FLOWER_BASIC_AUTH``, never from the command line, where ``ps``
would show it.
"""

from __future__ import annotations

import atexit
import ipaddress
import signal
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import typer

from admin.cli.context import config
from admin.cli.failures import EXIT_USAGE, fail
from admin.cli.options import count
from tasks.settings import SettingsError, is_sentinel, read_password_file, scheme_of, variable

if TYPE_CHECKING:
    from celery import Celery

# How long the Broker tab waits on a sentinel, as Flower waits on a Redis broker.
SENTINEL_TIMEOUT = 1.0
AUTH_FILE_OPTION = "--basic-auth-file"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a host Flower binds) is reachable from this host only."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name, or "" (every interface)
        return False


def exposure_problem(address: str, authenticated: bool) -> str | None:
    """Why Flower must not listen on ``address``, or None: anywhere but loopback it shows every task's
    arguments and can revoke tasks and stop workers, so it needs a password there."""
    if is_loopback(address) or authenticated:
        return None
    return (
        f"--host {address or '(every interface)'} is not loopback: give {AUTH_FILE_OPTION} "
        "(or FLOWER_BASIC_AUTH) so that Flower asks for a password"
    )


def broker_problem(url: str) -> str | None:
    """Why Flower cannot watch the broker at ``url``, or None. kombu's SQLAlchemy transport (the embedded
    demo's) has no fanout exchange: no worker would answer Flower's broadcasts and no event would reach it."""
    if scheme_of(url) != "sqla":
        return None
    return (
        f"{variable('broker_url').name} is a SQLAlchemy (sqla+) broker, which has no fanout exchange: "
        "Flower would see no worker and no task; use a Redis, Sentinel or RabbitMQ broker"
    )


def parse_basic_auth(text: str, source: str) -> list[str]:
    """The ``user:password`` entries of an auth file (comma- or newline-separated), as Flower's
    ``basic_auth`` option takes them; SettingsError naming ``source`` for an entry without both."""
    entries = [entry.strip() for line in text.splitlines() for entry in line.split(",")]
    entries = [entry for entry in entries if entry]
    if not entries:
        raise SettingsError(f"{source} holds no user:password entry")
    for number, entry in enumerate(entries, 1):
        user, colon, password = entry.partition(":")
        if not colon or not user or not password:
            # The entry itself may be a password: it is not repeated.
            raise SettingsError(f"{source}: entry {number} is not user:password")
    return entries


def read_basic_auth(path: Path) -> list[str]:
    source = f"{AUTH_FILE_OPTION} {path}"
    return parse_basic_auth(read_password_file(AUTH_FILE_OPTION, str(path)), source)


def sentinels_of(url: str) -> list[tuple[str, int]]:
    """The sentinels a ``sentinel://host:port;sentinel://...`` broker URL names, in its order."""
    return [(parts.hostname or "localhost", parts.port or 26379) for parts in map(urlsplit, url.split(";"))]


def primary_url(url: str, host: str, port: int) -> str:
    """A ``redis://`` URL of the primary at ``host:port`` with the user, password and database of the
    sentinel URL ``url`` (kombu gives its first part's password to the primary, as here)."""
    first = urlsplit(url.split(";")[0])
    userinfo, at, _ = first.netloc.rpartition("@")
    shown_host = f"[{host}]" if ":" in host else host
    return first._replace(scheme="redis", netloc=f"{userinfo}{at}{shown_host}:{port}").geturl()


def discover_primary(url: str, master: str, sentinel_kwargs: dict[str, Any] | None) -> tuple[str, int] | None:
    """The primary of service ``master`` as the first answering sentinel of ``url`` names it, or None.
    The sentinels get no password unless ``sentinel_kwargs`` gives one, as kombu's transport does."""
    import redis
    from redis.sentinel import MasterNotFoundError, Sentinel

    asked = {"socket_connect_timeout": SENTINEL_TIMEOUT, "socket_timeout": SENTINEL_TIMEOUT}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        sentinels_of(url), sentinel_kwargs={**asked, **(sentinel_kwargs or {})}
    )
    try:
        host, port = sentinel.discover_master(master)  # type: ignore[no-untyped-call]
    except (MasterNotFoundError, redis.RedisError, OSError):
        return None
    finally:
        for client in sentinel.sentinels:
            client.close()
    return str(host), int(port)


def flower_class() -> type[Any]:
    """Flower's application, whose Broker tab finds a Sentinel broker's primary through every sentinel."""
    from flower.app import Flower

    class ReservationsFlower(Flower):  # type: ignore[misc]
        @property
        def broker_uri_with_password(self) -> str:
            conf = self.capp.conf
            url: str = conf.broker_url
            options = conf.broker_transport_options or {}
            if is_sentinel(url) and options.get("master_name"):
                found = discover_primary(url, options["master_name"], options.get("sentinel_kwargs"))
                if found is not None:
                    return primary_url(url, *found)
            # Not Sentinel, or no sentinel answers: Flower's own, whose error the tab then reports.
            with self.capp.connection() as connection:
                uri: str = connection.as_uri(include_password=True)
                return uri

    return ReservationsFlower


def run_flower(app: Celery, argv: list[str], basic_auth: list[str] | None) -> None:
    """Flower's command (``flower.command.flower``) on ``app``, Flower's own options from ``argv`` (and
    ``FLOWER_*`` variables, and a ``flowerconfig.py``), ``basic_auth`` set past them, until SIGTERM or
    Ctrl-C."""
    from flower import command
    from tornado.options import options

    command.apply_env_options()
    command.apply_options("reservations flower", argv)
    if basic_auth:
        options.basic_auth = basic_auth
    problem = exposure_problem(options.address, bool(options.basic_auth or options.auth))
    if problem and not options.unix_socket:
        fail(EXIT_USAGE, problem)
    command.extract_settings()
    command.setup_logging()
    flower = flower_class()(capp=app, options=options, **command.settings)
    atexit.register(flower.stop)
    signal.signal(signal.SIGTERM, command.sigterm_handler)
    port = flower.start_http_server()
    # Flower's banner; its broker URL is kombu's, the password masked.
    command.print_banner(app, "ssl_options" in command.settings, port)
    with suppress(KeyboardInterrupt, SystemExit):
        flower.start()


def flower_command(
    host: Annotated[
        str, typer.Option(help="Address to listen on: loopback by default; elsewhere a password is needed.")
    ] = "127.0.0.1",
    port: Annotated[int, count("--port", 1, 65535, "Port to listen on.")] = 5555,
    basic_auth_file: Annotated[
        Path | None,
        typer.Option(
            AUTH_FILE_OPTION,
            help="A file of user:password entries (comma- or newline-separated): Flower asks for one.",
            show_default=False,
        ),
    ] = None,
    url_prefix: Annotated[
        str, typer.Option(help="Serve under this path (behind a proxy that forwards /PREFIX/).")
    ] = "",
) -> None:
    """Run Flower (pip install 'fenced-reservations[flower]') on the workers' broker: the same settings
    (RESERVATIONS_BROKER_URL, its password file, RESERVATIONS_SENTINEL_MASTER), so Redis, RabbitMQ and
    Sentinel brokers all work. Start workers with task events (RESERVATIONS_TASK_EVENTS=1 or -E) to see
    each request's outcome from its start.

    Flower's other options come from FLOWER_* variables (FLOWER_MAX_TASKS=...) or a flowerconfig.py.

    Example: reservations flower --port 5555 --basic-auth-file /run/secrets/flower_auth
    """
    try:
        import flower  # noqa: F401
    except ImportError:
        fail(EXIT_USAGE, "Flower is not installed: pip install 'fenced-reservations[flower]'")
    from tasks import create_app

    problem = broker_problem(config.settings.broker_url)
    if problem:
        fail(EXIT_USAGE, problem)
    auth = None
    if basic_auth_file is not None:
        try:
            auth = read_basic_auth(basic_auth_file)
        except SettingsError as exc:
            fail(EXIT_USAGE, str(exc))
    argv = [f"--address={host}", f"--port={port}"]
    if url_prefix:
        argv.append(f"--url_prefix={url_prefix}")
    run_flower(create_app(config.settings), argv, auth)
