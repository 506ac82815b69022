"""Prometheus metrics of one daemon, served over HTTP at ``/metrics`` when ``metrics.port`` is set.

Ops are counted as they end (by type and outcome, with a latency histogram) and requests as they
arrive (tensors and bytes per request: the fusion buckets the workers send); everything else is
read at scrape time from the same snapshot ``decentctl status`` shows, taken on the event loop so
that it is consistent: per-peer bytes and frames in each direction, frames queued, heartbeat age,
ops in flight, arena, pool, registered and early bytes, and each window's staleness.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from decent_wire.errors import DecentError
from decent_wire.v1 import decent_pb2 as pb
from decentd.ops.api import OpContext
from decentd.workers.sessions import WorkerSession

log = logging.getLogger("decentd.service.metrics")

#: seconds an op may take, as histogram buckets (a 4 KiB op takes ~1 ms, 64 MiB ~50 ms)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0)
#: tensors in one request (fusion buckets)
TENSOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
#: bytes in one request
BYTE_BUCKETS = tuple(float(4 ** k) for k in range(5, 16))  # 1 KiB .. 1 GiB
#: how long a scrape waits for the event loop's snapshot
SNAPSHOT_TIMEOUT = 5.0

Snapshot = Callable[[], Coroutine[Any, Any, pb.StatusReply]]


class OpMetrics:
    """The counters ops update as they go (an ``OpObserver`` of the engine)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ops = Counter("decent_ops", "Ops ended, by type and outcome (OK or the error code)",
                           ["op", "outcome"], registry=registry)
        self.latency = Histogram("decent_op_seconds", "Time from an op's start to its end",
                                 ["op"], buckets=LATENCY_BUCKETS, registry=registry)
        self.tensors = Histogram("decent_request_tensors", "Tensors per worker request (the "
                                 "fusion buckets workers send)", buckets=TENSOR_BUCKETS,
                                 registry=registry)
        self.bytes = Histogram("decent_request_bytes", "Input bytes per worker request",
                               buckets=BYTE_BUCKETS, registry=registry)

    def submitted(self, session: WorkerSession, req: pb.SubmitRequest) -> None:
        """Count a request's fusion bucket."""
        if req.tensors:
            self.tensors.observe(len(req.tensors))
            self.bytes.observe(sum(t.nbytes for t in req.tensors))

    def ended(self, ctx: OpContext, error: DecentError | None, seconds: float) -> None:
        """Count an op and its latency."""
        op = pb.OpType.Name(ctx.op) if ctx.op in pb.OpType.values() else str(ctx.op)
        self.ops.labels(op, "OK" if error is None else pb.ErrorCode.Name(error.code)).inc()
        self.latency.labels(op).observe(seconds)


class StatusCollector(Collector):
    """Gauges and per-peer counters read from a status snapshot at every scrape."""

    def __init__(self, snapshot: Snapshot, loop: asyncio.AbstractEventLoop) -> None:
        self._snapshot = snapshot
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        """The metrics of one snapshot (none when the loop does not answer in time)."""
        try:
            status: pb.StatusReply = asyncio.run_coroutine_threadsafe(
                self._snapshot(), self._loop).result(SNAPSHOT_TIMEOUT)
        except Exception as exc:  # a scrape must not raise into the HTTP thread
            log.warning("metrics: no snapshot (%r)", exc)
            return
        yield from _daemon_gauges(status)
        yield from _peer_metrics(status)
        staleness = GaugeMetricFamily("decent_window_staleness", "Most steps a read of the "
                                      "window lagged its own copy", labels=["window"])
        for name, steps in sorted(status.window_staleness.items()):
            staleness.add_metric([name], steps)
        yield staleness


def _daemon_gauges(status: pb.StatusReply) -> Iterator[Metric]:
    gauges = {
        "decent_ops_in_flight": ("Ops running now", status.ops_in_flight),
        "decent_workers": ("Local workers registered", status.workers),
        "decent_arena_bytes": ("The local workers' arenas", status.arena_bytes),
        "decent_pool_bytes": ("Receive buffers held (in use and idle)", status.pool_bytes),
        "decent_pool_peak_bytes": ("Most receive-buffer bytes in use at once",
                                   status.pool_peak_bytes),
        "decent_registered_bytes": ("Worker memory registered", status.registered_bytes),
        "decent_arena_spills": ("Requests that found their arena full and went to memory of "
                                "their own (since their workers came)", status.arena_spills),
        "decent_arena_spill_bytes": ("Memory of such requests mapped now",
                                     status.arena_spill_bytes),
        "decent_inputs_streamed": ("Inputs sent while their workers copied them in",
                                   status.inputs_streamed),
        "decent_inputs_streamed_early_bytes": ("Bytes of them sent before their copy ended",
                                               status.inputs_streamed_early_bytes),
        "decent_inputs_left_out": ("Requests whose input was not copied in (never read)",
                                   status.inputs_left_out),
        "decent_early_arrival_bytes": ("Peers' data kept for ops not started here",
                                       status.early_arrival_bytes),
        "decent_resident_bytes": ("The daemon's resident memory", status.rss_bytes),
    }
    for name, (text, value) in gauges.items():
        yield GaugeMetricFamily(name, text, value=value)


def _peer_metrics(status: pb.StatusReply) -> Iterator[Metric]:
    sent = CounterMetricFamily("decent_peer_bytes", "Bulk bytes per peer and direction",
                               labels=["peer", "direction"])
    frames = CounterMetricFamily("decent_peer_messages", "Bulk frames per peer and direction",
                                 labels=["peer", "direction"])
    queued = GaugeMetricFamily("decent_peer_queue_depth", "Frames waiting to be written to the "
                               "peer", labels=["peer"])
    age = GaugeMetricFamily("decent_peer_heartbeat_age_seconds", "Since the peer was last "
                            "heard from (-1: never)", labels=["peer"])
    up = GaugeMetricFamily("decent_peer_connected", "Our connection to the peer is up",
                           labels=["peer"])
    conns = GaugeMetricFamily("decent_peer_connections", "TCP connections our link to the peer "
                              "sends over (transport.stripes)", labels=["peer"])
    rtt = GaugeMetricFamily("decent_peer_connect_rtt_seconds", "The round trip our bulk "
                            "connection measured when it opened", labels=["peer"])
    for p in status.peers:
        peer = str(p.rank)
        sent.add_metric([peer, "sent"], p.bytes_sent)
        sent.add_metric([peer, "received"], p.bytes_received)
        frames.add_metric([peer, "sent"], p.frames_sent)
        frames.add_metric([peer, "received"], p.frames_received)
        queued.add_metric([peer], p.frames_queued)
        age.add_metric([peer], p.last_heartbeat_age_s)
        up.add_metric([peer], 1.0 if p.connected else 0.0)
        conns.add_metric([peer], p.stripes)
        rtt.add_metric([peer], p.connect_rtt_ms / 1e3)
    yield from (sent, frames, queued, age, up, conns, rtt)


class MetricsServer:
    """``/metrics`` over HTTP, in a thread of its own."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        """Listen now (OSError when the port is taken)."""
        server, thread = start_http_server(port, host, registry=registry)
        self._server: WSGIServer = server
        self._thread: threading.Thread = thread
        self.port = int(server.server_address[1])

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
