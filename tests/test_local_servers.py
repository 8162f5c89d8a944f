"""tasks.local_servers without I/O: requests of one process handed in memory to the thread that serves
their SKU, taken oldest first, withdrawn only before a batch has them, and given back unserved when the
last server of the SKU leaves; a server leaves only when nothing joined or was handed off meanwhile.
"""

from __future__ import annotations

import threading

from reservations.batch_statement import InHand
from reservations.request_outcomes import RequestResult
from tasks.local_servers import Joined, LocalServers

SKU = "HOT"

# Long enough never to expire in a passing run: a wait that returns True was released, not timed out.
RELEASED_WITHIN = 30.0


def request(key: str, sku: str = SKU, quantity: int = 1) -> InHand:
    return InHand(key=key, sku=sku, quantity=quantity, hold_ms=None, task_id=f"task-{key}", epochs=0)


def result(key: str) -> RequestResult:
    return RequestResult(
        key=key,
        operation="reserve",
        status="reserved",
        detail={"quantity": 1},
        task_id=f"task-{key}",
        worker="w1",
        epochs=0,
        at=0.0,
    )


def joined(servers: LocalServers, key: str, sku: str = SKU) -> Joined:
    found = servers.join(request(key, sku))
    assert found is not None, f"nobody serves {sku}"
    return found


def test_nobody_serves_a_sku_until_a_server_enters() -> None:
    servers = LocalServers()
    assert servers.serving(SKU) is False
    assert servers.join(request("early")) is None
    assert servers.handed_off(SKU) is False  # a hand-off nobody here will serve is not counted
    assert servers.joined(SKU) is False

    servers.enter(SKU)
    assert servers.serving(SKU) is True
    assert servers.handoffs(SKU) == 0  # the earlier hand-off was not kept for the new server
    assert servers.join(request("other", sku="COLD")) is None  # serving one SKU serves no other
    assert servers.join(request("late")) is not None
    assert servers.joined(SKU) is True


def test_take_returns_the_joined_requests_oldest_first_up_to_most() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    keys = [f"r-{i}" for i in range(5)]
    handed = [joined(servers, key) for key in keys]

    first = servers.take(SKU, 3)
    assert [j.request.key for j in first] == keys[:3]
    assert first == handed[:3]  # the very objects the senders wait on
    assert servers.joined(SKU) is True
    rest = servers.take(SKU, 10)
    assert [j.request.key for j in rest] == keys[3:]
    assert servers.take(SKU, 10) == []
    assert servers.joined(SKU) is False
    # Taken requests are the server's to answer: taking answers none of them.
    assert not any(j.wait(0) for j in handed)


def test_take_of_zero_takes_nothing() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    waiting = joined(servers, "r-0")
    assert servers.take(SKU, 0) == []
    assert servers.take(SKU, 1) == [waiting]


def test_leave_with_seen_refuses_while_a_request_is_joined() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    seen = servers.handoffs(SKU)
    waiting = joined(servers, "r-0")

    assert servers.leave(SKU, seen) is False
    assert servers.serving(SKU) is True
    assert not waiting.wait(0)  # a refused leave gives nothing back

    assert servers.take(SKU, 10) == [waiting]
    assert servers.leave(SKU, seen) is True
    assert servers.serving(SKU) is False
    assert servers.join(request("after")) is None


def test_leave_with_seen_refuses_after_a_hand_off_was_counted_since() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    seen = servers.handoffs(SKU)
    assert servers.handed_off(SKU) is True

    assert servers.leave(SKU, seen) is False
    assert servers.serving(SKU) is True
    # The server reads the count again (and serves the list) before it may leave.
    again = servers.handoffs(SKU)
    assert again == seen + 1
    assert servers.leave(SKU, again) is True
    assert servers.serving(SKU) is False


def test_the_last_servers_leave_gives_back_the_requests_still_joined() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    taken = joined(servers, "taken")
    assert servers.take(SKU, 1) == [taken]
    left = [joined(servers, f"left-{i}") for i in range(2)]

    assert servers.leave(SKU) is True

    for back in left:
        assert back.wait(0) is True  # released at once: the sender takes the usual way
        assert back.result is None and back.stored is False
    assert taken.wait(0) is False  # the batch that has it answers it, not the leave
    assert servers.serving(SKU) is False
    assert servers.joined(SKU) is False
    assert servers.join(request("after")) is None


