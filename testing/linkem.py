"""A slow link in user space, for kernels without tc's netem: the packets a host's nftables rules queue
(NFQUEUE) are held and let go later, out of order, or dropped, as netem would delay, jitter, reorder and
lose them. Spoken to over netlink directly (nfnetlink_queue), with the packets' metadata only.

Run inside the host's namespace: ``python -m testing.linkem --queue 0 --delay 0.3 --jitter 0.2 --loss 0.2
--reorder 0.25 --seconds 10``. It prints ``ready`` once bound to the queue and one JSON line of counts
when it ends: after ``--seconds`` at the latest, or on SIGTERM; either way it lets every held packet go.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import signal
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass
from types import FrameType

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG = 0, 1, 2
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND = 1
COPY_META = 1
CFG_F_FAIL_OPEN = 1  # a full queue lets packets through instead of dropping them
PACKET_HDR, VERDICT_HDR = 1, 2
NF_DROP, NF_ACCEPT = 0, 1
QUEUE_MAXLEN = 4096
TICK = 0.005  # the longest a held packet waits past its time


@dataclass(frozen=True)
class Impairment:
    delay: float = 0.0  # seconds added to every packet that is neither lost nor let go at once
    jitter: float = 0.0  # +- seconds around the delay, uniformly
    loss: float = 0.0  # share of packets dropped
    reorder: float = 0.0  # share of packets let go at once, overtaking the held ones

    def args(self) -> list[str]:
        return [
            *("--delay", f"{self.delay:g}", "--jitter", f"{self.jitter:g}"),
            *("--loss", f"{self.loss:g}", "--reorder", f"{self.reorder:g}"),
        ]

    def decide(self, rng: random.Random) -> float | None:
        """How long to hold one packet; None to drop it."""
        if rng.random() < self.loss:
            return None
        if rng.random() < self.reorder:
            return 0.0
        return max(0.0, self.delay + rng.uniform(-self.jitter, self.jitter))


class LinkemError(RuntimeError):
    """The kernel refused to bind the queue (no nfnetlink_queue, or another program holds it)."""


def _message(kind: int, flags: int, payload: bytes, seq: int = 0) -> bytes:
    return struct.pack("=IHHII", 16 + len(payload), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + payload


def _attribute(kind: int, data: bytes) -> bytes:
    size = 4 + len(data)
    return struct.pack("=HH", size, kind) + data + b"\0" * (-size % 4)


class Queue:
    """One bound NFQUEUE: packet ids in, verdicts out."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self._header = struct.pack("!BBH", socket.AF_UNSPEC, 0, number)
        self._configure(1, _attribute(CFG_CMD, struct.pack("!BxH", CMD_BIND, 0)))
        self._configure(2, _attribute(CFG_PARAMS, struct.pack("!IB", 0, COPY_META)))
        self._configure(3, _attribute(CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)))
        flags = struct.pack("!I", CFG_F_FAIL_OPEN)
        self._configure(4, _attribute(CFG_FLAGS, flags) + _attribute(CFG_MASK, flags))

    def _configure(self, seq: int, attributes: bytes) -> None:
        self.sock.send(_message(MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, self._header + attributes, seq))
        self.sock.settimeout(5.0)
        reply = self.sock.recv(65536)
        kind, error = struct.unpack_from("=H", reply, 4)[0], struct.unpack_from("=i", reply, 16)[0]
        if kind == NLMSG_ERROR and error != 0:
            raise LinkemError(f"queue {self.number}: configuration {seq} refused (errno {-error})")

    def packets(self, timeout: float) -> list[int]:
        """The ids of the packets queued since the last call, waiting up to ``timeout`` for one."""
        self.sock.settimeout(max(timeout, 0.0001))
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return []
        ids, offset = [], 0
        while offset + 16 <= len(data):
            size, kind = struct.unpack_from("=IH", data, offset)
            if size < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | MSG_PACKET:
                ids.extend(_packet_ids(data, offset + 20, offset + size))
            offset += (size + 3) & ~3
        return ids

    def verdict(self, packet_id: int, verdict: int) -> None:
        header = _attribute(VERDICT_HDR, struct.pack("!II", verdict, packet_id))
        self.sock.send(_message(MSG_VERDICT, NLM_F_REQUEST, self._header + header))

    def close(self) -> None:
        self.sock.close()


def _packet_ids(data: bytes, start: int, end: int) -> list[int]:
    ids, at = [], start
    while at + 4 <= end:
        size, kind = struct.unpack_from("=HH", data, at)
        if size < 4:
            break
        if kind & 0x7FFF == PACKET_HDR:
            ids.append(struct.unpack_from("!I", data, at + 4)[0])
        at += (size + 3) & ~3
    return ids


_stopping: list[bool] = []  # SIGTERM appends; the loop looks between two reads of at most TICK


def _stop(signum: int, frame: FrameType | None) -> None:
    _stopping.append(True)


def serve(queue: Queue, impairment: Impairment, *, seconds: float, seed: int) -> Counter[str]:
    """Hold, let go and drop the queue's packets for ``seconds`` (or until SIGTERM), then let every
    held packet go."""
    rng = random.Random(seed)
    held: list[tuple[float, int]] = []
    counts: Counter[str] = Counter()
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end and not _stopping:
        wait = min(TICK, end - now, held[0][0] - now if held else TICK)
        for packet_id in queue.packets(wait):
            counts["packets"] += 1
            hold = impairment.decide(rng)
            if hold is None:
                counts["dropped"] += 1
                queue.verdict(packet_id, NF_DROP)
            elif hold == 0.0:
                counts["at_once"] += 1
                queue.verdict(packet_id, NF_ACCEPT)
            else:
                heapq.heappush(held, (time.monotonic() + hold, packet_id))
        while held and held[0][0] <= time.monotonic():
            queue.verdict(heapq.heappop(held)[1], NF_ACCEPT)
            counts["held"] += 1
    for _, packet_id in held:
        queue.verdict(packet_id, NF_ACCEPT)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testing.linkem")
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--jitter", type=float, default=0.0)
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--reorder", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    impairment = Impairment(args.delay, args.jitter, args.loss, args.reorder)
    signal.signal(signal.SIGTERM, _stop)
    try:
        queue = Queue(args.queue)
    except (OSError, LinkemError) as exc:
        print(f"linkem: {exc}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    try:
        counts = serve(queue, impairment, seconds=min(max(args.seconds, 0.0), 3600.0), seed=args.seed)
    finally:
        queue.close()
    print(json.dumps(dict(counts)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
