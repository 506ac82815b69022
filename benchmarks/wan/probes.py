"""The endpoints of ``benchmarks/wan_link.py``, run inside the node namespaces.

    python benchmarks/wan/probes.py ping --host H [--pings 20] --out R.json
    python benchmarks/wan/probes.py recv [--rcvbuf BYTES] --out R.json
    python benchmarks/wan/probes.py send --host H --seconds S --out R.json

* ``ping``: ICMP echo requests on a raw socket (root), one at a time, 20 ms apart; the round
  trips in ms (no ``ping`` binary needed);
* ``recv``: accepts one TCP connection on :data:`PORT` (its receive buffer pinned with
  ``SO_RCVBUFFORCE``, which ``net.core.rmem_max`` does not cap, unless ``--rcvbuf 0``) and reads
  it to EOF, recording the bytes received and its TCP_INFO every :data:`SAMPLE_S`;
* ``send``: connects (retrying until the receiver listens), sends for ``--seconds``, recording
  its TCP_INFO (among it ``tcpi_snd_wnd``, the window the receiver advertised), then closes and
  waits for the receiver's close.

Each writes its result as JSON to ``--out``. Standard library only, so it starts fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PORT = 5301
#: how often the TCP endpoints record their bytes and TCP_INFO
SAMPLE_S = 0.1
#: the sender keeps at most this much unsent data in its socket (8 ms at 1 Gbit/s: enough for a
#: sender that waits for a CPU), so that it stops soon after its time
NOTSENT_LOWAT = 1 << 20
TCP_NOTSENT_LOWAT = 25  # linux/tcp.h (absent from Python's socket module)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
#: TCP_INFO fields read: name -> (struct format, offset in the kernel's struct tcp_info); a field
#: past the end of what the kernel returns is left out (``tcpi_rcv_wnd``: Linux 6.2 and later)
TCP_INFO = {"snd_mss": ("I", 16), "unacked": ("I", 24), "rcv_ssthresh": ("I", 64),
            "rtt_us": ("I", 68), "snd_cwnd": ("I", 80), "rcv_space": ("I", 96),
            "total_retrans": ("I", 100), "min_rtt_us": ("I", 148), "busy_us": ("Q", 168),
            "rwnd_limited_us": ("Q", 176), "snd_wnd": ("I", 228), "rcv_wnd": ("I", 232)}


def tcp_info(sock: socket.socket) -> dict[str, int]:
    """The :data:`TCP_INFO` fields the kernel filled in for ``sock``."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return {name: struct.unpack_from(fmt, raw, off)[0] for name, (fmt, off) in TCP_INFO.items()
            if off + struct.calcsize(fmt) <= len(raw)}


def sampler(sock: socket.socket, out: list[dict[str, Any]], done: threading.Event,
            extra: Callable[[], dict[str, Any]] = dict) -> threading.Thread:
    """A thread recording TCP_INFO (and ``extra()``) every :data:`SAMPLE_S` until ``done``."""
    def loop() -> None:
        while not done.wait(SAMPLE_S):
            with contextlib.suppress(OSError):
                out.append({"t": time.perf_counter(), **extra(), **tcp_info(sock)})

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    return th


def icmp_checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    data += b"\0" * (len(data) % 2)
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


def ping(a: argparse.Namespace) -> dict[str, Any]:
    """``--pings`` ICMP echo requests to ``--host``, one at a time: the round trips in ms."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    sock.settimeout(2.0)
    ident, payload, rtts, lost = os.getpid() & 0xFFFF, bytes(56), [], 0
    for seq in range(a.pings):
        head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
        packet = struct.pack("!BBHHH", 8, 0, icmp_checksum(head + payload), ident, seq) + payload
        sent = time.perf_counter()
        sock.sendto(packet, (a.host, 0))
        try:
            while True:
                data = sock.recv(2048)
                ihl = (data[0] & 0x0F) * 4
                kind, _code, _sum, rid, rseq = struct.unpack_from("!BBHHH", data, ihl)
                if kind == 0 and (rid, rseq) == (ident, seq):
                    rtts.append((time.perf_counter() - sent) * 1e3)
                    break
        except TimeoutError:
            lost += 1
        time.sleep(0.02)
    return {"rtt_ms": rtts, "lost": lost}


def recv(a: argparse.Namespace) -> dict[str, Any]:
    """Accept one connection (receive buffer pinned to ``--rcvbuf`` unless 0) and read it to
    EOF, recording the bytes so far and TCP_INFO every :data:`SAMPLE_S`."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if a.rcvbuf:  # before listen: the window scale is chosen at the handshake
        srv.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, a.rcvbuf)
    srv.bind(("0.0.0.0", PORT))
    srv.listen(1)
    conn, _addr = srv.accept()
    rcvbuf = conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    got = [0]
    samples: list[dict[str, Any]] = []
    done = threading.Event()
    th = sampler(conn, samples, done, lambda: {"bytes": got[0]})
    buf = bytearray(4 << 20)
    first = 0.0
    while n := conn.recv_into(buf):
        if not got[0]:
            first = time.perf_counter()
        got[0] += n
    last = time.perf_counter()
    done.set()
    th.join()
    samples.append({"t": last, "bytes": got[0]})
    conn.close()
    srv.close()
    return {"rcvbuf": rcvbuf, "bytes": got[0], "first": first, "last": last, "samples": samples}


def send(a: argparse.Namespace) -> dict[str, Any]:
    """Connect to ``--host`` (retrying until it listens) and send for ``--seconds``, recording
    TCP_INFO every :data:`SAMPLE_S`; then close and wait for the receiver's close."""
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection((a.host, PORT), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
    samples: list[dict[str, Any]] = []
    done = threading.Event()
    th = sampler(sock, samples, done)
    chunk = memoryview(bytes(256 << 10))
    start = time.perf_counter()
    while time.perf_counter() - start < a.seconds:
        sock.sendall(chunk)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # the receiver's close: everything was delivered
    done.set()
    th.join()
    sock.close()
    return {"start": start, "samples": samples}


PROBES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "ping": ping, "recv": recv, "send": send}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run one probe and write its JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("probe", choices=sorted(PROBES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--host", default="")
    p.add_argument("--pings", type=int, default=20)
    p.add_argument("--rcvbuf", type=int, default=0, help="SO_RCVBUF in bytes (0: autotuning)")
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args(argv)
    a.out.write_text(json.dumps(PROBES[a.probe](a)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
