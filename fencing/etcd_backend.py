"""etcd lease backend: the token is a revision that a majority of the cluster agreed on, so no failover
hands one out twice; what that buys and costs, what is kept of an epoch, and the base after a restore:
docs/operations.md, "etcd".

Each live lease is a key, ``<prefix>/lease/<scope>``, attached to an etcd lease whose TTL is the lease's
ttl, so the cluster expires it by its own clock. Acquire creates the key in a transaction that succeeds only
if the key is absent; the token is the key's create revision plus the store's *base* (``<prefix>/base``, 0
until raised), which :meth:`EtcdLeaseCore.repair` raises when a refused write proves the store behind.

The key is removed only with its etcd lease (a release or a break revokes it; expiry drops both), so a
keepalive that finds the etcd lease alive finds the key alive: renew is one keepalive, release one revoke.
The etcd lease's ID is derived from the holder's own lease id, which makes a grant repeated after a lost
answer harmless and lets a stale holder reach only its own, expired, lease. Each epoch is a key under
``<prefix>/epoch/<scope>/``, trimmed to ``history_cap`` by the acquire that adds one; its times are the
acquirer's wall clock.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

from fencing.errors import BackendUnavailable, InvalidLeaseRequest, LeaseBusy, TokenOverflow
from fencing.etcd_gateway import EtcdRefused, b64, unb64
from fencing.lease import MAX_TOKEN, Clock, Lease, LeaseEvent, LeaseInfo
from fencing.plan import Gateway, Plan


def etcd_lease_id(lease_id: str) -> int:
    """The etcd lease of a holder's lease: 60 bits of its 128 random ones (etcd lease IDs are int64)."""
    return int(lease_id[:15], 16)


# How many times an acquire grants its etcd lease again when it expired before the key was written.
REGRANTS = 3

# The shortest ttl a cluster with etcd's default election timeout (1 s) grants: 1.5 of them, rounded up.
ETCD_MIN_TTL = 2


def whole_seconds(ttl: float, minimum: int = ETCD_MIN_TTL) -> int:
    """etcd's TTLs are whole seconds, and the cluster grants no fewer than its minimum (1.5 election
    timeouts): a ttl it would silently lengthen is refused here."""
    if ttl != int(ttl) or ttl < minimum:
        raise InvalidLeaseRequest(
            f"etcd lease ttls are whole seconds, at least {minimum} (this cluster's minimum); got {ttl}"
        )
    return int(ttl)


def _range(key: str, *, prefix: bool = False, **options: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), **options}
    if prefix:
        body["range_end"] = b64(key[:-1] + chr(ord(key[-1]) + 1))
    return {"request_range": body}


