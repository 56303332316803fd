"""Latency on a link where the kernel has no netem: packets queued to userspace (an NFQUEUE rule,
deploy/cluster.py's degrade) are let go delay_ms after they arrived, in arrival order.

    python deploy/delayer.py --queue 36 --delay-ms 200     (run inside the host's network namespace)

It speaks nfnetlink_queue over a raw netlink socket (no library): it binds the queue, prints "bound"
once reading, and gives one batch ACCEPT verdict for every packet that is due. On SIGTERM it accepts
what it holds and prints one JSON line of what it did. Only packet metadata is copied to userspace;
the payload stays in the kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import struct
import time
from collections import deque
from pathlib import Path

NETLINK_NETFILTER, SO_RCVBUFFORCE = 12, 33
SUBSYS_QUEUE = 3
MSG_PACKET, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 1, 4, 2
NF_ACCEPT, COPY_META, FLAG_GSO = 1, 1, 4
CFG_CMD, CFG_PARAMS, CFG_MAXLEN, CFG_MASK, CFG_FLAGS, CMD_BIND = 1, 2, 3, 4, 5, 1
ATTR_PACKET_HDR, ATTR_VERDICT_HDR = 1, 2


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


class Delayer:
    def __init__(self, queue: int, delay_ms: float) -> None:
        self.queue, self.delay = queue, delay_ms / 1000
        self.pending: deque[tuple[float, float, int]] = deque()  # (due, arrived, packet id), in arrival order
        self.held: list[float] = []  # how long each released packet was held, s
        self.stopping = False
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)

    def message(self, kind: int, attrs: list[bytes], flags: int = NLM_F_REQUEST) -> bytes:
        body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(self.queue)) + b"".join(attrs)
        return struct.pack("=IHHII", 16 + len(body), (SUBSYS_QUEUE << 8) | kind, flags, 0, 0) + body

    def bind(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        self.sock.bind((0, 0))
        for attrs in (
            [_attr(CFG_CMD, struct.pack("=BBH", CMD_BIND, 0, 0))],
            [_attr(CFG_PARAMS, struct.pack(">IB", 0, COPY_META))],
            [_attr(CFG_MAXLEN, struct.pack(">I", 65536))],
            [_attr(CFG_FLAGS, struct.pack(">I", FLAG_GSO)), _attr(CFG_MASK, struct.pack(">I", FLAG_GSO))],
        ):
            self.sock.send(self.message(MSG_CONFIG, attrs, NLM_F_REQUEST | NLM_F_ACK))
            self._check_ack(self.sock.recv(65536))

    def _check_ack(self, reply: bytes) -> None:
        if struct.unpack_from("=H", reply, 4)[0] == NLMSG_ERROR and (error := -struct.unpack_from("=i", reply, 16)[0]):
            raise OSError(error, f"NFQUEUE {self.queue}: {os.strerror(error)}")

    def drain(self) -> None:
        """Every packet message waiting on the socket, queued with its due time."""
        while True:
            try:
                data = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            now = time.monotonic()
            self.pending.extend((now + self.delay, now, packet_id) for packet_id in _packet_ids(data))

    def release(self, everything: bool) -> None:
        now, last = time.monotonic(), None
        while self.pending and (everything or self.pending[0][0] <= now):
            _, arrived, last = self.pending.popleft()
            self.held.append(now - arrived)
        if last is not None:  # one verdict for every packet up to `last` (ids grow in arrival order)
            verdict = _attr(ATTR_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last))
            self.sock.send(self.message(MSG_VERDICT_BATCH, [verdict]))

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        while not self.stopping:
            timeout = max(0.0, self.pending[0][0] - time.monotonic()) if self.pending else 1.0
            if select.select([self.sock], [], [], timeout)[0]:
                self.drain()
            self.release(everything=False)
        self.drain()  # heal() removed the queue rule first: nothing more comes
        self.release(everything=True)

    def stop(self, *_: object) -> None:
        self.stopping = True

    def stats(self) -> dict:
        held = sorted(self.held)
        queue_dropped, user_dropped = _kernel_drops(self.queue)
        return {
            "packets": len(held),
            "held_ms_min": 1000 * held[0] if held else 0.0,
            "held_ms_median": 1000 * held[len(held) // 2] if held else 0.0,
            "held_ms_max": 1000 * held[-1] if held else 0.0,
            "queue_dropped": queue_dropped,
            "user_dropped": user_dropped,
        }


def _packet_ids(data: bytes) -> list[int]:
    """The packet id of each queued-packet message in one netlink read."""
    ids, offset = [], 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if kind == (SUBSYS_QUEUE << 8) | MSG_PACKET:
            at = offset + 20  # past nlmsghdr and nfgenmsg
            while at + 4 <= offset + length:
                attr_length, attr_kind = struct.unpack_from("=HH", data, at)
                if attr_kind & 0x7FFF == ATTR_PACKET_HDR:
                    ids.append(struct.unpack_from(">I", data, at + 4)[0])
                    break
                at += (attr_length + 3) & ~3
        offset += (max(length, 16) + 3) & ~3
    return ids


def _kernel_drops(queue: int) -> tuple[int, int]:
    """(dropped for a full queue, dropped for a full socket) from the kernel's queue table."""
    for line in Path("/proc/net/netfilter/nfnetlink_queue").read_text().splitlines():
        fields = line.split()
        if fields and int(fields[0]) == queue:
            return int(fields[5]), int(fields[6])
    return 0, 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    delayer = Delayer(args.queue, args.delay_ms)
    delayer.bind()
    print("bound", flush=True)
    delayer.run()
    print(json.dumps(delayer.stats()), flush=True)


if __name__ == "__main__":
    main()
