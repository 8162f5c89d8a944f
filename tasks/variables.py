"""Settings read from ``RESERVATIONS_*`` environment variables, each a field of a frozen dataclass declared
with :func:`setting`, its annotation the type. :func:`read` reads a whole table and reports every problem
at once, each by its variable's name. A URL that can carry a password may take it from a file (a compose
secret): ``RESERVATIONS_DATABASE_PASSWORD_FILE`` for ``RESERVATIONS_DATABASE_URL``, the URL naming the user
without a password.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

from fencing.urls import mask_url
from reservations import numerals

PREFIX = "RESERVATIONS_"

# Where a value came from, as ``reservations config`` reports it.
DEFAULT, ENVIRONMENT, FILE, OPTION, GIVEN = "default", "environment", "file", "option", "given"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# The form kombu's Sentinel transport and Celery's Sentinel result backend both read.
_SENTINELS = ";"

T = TypeVar("T")


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


def declared(settings_class: type[Any]) -> tuple[Variable, ...]:
    """The variables a settings dataclass declares with :func:`setting`, in the order of its fields."""
    return tuple(
        Variable(field=f.name, type=str(f.type), default=f.default, **f.metadata["setting"])
        for f in fields(settings_class)
        if "setting" in f.metadata
    )


def read(
    variables: tuple[Variable, ...], env: Mapping[str, str], options: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """The values ``env`` gives ``variables``, with ``options`` (by field, as text: a command line's own
    options) winning over it; where each came from; the password file each URL's password was read from.
    All by field, the unset left out. Raises SettingsError naming every problem."""
    by_field = {variable.field: variable for variable in variables}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    files: dict[str, str] = {}
    problems: list[str] = []
    for variable in variables:
        raw = options.get(variable.field) or env.get(variable.name) or ""
        try:
            if raw:
                values[variable.field] = variable.parse(raw)
                sources[variable.field] = OPTION if options.get(variable.field) else ENVIRONMENT
            if variable.url and env.get(variable.password_file):
                # A URL left unset is its default, or the value of the field it defaults to.
                origin = by_field[variable.default_from] if variable.default_from else variable
                url = values.get(variable.field) or values.get(origin.field) or origin.default
                values[variable.field] = with_password(env, variable, url)
                sources[variable.field], files[variable.field] = FILE, env[variable.password_file]
        except SettingsError as exc:
            problems.extend(exc.problems)
    if problems:
        raise SettingsError(problems)
    return values, sources, files


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


def _read_password_file(name: str, path: str) -> str:
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
    password = _read_password_file(variable.password_file, path).removesuffix("\n").removesuffix("\r")
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
