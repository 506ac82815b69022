"""A WAN link between network namespaces: every packet delayed in user space, both ways.

:class:`WanNetwork` is :class:`benchmarks.netns_dsgd.Network` (same constructor and members, so
``netns_dsgd.Runner`` starts processes in its namespaces unchanged) with a true round-trip time:
TCP between two nodes sees the real bandwidth-delay product, since every packet, data and ACK
alike, is held back on its way. There is no proxy: the nodes' own TCP stacks talk to each other,
with their own windows, congestion control and retransmissions.

How (the kernel here has no netem; veth, tun, policy routing and ``tc tbf`` are enough)::

    node i (ns <prefix>-i)             switch (ns <prefix>-sw)
    veth0 10.78.i.2/24 ---- tbf up --> p<i> 10.78.i.1/24 --(ip rule iif p<i>: table 100)--+
                                                                                           |
       delayline: read from tun wanin, hold RTT/2, write to tun wanout <-- default dev wanin
                                                                                           |
    veth0 10.78.j.2/24 <-- tbf down -- p<j> <------------- main table: 10.78.j.0/24 ------+

* Each node sits on a veth pair of its own (its own /24, the switch end as gateway). A packet
  from node i arrives on ``p<i>`` in the switch namespace, where a policy rule (``ip rule add iif
  p<i> lookup 100``) routes it into the tun device ``wanin``. Anything the switch namespace
  answers itself (ARP, its own addresses) never reaches the line.
* ``delayline`` (``delayline.c``, built here on demand with ``cc -O2``) reads each packet from
  ``wanin`` and writes it, RTT/2 later, into the tun device ``wanout``; the kernel then receives
  it as if it came in on ``wanout`` and the main table forwards it to the destination's ``p<j>``.
  One constant delay for every packet makes the line a single FIFO: order is kept exactly. Every
  packet crosses the line once per direction, so a round trip is RTT/2 + RTT/2 = RTT.
* Rate: ``tc tbf`` on each node's veth (its upload) and on the switch's ``p<i>`` (its download),
  burst and queue limit exactly as :class:`~benchmarks.netns_dsgd.Network` sets them, and each
  veth end's flows received on one CPU each (the same RPS steering). The upload queue sits
  before the delay, the download queue after it, as on a real path.
* Packet rate: the tun devices carry a virtio_net_hdr and accept TSO, so a TCP sender's 64 KiB
  GSO packets cross the line (and are queued) whole: at 1 Gbit/s about 2,000 packets per second
  each way, not 83,000 of 1500 bytes, which 2 cores could not forward in user space next to the
  endpoints. The MTU stays 1500 (``mtu=`` changes it everywhere), so the segments TCP puts on
  the wire, its MSS and the tbf's per-segment accounting are those of a real Ethernet path.
* Socket buffers: ``net.ipv4.tcp_rmem`` and ``tcp_wmem`` are per network namespace; in the
  node namespaces both maxima are raised to :data:`SOCKET_BUFFER_MAX` (64 MiB), so one flow can
  keep 1 Gbit/s x 100 ms = 12.5 MB in flight plus the tbf queue. ``net.core.rmem_max`` is not
  per namespace (and is not touched): a window pinned above it needs ``SO_RCVBUFFORCE`` (root).
  ``tcp_no_metrics_save`` keeps one flow's ssthresh from steering the next one.
* The root namespace is never touched; everything this creates (namespaces, the ``delayline``
  process, whose tun devices die with it) is registered with the ``Cleanup`` object, and the
  line also exits when the Python process that started it dies (``PR_SET_PDEATHSIG``).

* Timing: the line runs ``SCHED_FIFO`` (priority :data:`LINE_RT_PRIORITY`), so a busy host
  cannot hold a due packet back by a scheduler slice; it sleeps between packets (``ppoll`` with a
  nanosecond timeout, 1 us timer slack) and reports how late its packets left.

The line shares the CPUs with the endpoints, and its CPU time (the kernel's forwarding work of
each write included) is taken from theirs: ``benchmarks/wan_link.py`` measures it, with the
RTTs and the throughput one TCP flow gets. Numbers taken on this emulation are to be compared
as ratios between systems under the same emulation, not as absolute WAN figures.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.netns_dsgd import (
    NODE_IF,
    BenchError,
    Cleanup,
    Network,
    Skip,
    proc_cpu_seconds,
    sh,
)

REPO = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "delayline.c"
BINARY = REPO / "build" / "wan" / "delayline"
#: the first two octets of every address (node i: SUBNET.i.2, its gateway SUBNET.i.1)
SUBNET = "10.78"
#: the routing table that sends packets from the nodes' veths into the line
TABLE = "100"
TUN_IN = "wanin"
TUN_OUT = "wanout"
#: maxima of tcp_rmem and tcp_wmem in the node namespaces
SOCKET_BUFFER_MAX = 64 << 20
#: bytes the line may hold in flight (default): 1 Gbit/s for 0.5 s
LINE_MAX_BYTES = 64 << 20
#: the line's SCHED_FIFO priority (0: an ordinary process)
LINE_RT_PRIORITY = 10
#: seconds to wait for the line to create its tun devices
READY_TIMEOUT_S = 10.0


def cannot_emulate() -> str | None:
    """Why this machine cannot build a :class:`WanNetwork` (None: it can)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None \
            or shutil.which("cc") is None or not os.path.exists("/dev/net/tun"):
        return ("needs root, iproute2, cc and /dev/net/tun: it creates network namespaces (ip "
                "netns add) and tun devices, and builds the delay line")
    return None