def _put(key: str, value: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {
        "request_put": {"key": b64(key), "value": b64(json.dumps(value, separators=(",", ":"))), **options}
    }


def _kvs(reply: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The key-values of each range in a transaction's reply, in order."""
    return [r.get("response_range", {}).get("kvs", []) for r in reply.get("responses", [])]


def _value(kv: dict[str, Any]) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(unb64(kv.get("value", "")) or "{}")
    return value


def _same(key: str, target: str, revision: object) -> dict[str, Any]:
    """A transaction's compare: ``key``'s CREATE or MOD revision is still ``revision`` (0: absent)."""
    return {"key": b64(key), "target": target, "result": "EQUAL", f"{target.lower()}_revision": revision}


def _base(base_kv: list[dict[str, Any]]) -> int:
    return int(unb64(base_kv[0]["value"])) if base_kv else 0


def _token(kv: dict[str, Any]) -> int:
    """A lease or epoch key's token: the base it was created under plus its create revision."""
    return int(_value(kv).get("base", 0)) + int(kv["create_revision"])


class EtcdLeaseCore:
    """Decisions and parsing for the etcd backend; no I/O."""

    backend = "etcd"

    def __init__(self, *, prefix: str, history_cap: int, clock: Clock, min_ttl: int = ETCD_MIN_TTL) -> None:
        self.prefix = prefix
        self.history_cap = history_cap
        self.clock = clock
        self.min_ttl = min_ttl
        self.base_key = f"{prefix}/base"

    def _lease_key(self, scope: str) -> str:
        return f"{self.prefix}/lease/{quote(scope, safe='')}"

    def _epochs(self, scope: str) -> str:
        return f"{self.prefix}/epoch/{quote(scope, safe='')}/"

    def acquire(self, scope: str, ttl: float, holder: str, lease_id: str) -> Plan[Lease | LeaseBusy]:
        seconds = whole_seconds(ttl, self.min_ttl)
        sent_at = self.clock()
        key, epochs, etcd_id = self._lease_key(scope), self._epochs(scope), etcd_lease_id(lease_id)
        granted, expired = False, 0
        while True:
            ranges = [_range(key), _range(self.base_key), _range(epochs, prefix=True, keys_only=True)]
            seen = yield Gateway("kv/txn", {"success": ranges})
            (held, base_kv, old) = _kvs(seen)
            if held:
                value = _value(held[0])
                if value.get("id") == lease_id:  # this acquire's own key: an answer was lost on the way
                    return Lease(scope, _token(held[0]), lease_id, holder, ttl, sent_at, clock=self.clock)
                if granted:
                    yield from self._revoke(etcd_id)
                return LeaseBusy(
                    scope=scope,
                    holder=str(value.get("h")),
                    token=_token(held[0]),
                    retry_after=float(value.get("ttl", 1)),
                )
            base = _base(base_kv)
            if base + int(seen["header"]["revision"]) + 1 > MAX_TOKEN:
                raise TokenOverflow.exhausted(scope, base + int(seen["header"]["revision"]), MAX_TOKEN)
            if not granted:
                yield from self._grant(etcd_id, seconds)
                granted = True
            old.sort(key=lambda kv: int(kv["create_revision"]))
            at = round(time.time() * 1000)
            compare = [
                _same(key, "CREATE", 0),
                _same(self.base_key, "MOD", base_kv[0]["mod_revision"] if base_kv else 0),
            ]
            success = [
                _put(key, {"id": lease_id, "h": holder, "ttl": seconds, "base": base}, lease=etcd_id),
                _put(epochs + lease_id, {"h": holder, "at": at, "base": base}),
                *(
                    {"request_delete_range": {"key": kv["key"]}}
                    for kv in old[: max(0, len(old) + 1 - self.history_cap)]
                ),
            ]
            try:
                done = yield Gateway("kv/txn", {"compare": compare, "success": success})
            except EtcdRefused as exc:
                if "lease not found" not in exc.message:
                    raise
                # The etcd lease granted for the key expired before the key was written (the cluster
                # stalled past its ttl, or lost its leader): nothing was written under it. Grant it again,
                # a few times: a cluster that keeps losing them is unavailable.
                expired += 1
                if expired > REGRANTS:
                    raise BackendUnavailable(backend="etcd", operation="acquire", detail=exc.message) from exc
                granted = False
                continue
            if done.get("succeeded"):
                token = base + int(done["header"]["revision"])
                return Lease(scope, token, lease_id, holder, ttl, sent_at, clock=self.clock)
            # Another acquirer created the key first, or the base was raised: look again.

    def _grant(self, etcd_id: int, seconds: int) -> Plan[None]:
        try:
            granted = yield Gateway("lease/grant", {"TTL": seconds, "ID": etcd_id})
        except EtcdRefused as exc:
            if "already exists" not in exc.message:  # else a grant repeated after its answer was lost
                raise
            return
        if int(granted.get("TTL", seconds)) > seconds:
            yield from self._revoke(etcd_id)
            raise InvalidLeaseRequest(
                f"this etcd cluster grants leases of at least {granted['TTL']} s, not {seconds} s"
            )

    def _revoke(self, etcd_id: int) -> Plan[bool]:
        """Revoke an etcd lease (and with it its key); False if etcd no longer knows it."""
        try:
            yield Gateway("lease/revoke", {"ID": etcd_id})
        except EtcdRefused:
            return False
        return True

    def renew(self, lease: Lease) -> Plan[Lease]:
        sent_at = self.clock()
        reply = yield Gateway("lease/keepalive", {"ID": etcd_lease_id(lease.lease_id)})
        if int(reply.get("TTL", 0)) <= 0:
            raise lease.lose("expired, released or broken at the coordinator")
        lease._renewed(sent_at)
        return lease

    def release(self, lease: Lease) -> Plan[bool]:
        if not (yield from self._revoke(etcd_lease_id(lease.lease_id))):
            raise lease.lose("expired or broken at the coordinator")
        return True  # contention is not marked on etcd: "maybe contended"

    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]:
        key = self._lease_key(scope)
        (held,) = _kvs((yield Gateway("kv/txn", {"success": [_range(key)]})))
        if not held or not (yield from self._revoke(int(held[0]["lease"]))):
            return None
        value = _value(held[0])
        epoch = self._epochs(scope) + str(value.get("id"))
        ended = {"h": value.get("h"), "at": None, "base": value.get("base", 0), "end": "broken", "d": reason}
        (kept,) = _kvs((yield Gateway("kv/txn", {"success": [_range(epoch)]})))
        if kept:
            ended["at"] = _value(kept[0]).get("at")
            ended["end_at"] = round(time.time() * 1000)
            compare = [_same(epoch, "CREATE", kept[0]["create_revision"])]
            yield Gateway("kv/txn", {"compare": compare, "success": [_put(epoch, ended)]})
        return LeaseInfo(scope=scope, token=_token(held[0]), holder=str(value.get("h")), time_left=0.0)

    def repair(self, lease: Lease, highest: int) -> Plan[tuple[int, int] | None]:
        """Raise the base so that the next token passes ``highest``, if ``lease`` is still the live one."""
        key = self._lease_key(lease.scope)
        held, base_kv = _kvs((yield Gateway("kv/txn", {"success": [_range(key), _range(self.base_key)]})))
        if not held or _value(held[0]).get("id") != lease.lease_id:
            return None
        base = _base(base_kv)
        if highest <= base:
            return None
        still = _same(key, "CREATE", held[0]["create_revision"])
        done = yield Gateway("kv/txn", self._raising(base_kv, highest, still))
        return (base, highest) if done.get("succeeded") else None

    def raise_base(self, highest: int) -> Plan[int]:
        """Raise the base to ``highest`` if it is below: every later token exceeds it. The base after."""
        while True:
            (base_kv,) = _kvs((yield Gateway("kv/txn", {"success": [_range(self.base_key)]})))
            base = _base(base_kv)
            if highest <= base:
                return base
            if (yield Gateway("kv/txn", self._raising(base_kv, highest))).get("succeeded"):
                return highest

    def _raising(
        self, base_kv: list[dict[str, Any]], highest: int, *guards: dict[str, Any]
    ) -> dict[str, Any]:
        """The transaction that writes ``highest`` as the base, only if the base is still the one read (and
        ``guards`` hold): a base only rises."""
        unchanged = _same(self.base_key, "MOD", base_kv[0]["mod_revision"] if base_kv else 0)
        put = {"request_put": {"key": b64(self.base_key), "value": b64(str(highest))}}
        return {"compare": [*guards, unchanged], "success": [put]}

    def current_many(self, scopes: list[str]) -> Plan[list[LeaseInfo | None]]:
        found: list[LeaseInfo | None] = []
        for start in range(0, len(scopes), 100):  # etcd takes 128 operations per transaction by default
            chunk = scopes[start : start + 100]
            reply = yield Gateway("kv/txn", {"success": [_range(self._lease_key(scope)) for scope in chunk]})
            for scope, held in zip(chunk, _kvs(reply), strict=True):
                if not held:
                    found.append(None)
                    continue
                left = yield Gateway("lease/timetolive", {"ID": held[0]["lease"]})
                value = _value(held[0])
                found.append(
                    LeaseInfo(
                        scope=scope,
                        token=_token(held[0]),
                        holder=str(value.get("h")),
                        time_left=max(int(left.get("TTL", 0)), 0),
                    )
                    if int(left.get("TTL", -1)) >= 0
                    else None
                )
        return found

    def history(self, scope: str, limit: int) -> Plan[list[LeaseEvent]]:
        newest = _range(
            self._epochs(scope), prefix=True, sort_target="CREATE", sort_order="DESCEND", limit=limit
        )
        reply = yield Gateway("kv/txn", {"success": [newest]})
        events: list[LeaseEvent] = []
        for kv in reversed(_kvs(reply)[0]):
            value, lease_id = _value(kv), unb64(kv["key"]).rsplit("/", 1)[1]
            token, holder = _token(kv), value.get("h")
            if value.get("at") is not None:
                events.append(LeaseEvent(scope, "acquired", token, holder, lease_id, value["at"] / 1000))
            if value.get("end") == "broken":
                at = value.get("end_at") or value.get("at") or 0
                events.append(
                    LeaseEvent(scope, "broken", token, holder, lease_id, at / 1000, detail=value.get("d"))
                )
        return events[-limit:]

    def purge_history(self, older_than_ms: int) -> Plan[int]:
        """Each scope keeps its last ``history_cap`` epochs, trimmed by the acquire that adds one."""
        return 0
        yield  # a plan, though it sends nothing