def test_withdraw_succeeds_only_before_a_take() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    early = joined(servers, "early")
    assert servers.withdraw(early) is True
    assert servers.withdraw(early) is False  # withdrawn once
    assert servers.take(SKU, 10) == []  # a withdrawn request is never served

    late = joined(servers, "late")
    assert servers.take(SKU, 10) == [late]
    assert servers.withdraw(late) is False  # a batch has it: it will be answered


def test_withdraw_fails_once_the_last_server_gave_the_request_back() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    back = joined(servers, "back")
    assert servers.leave(SKU) is True
    assert back.wait(0) is True and back.result is None
    assert servers.withdraw(back) is False


def test_the_first_of_two_servers_to_leave_keeps_the_joined_requests_for_the_second() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    servers.enter(SKU)
    first, second = joined(servers, "r-0"), joined(servers, "r-1")

    assert servers.leave(SKU) is True
    assert servers.serving(SKU) is True
    assert not first.wait(0) and not second.wait(0)  # nothing given back while a server remains
    assert servers.take(SKU, 1) == [first]

    assert servers.leave(SKU) is True
    assert servers.serving(SKU) is False
    assert second.wait(0) is True and second.result is None
    assert first.wait(0) is False  # taken by the remaining server before it left


def test_answered_releases_a_waiter_of_another_thread_with_the_result() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    waiting = joined(servers, "r-0")
    about_to_wait = threading.Event()
    seen: dict[str, object] = {}

    def sender() -> None:
        about_to_wait.set()
        seen["released"] = waiting.wait(RELEASED_WITHIN)
        seen["result"], seen["stored"] = waiting.result, waiting.stored

    thread = threading.Thread(target=sender)
    thread.start()
    assert about_to_wait.wait(RELEASED_WITHIN)
    (taken,) = servers.take(SKU, 1)
    answer = result("r-0")
    taken.answered(answer, stored=True)
    thread.join(RELEASED_WITHIN)

    assert not thread.is_alive()
    assert seen == {"released": True, "result": answer, "stored": True}


def test_the_last_leave_releases_waiters_of_other_threads_unserved() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    keys = [f"r-{i}" for i in range(3)]
    handed = [joined(servers, key) for key in keys]
    ready = threading.Barrier(len(handed) + 1)
    seen: dict[str, tuple[bool, RequestResult | None]] = {}

    def sender(waiting: Joined) -> None:
        ready.wait(RELEASED_WITHIN)
        seen[waiting.request.key] = (waiting.wait(RELEASED_WITHIN), waiting.result)

    threads = [threading.Thread(target=sender, args=(j,)) for j in handed]
    for thread in threads:
        thread.start()
    ready.wait(RELEASED_WITHIN)
    assert servers.leave(SKU) is True
    for thread in threads:
        thread.join(RELEASED_WITHIN)

    assert not any(thread.is_alive() for thread in threads)
    assert seen == dict.fromkeys(keys, (True, None))


def test_requests_joined_from_many_threads_are_each_taken_exactly_once() -> None:
    servers = LocalServers()
    servers.enter(SKU)
    senders, each = 8, 50
    start = threading.Barrier(senders)
    handed: list[list[Joined]] = [[] for _ in range(senders)]

    def sender(n: int) -> None:
        start.wait(RELEASED_WITHIN)
        for i in range(each):
            handed[n].append(joined(servers, f"s{n}-{i}"))

    threads = [threading.Thread(target=sender, args=(n,)) for n in range(senders)]
    for thread in threads:
        thread.start()
    taken: list[Joined] = []
    while any(thread.is_alive() for thread in threads) or servers.joined(SKU):
        taken.extend(servers.take(SKU, 7))
    for thread in threads:
        thread.join(RELEASED_WITHIN)
    taken.extend(servers.take(SKU, senders * each))

    assert len(taken) == senders * each
    assert {id(j) for j in taken} == {id(j) for group in handed for j in group}
    # Oldest first holds per sender: each thread's requests are taken in the order it joined them.
    for n in range(senders):
        mine = [j.request.key for j in taken if j.request.key.startswith(f"s{n}-")]
        assert mine == [f"s{n}-{i}" for i in range(each)]
    assert servers.leave(SKU, servers.handoffs(SKU)) is True
