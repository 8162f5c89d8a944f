"""Database and broker URLs: the drivers a database URL is given, and every URL as it may be printed."""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url

from fencing.errors import InvalidLeaseRequest

SUPPORTED_DIALECTS = ("sqlite", "postgresql")


def normalize_url(url: str | URL, *, asynchronous: bool = False) -> URL:
    """Pick the drivers this package ships with: psycopg 3 for PostgreSQL, aiosqlite for async SQLite."""
    try:
        parsed = make_url(url)
    except Exception as exc:  # ArgumentError, ValueError: the caller only needs "not a usable URL"
        raise InvalidLeaseRequest(f"not a database URL: {mask_url(str(url))}") from exc
    backend = parsed.get_backend_name()
    if backend not in SUPPORTED_DIALECTS:
        raise InvalidLeaseRequest(f"unsupported database {backend!r}; use sqlite or postgresql")
    if backend == "postgresql":
        return parsed.set(drivername="postgresql+psycopg")
    return parsed.set(drivername="sqlite+aiosqlite" if asynchronous else "sqlite+pysqlite")


_SECRET_QUERY_KEYS = ("password", "passwd", "pwd", "secret", "token", "sslpassword")


def mask_url(url: str | URL) -> str:
    """The URL as it may be printed: the password, and password-like query parameters, as ``***``. A
    list of URLs (kombu's ``sentinel://a;sentinel://b``) is masked part by part; one naming several
    hosts (``redis+sentinel://:pw@s1:26379,s2:26379/service``), which SQLAlchemy cannot parse, by hand."""
    if isinstance(url, str) and ";" in url and all("://" in part for part in url.split(";") if part):
        return ";".join(mask_url(part) if part else "" for part in url.split(";"))
    try:
        parsed = make_url(_quote_userinfo_at(url) if isinstance(url, str) else url)
    except Exception:
        return _mask_by_hand(url) if isinstance(url, str) and "://" in url else "<unparseable url>"
    query = {
        key: ("***" if any(word in key.lower() for word in _SECRET_QUERY_KEYS) else value)
        for key, value in parsed.query.items()
    }
    return parsed.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def _mask_by_hand(url: str) -> str:
    """``url`` with the password of its user information and its password-like query values as ``***``,
    the rest as written."""
    scheme, _, rest = url.partition("://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    userinfo, at, hosts = rest[:end].rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.partition(":")[0] + ":***"
    tail = rest[end:]
    path, question, query = tail.partition("?")
    if question:
        pairs = [pair.partition("=") for pair in query.split("&")]
        query = "&".join(
            f"{key}{eq}{'***' if any(word in key.lower() for word in _SECRET_QUERY_KEYS) else value}"
            for key, eq, value in pairs
        )
    return f"{scheme}://{userinfo}{at}{hosts}{path}{question}{query}"


def _quote_userinfo_at(url: str) -> str:
    """``url`` with each ``@`` before the last one of its authority written ``%40``. Redis and the
    broker (urllib, kombu) take the host after the last ``@``, so ``redis://:my@secret@host`` has the
    password ``my@secret``; SQLAlchemy's parser stops at the first and would print ``secret`` as part of
    the host."""
    scheme, sep, rest = url.partition("://")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    if not sep or not at:
        return url
    return f"{scheme}://{userinfo.replace('@', '%40')}@{host}{rest[end:]}"
