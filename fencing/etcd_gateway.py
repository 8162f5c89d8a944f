"""etcd v3 through its JSON gateway: the one file of this package that speaks to etcd.

The client is httpx on the gateway every etcd server has served on its client port since 3.4 (``/v3/``, the
same in 3.5): a blocking client for workers and an asyncio one for services from one library that the
package's other HTTP code already uses, with no gRPC stack. etcd3gw speaks the same gateway but blocks only,
talks to one member and cannot authenticate; aetcd is asyncio-only and brings grpcio. Swapping the client
means rewriting this file only: the lease core (:mod:`fencing.etcd_backend`) yields :class:`Gateway`
calls and reads the gateway's JSON.

Members are tried in turn for up to ``retry_for`` seconds (:meth:`_Members.call`); a call that then fails
as :class:`BackendUnavailable` may or may not have taken effect, so the core makes every write safe to
repeat or to leave undone.

httpx is imported where a call is made, not with this module: every process that reads lease URLs imports
this one (the worker, the command line), and only those on etcd need an HTTP client.
"""

from __future__ import annotations

import base64
import functools
import itertools
import time
from collections.abc import Awaitable, Callable, Generator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlsplit

from sqlalchemy.util import await_only, greenlet_spawn

from fencing.errors import BackendUnavailable, InvalidLeaseRequest
from fencing.plan import Atomic, Gateway, Op, Plan, Sleep, foreign, run_sync, taken
from fencing.redis_backend import validate_prefix

if TYPE_CHECKING:
    import ssl

    import httpx

T = TypeVar("T")

ETCD_SCHEMES = ("etcd", "etcds")
# gRPC codes the gateway answers with when the cluster cannot serve a call now: UNAVAILABLE (no leader, a
# leader change, a request that timed out in consensus), DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED (too many
# requests in flight, or the backend quota reached until a compaction: "not now", as Redis's OOM is).
_NOT_NOW = frozenset({14, 4, 8})


@dataclass(frozen=True)
class EtcdTarget:
    """Where an ``etcd://`` URL points: the members' base URLs, the key prefix and the credentials."""

    members: tuple[str, ...]
    prefix: str | None  # None: the manager's own
    username: str | None = None
    password: str | None = None