def build_delayline(source: Path = SOURCE, binary: Path = BINARY) -> Path:
    """The ``delayline`` program, compiled with ``cc -O2`` when missing or older than its source.

    Raises :class:`~benchmarks.netns_dsgd.Skip` when there is no C compiler and
    :class:`~benchmarks.netns_dsgd.BenchError` when the compilation fails.
    """
    if binary.exists() and binary.stat().st_mtime >= source.stat().st_mtime:
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")  # runs may build at once
    try:
        proc = subprocess.run(["cc", "-O2", "-Wall", "-o", str(tmp), str(source)],
                              capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise Skip("skipped: no C compiler (`cc`) to build the delay line") from None
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BenchError(f"cc failed to build {source}:\n{proc.stderr.strip()}")
    tmp.replace(binary)  # atomic: a running line keeps its file, a new one gets a whole file
    return binary


def sysctl(ns: str, *settings: str) -> None:
    """Set ``key=value`` sysctls inside namespace ``ns`` (never in the root namespace)."""
    sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings)


class WanNetwork(Network):
    """:class:`~benchmarks.netns_dsgd.Network` with a true RTT: a routing switch namespace whose
    ``delayline`` holds every packet, both ways, for ``rtt_ms / 2`` (see the module docstring).

    ``mtu`` applies to every veth and tun; ``offload=False`` makes the line forward packets of at
    most the MTU (GSO packets are segmented by the kernel before it reads them);
    ``line_max_bytes`` bounds what the line holds in flight (beyond it, packets are dropped);
    ``rt_priority`` is the line's SCHED_FIFO priority (0: none).
    """

    def __init__(self, prefix: str, nodes: int, rate: str, cleanup: Cleanup,
                 rtt_ms: float = 50.0, mtu: int = 1500, offload: bool = True,
                 line_max_bytes: int = LINE_MAX_BYTES,
                 rt_priority: int = LINE_RT_PRIORITY) -> None:
        super().__init__(prefix, nodes, rate, cleanup)
        if not 1 <= nodes <= 250:
            raise ValueError("a WanNetwork has 1 to 250 nodes (one /24 each)")
        if rtt_ms < 0:
            raise ValueError("rtt_ms must be >= 0")
        self.rtt_ms = rtt_ms
        #: the line's one-way delay in microseconds (each direction crosses it once)
        self.delay_us = round(rtt_ms * 1000 / 2)
        self.mtu = mtu
        self.offload = offload
        self.line_max_bytes = line_max_bytes
        self.rt_priority = rt_priority
        #: the running ``delayline`` (after :meth:`up`)
        self.line: subprocess.Popen[bytes] | None = None
        #: its counters, once :meth:`stop_line` has stopped it
        self.counters: dict[str, Any] = {}

    def ip(self, i: int) -> str:
        """The address of node ``i``."""
        return f"{SUBNET}.{i}.2"

    def gateway(self, i: int) -> str:
        """The switch's address on node ``i``'s link."""
        return f"{SUBNET}.{i}.1"

    def up(self) -> None:
        """Create the namespaces, start the line, then the veths, routes and tbf qdiscs."""
        binary = build_delayline()
        self._add_ns(self.switch)
        sysctl(self.switch, "net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
               "net.ipv4.conf.default.rp_filter=0", "net.ipv4.conf.all.send_redirects=0",
               "net.ipv4.conf.default.send_redirects=0", "net.ipv6.conf.all.disable_ipv6=1",
               "net.ipv6.conf.default.disable_ipv6=1")
        self._start_line(binary)
        for dev in (TUN_IN, TUN_OUT):
            # a long tx queue on wanin: the line reads it in bursts, and it must not drop
            sh("ip", "-n", self.switch, "link", "set", dev, "mtu", str(self.mtu),
               "txqueuelen", "10000", "up")
        sh("ip", "-n", self.switch, "route", "add", "default", "dev", TUN_IN, "table", TABLE)
        for i, ns in enumerate(self.ns):
            self._add_ns(ns)
            sysctl(ns, f"net.ipv4.tcp_rmem=4096 131072 {SOCKET_BUFFER_MAX}",
                   f"net.ipv4.tcp_wmem=4096 16384 {SOCKET_BUFFER_MAX}",
                   "net.ipv4.tcp_no_metrics_save=1", "net.ipv6.conf.all.disable_ipv6=1",
                   "net.ipv6.conf.default.disable_ipv6=1")
            port = f"p{i}"
            sh("ip", "link", "add", NODE_IF, "netns", ns, "mtu", str(self.mtu), "type", "veth",
               "peer", "name", port, "netns", self.switch, "mtu", str(self.mtu))
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", NODE_IF)
            sh("ip", "-n", ns, "link", "set", NODE_IF, "up")
            sh("ip", "-n", ns, "route", "add", "default", "via", self.gateway(i))
            sh("ip", "-n", self.switch, "addr", "add", f"{self.gateway(i)}/24", "dev", port)
            sh("ip", "-n", self.switch, "link", "set", port, "up")
            sh("ip", "-n", self.switch, "rule", "add", "iif", port, "lookup", TABLE)
            self._tbf(ns, NODE_IF)  # upload
            self._tbf(self.switch, port)  # download
            self.steered &= self._steer(ns, NODE_IF) & self._steer(self.switch, port)

    def _start_line(self, binary: Path) -> None:
        argv = [str(binary), "--in", TUN_IN, "--out", TUN_OUT, "--delay-us", str(self.delay_us),
                "--max-bytes", str(self.line_max_bytes), "--rt-priority", str(self.rt_priority),
                *([] if self.offload else ["--no-offload"])]
        # `ip netns exec` execs the program: the pid is the line's own (its CPU is read there)
        proc = subprocess.Popen(["ip", "netns", "exec", self.switch, *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.line = self.cleanup.add_proc(proc)
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
        first = proc.stdout.readline() if readable else b""
        if first.strip() != b"ready":
            self.cleanup.stop_procs([proc], grace=1.0)
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise Skip(f"skipped: the delay line did not start (tun devices in a network "
                       f"namespace, /dev/net/tun): {err or first.decode(errors='replace')}")

    def line_cpu_seconds(self) -> float:
        """User + system CPU seconds the running line has used so far (its kernel work for the
        packets it writes included: the forwarding that each write runs)."""
        if self.line is None or self.line.poll() is not None:
            raise BenchError("the delay line is not running")
        return proc_cpu_seconds(self.line.pid)

    def stop_line(self, timeout: float = 5.0) -> dict[str, Any]:
        """Stop the line (SIGTERM) and return the counters it prints as it exits."""
        if self.line is None:
            return self.counters
        if self.line.poll() is None:
            self.line.terminate()
        try:
            out, err = self.line.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.line.kill()
            out, err = self.line.communicate()
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            self.counters = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise BenchError(f"the delay line exited {self.line.returncode} without counters: "
                             f"{err.decode(errors='replace').strip()}") from None
        return self.counters