def etcd_target(url: str) -> EtcdTarget:
    """``etcd[s]://[user[:password]@]host[:port][,host[:port]...][/prefix]`` (port 2379 unless given);
    InvalidLeaseRequest says why not."""
    scheme, _, rest = url.partition("://")
    authority, _, path = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    members = []
    for host in hosts.split(","):
        parts = urlsplit(f"//{host}")
        try:
            port = parts.port or 2379
        except ValueError:
            port = 0
        if not parts.hostname or not port:
            raise InvalidLeaseRequest(f"etcd members are host or host:port, not {host!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        members.append(f"{'https' if scheme == 'etcds' else 'http'}://{host}:{port}")
    user, _, password = userinfo.partition(":")
    prefix = validate_prefix(unquote(path.strip("/"))) if path.strip("/") else None
    return EtcdTarget(
        tuple(members), prefix, unquote(user) if at else None, unquote(password) if at else None
    )


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(text: str) -> str:
    return base64.b64decode(text).decode()


class _Members:
    """The member to ask next (the one that last answered, then the others in turn), and the auth token."""

    def __init__(self, target: EtcdTarget, retry_for: float, timeout: float) -> None:
        self.target = target
        self.retry_for = retry_for
        self.timeout = timeout
        self.first = 0
        self.token: str | None = None  # when the URL names a user

    def call(self, op: Gateway) -> Generator[httpx.Request | Sleep, httpx.Response, dict[str, Any]]:
        """The exchange for one gateway call, written once for both executors: it yields each request to
        send (or a pause between rounds of the members) and receives the response; it returns the reply,
        or raises the refusal or BackendUnavailable."""
        import httpx

        deadline = time.monotonic() + self.retry_for
        count, last, start = len(self.target.members), "no member answered", self.first

        def post(member: str, path: str, body: dict[str, Any], **headers: str) -> httpx.Request:
            # No request outlives the call's deadline: a member that takes the connection and never
            # answers costs what is left, not a whole timeout per member.
            seconds = max(0.05, min(self.timeout, deadline - time.monotonic()))
            timeout = httpx.Timeout(seconds).as_dict()
            return httpx.Request(
                "POST", f"{member}/v3/{path}", json=body, headers=headers, extensions={"timeout": timeout}
            )

        for n in itertools.count():
            if n and time.monotonic() >= deadline:
                raise BackendUnavailable(backend="etcd", operation=op.path, detail=last)
            if n and n % count == 0:
                yield Sleep(0.05)
            self.first = index = (start + n) % count
            member = self.target.members[index]
            try:
                if self.target.username is not None and self.token is None:
                    login = {"name": self.target.username, "password": self.target.password or ""}
                    reply = self._answer(op, (yield post(member, "auth/authenticate", login)))
                    if reply is None:
                        continue
                    self.token = reply["token"]
                headers = {"Authorization": self.token} if self.token else {}
                response = yield post(member, op.path, op.body, **headers)
                if (reply := self._answer(op, response)) is not None:
                    return reply
                last = response.text
            except (httpx.TransportError, ValueError) as exc:  # no answer, or not the gateway's JSON
                last = f"{type(exc).__name__}: {exc}"
        raise AssertionError("unreachable")

    def _answer(self, op: Gateway, response: httpx.Response) -> dict[str, Any] | None:
        """The reply, None for "not now: ask the next member", or the refusal raised."""
        body = response.json() if response.content else {}
        if response.status_code == 200:
            reply: dict[str, Any] = body.get("result", body)  # keepalive wraps its reply in "result"
            return reply
        code = body.get("code")
        if code in _NOT_NOW or response.status_code in (502, 503, 504):
            return None
        if code == 16 and self.token is not None:  # UNAUTHENTICATED: the token expired; log in again
            self.token = None
            return None
        raise EtcdRefused(op.path, code, str(body.get("error") or body.get("message") or body))


class EtcdRefused(Exception):
    """etcd answered and refused the call (a lease it does not know, a bad request): not an outage."""

    def __init__(self, path: str, code: object, message: str) -> None:
        self.path, self.code, self.message = path, code, message
        super().__init__(f"etcd refused {path}: {message}")


@functools.cache
def _verifying() -> ssl.SSLContext:
    """httpx's default TLS context (the system's CA bundle loaded), made once per process and shared by
    every client not given one: httpx makes one per client otherwise, about 30 ms of CPU each."""
    import httpx

    return httpx.create_ssl_context()


class SyncEtcdExecutor:
    """Runs plans' gateway calls with a blocking httpx client, or with ``client`` given and each of its
    answers taken through ``wait`` (:class:`AsyncEtcdExecutor`'s asyncio client, awaited)."""

    def __init__(
        self,
        target: EtcdTarget,
        sleep: Callable[[float], None],
        *,
        retry_for: float = 5.0,
        client: Any = None,
        wait: Callable[[Any], Any] = taken,
        **options: Any,
    ) -> None:
        import httpx

        self.members = _Members(target, retry_for, options.pop("timeout", 3.0))
        self.sleep = sleep
        self.client = client or httpx.Client(**{"verify": _verifying(), **options})
        self._wait = wait

    def run(self, plan: Plan[T]) -> T:
        return run_sync(plan, self._handle)

    def unit(self) -> nullcontext[Callable[[Op], Any]]:
        return nullcontext(self._handle)

    def _handle(self, op: Op) -> Any:
        if isinstance(op, Sleep):
            return self.sleep(op.seconds)
        if isinstance(op, Atomic):
            return self.run(op.plan)
        if not isinstance(op, Gateway):
            raise foreign("etcd", op)
        return run_sync(self.members.call(op), self._send)

    def _send(self, step: httpx.Request | Sleep) -> Any:
        return self.sleep(step.seconds) if isinstance(step, Sleep) else self._wait(self.client.send(step))

    def close(self) -> None:
        self.client.close()


class AsyncEtcdExecutor:
    """:class:`SyncEtcdExecutor` on an asyncio httpx client: the same executor, run through SQLAlchemy's
    greenlet bridge as :class:`fencing.sql.AsyncSqlExecutor` runs the SQL one, each request awaited."""

    def __init__(
        self,
        target: EtcdTarget,
        sleep: Callable[[float], Awaitable[Any]],
        *,
        retry_for: float = 5.0,
        **options: Any,
    ) -> None:
        import httpx

        timeout = options.pop("timeout", 3.0)
        self.client = httpx.AsyncClient(**{"verify": _verifying(), **options})
        self._blocking = SyncEtcdExecutor(
            target,
            lambda seconds: await_only(sleep(seconds)),
            retry_for=retry_for,
            timeout=timeout,
            client=self.client,
            wait=await_only,
        )

    async def run(self, plan: Plan[T]) -> T:
        return await greenlet_spawn(self._blocking.run, plan)

    async def close(self) -> None:
        await self.client.aclose()
