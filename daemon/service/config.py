"""Node configuration (``node.yaml``), validated with pydantic.

Every value has a default, so a local run needs no file. Command-line flags override the file;
``--set a.b=value`` overrides any key. Errors name the key and the bad value.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decent_wire import topology
from decent_wire.local import default_socket
from decentd.errors import ConfigError
from decentd.net.stripes import Striping


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TopologyConfig(_Strict):
    """Which graph the daemon averages over, and its weights."""

    kind: str = Field("ring", description="the graph's kind, static or dynamic (``decentctl "
                      "topology KIND -n N`` prints its mixing matrix)")
    scheme: Literal["uniform", "metropolis"] = Field(
        "uniform", description="``uniform`` (1/(in_degree+1)) or ``metropolis`` "
        "(Metropolis-Hastings, undirected graphs)")
    options: dict[str, int | str] = Field(
        default_factory=dict, description="the kind's options: ``rows`` (torus), ``seed`` "
        "(random-matching), ``group_size`` and ``mean`` (wagma)")
    edges: list[list[float]] | None = Field(
        None, description="kind ``custom``: ``[[src, dst], ...]`` or ``[[src, dst, weight], "
        "...]`` (the weight dst gives src)")
    self_weights: dict[int, float] | None = Field(
        None, description="kind ``custom``: ``{rank: w}``, each rank's weight of its own tensor")
    weights: dict[int, dict[int, float]] | None = Field(
        None, description="optional explicit weights: ``{receiver: {sender: w}}``; a "
        "receiver's self weight is ``weights[i][i]``. Edges listed here replace the kind's edges "
        "for that receiver")

    def build(self, size: int) -> topology.Topology:
        """The topology over ``size`` ranks (TopologyError says what is wrong)."""
        options: dict[str, Any] = dict(self.options)
        if self.edges is not None:
            options["edges"] = self.edges
        if self.self_weights is not None:
            options["self_weights"] = self.self_weights
        return topology.from_spec({"kind": self.kind, "scheme": self.scheme, "options": options,
                                   "weights": self.weights}, size)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in topology.kinds():
            raise ValueError(f"unknown topology {kind!r}; known: {', '.join(topology.kinds())}")
        return kind


#: the longest timeout a config may set (seconds): a finite one, so a lost peer fails an op
DAY = 86400.0


class TimeoutConfig(_Strict):
    """Timeouts, in seconds."""

    start: float = Field(60.0, gt=0, le=DAY, description="how long to wait for all peers at "
                         "start")
    op: float = Field(60.0, gt=0, le=DAY, description="default per-op timeout")
    stall_warning: float = Field(10.0, gt=0, le=DAY,
                                 description="log the ranks an op waits on after this")
    heartbeat: float = Field(2.0, ge=0.05, le=3600,
                             description="heartbeat interval between peers")
    auth: float = Field(10.0, ge=1, le=600, description="a peer's bulk connection that has not "
                        "said a valid HELLO after this is closed (at least 1 s: a handshake "
                        "over a slow link takes several round trips)")
    shutdown: float = Field(5.0, ge=0, le=3600,
                            description="grace period for in-flight ops at SIGTERM")


class MemoryConfig(_Strict):
    """Memory bounds."""

    arena_bytes: int = Field(256 << 20, ge=1 << 20, description="shared-memory arena per worker")
    max_arenas: int = Field(
        0, ge=0,
        description="workers of any jobs attached at once, each holding an arena of arena_bytes "
        "(0: four jobs' worth, 4 x workers_per_node); past this, a registering worker is "
        "refused with RESOURCE_EXHAUSTED naming the jobs that hold them",
    )
    early_arrival_bytes: int = Field(
        1 << 30, ge=0,
        description="receive window: bytes peers may send before the op that takes them runs "
        "here (split between peers, at least 1 MiB each); a larger message waits for that op",
    )
    pool_bytes: int = Field(
        512 << 20, ge=0,
        description="idle receive buffers kept for the next step's messages (same sizes recur "
        "every step); buffers past this are freed",
    )
    pool_floor_bytes: int = Field(
        16 << 20, ge=0,
        description="idle receive buffers kept after a burst: buffers idle for "
        "pool_idle_seconds are freed (their memory leaves the daemon) down to this",
    )
    pool_idle_seconds: float = Field(
        5.0, gt=0, le=86400,
        description="an idle receive buffer unused this long is freed while more than "
        "pool_floor_bytes are idle",
    )
    window_early_bytes: int = Field(
        256 << 20, ge=0,
        description="window writes kept for windows this rank has not created yet (ranks may "
        "create windows in any order); past this, such writes fail with RESOURCE_EXHAUSTED",
    )
    max_regions: int = Field(
        4096, ge=0,
        description="shared-memory tensors a worker may register (each mapping holds a file "
        "descriptor in the daemon); past this, its tensors are copied through the arena",
    )


class TransportConfig(_Strict):
    """Peer transport tuning."""

    data_port: int = Field(
        0, ge=0, le=65535,
        description="TCP port for bulk tensor data next to the gRPC port (0: any free port; "
        "peers learn it in the handshake)",
    )
    ring_threshold_bytes: int = Field(
        256 << 10, ge=0, description="allreduce uses the ring at or above this size"
    )
    stripes: int | Literal["auto"] = Field(
        "auto",
        description="TCP connections each link to a peer sends over; a large message's bytes "
        "are split across them (one flow moves at most its window per round trip). \"auto\": "
        "as many as the round trip of the link's first TCP handshake (as the kernel timed it) "
        "needs to keep stripe_rate_mbit in flight, given the kernel's socket buffer maxima "
        "(1 on a LAN)",
    )
    max_stripes: int = Field(8, ge=1, le=16, description="the most connections \"auto\" opens")
    stripe_rate_mbit: float = Field(
        1000.0, gt=0, description="the link rate \"auto\" sizes the connection count for")

    @field_validator("stripes")
    @classmethod
    def _stripes_in_range(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 16:
            raise ValueError(f"stripes must be \"auto\" or 1 to 16, not {value}")
        return value

    def striping(self) -> Striping:
        """How many connections each link opens (:mod:`decentd.net.stripes`)."""
        return Striping(None if self.stripes == "auto" else self.stripes, self.max_stripes,
                        self.stripe_rate_mbit * 1e6)


class SecurityConfig(_Strict):
    """Who may talk to this daemon (docs/security.md)."""

    mode: Literal["secret", "mtls", "insecure"] | None = Field(
        None, description="unset: loopback only (a listen address off loopback refuses to "
        "start); ``secret``: every peer proves it holds ``secret_file``'s secret; ``mtls``: "
        "certificates (``ca``, ``cert``, ``key``; ``decentctl certs``); ``insecure``: nothing "
        "proven (a warning at start)")
    secret_file: str | None = Field(
        None, description="mode ``secret``: a file holding the cluster secret (at least 16 "
        "bytes, mode 600), the same on every node")
    ca: str | None = Field(None, description="mode ``mtls``: the cluster's CA certificate")
    cert: str | None = Field(None, description="mode ``mtls``: this node's certificate")
    key: str | None = Field(None, description="mode ``mtls``: this node's private key "
                            "(mode 600)")
    encrypt_bulk: bool = Field(
        True, description="mode ``mtls``: TLS on the bulk data connections too (else they are "
        "bound to the TLS session by an HMAC, and travel in clear)")
    worker_group: str | None = Field(
        None, description="local workers: the group that may use the worker sockets and arenas "
        "(mode 0660; the group must exist); unset: only this daemon's user (0600)")
    allowed_uids: list[int] = Field(
        default_factory=list, description="local workers: uids allowed besides the daemon's own "
        "(checked with SO_PEERCRED)")

    @model_validator(mode="after")
    def _complete(self) -> SecurityConfig:
        if self.mode == "secret" and not self.secret_file:
            raise ValueError("mode secret needs secret_file (a file holding the cluster "
                             "secret, the same on every node, mode 600)")
        if self.mode == "mtls" and not (self.ca and self.cert and self.key):
            raise ValueError("mode mtls needs ca, cert and key (decentctl certs writes them)")
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, brackets allowed) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PeerPattern(_Strict):
    """Peers named by a pattern instead of a list: ``dns_pattern.format(i=rank)`` for every
    rank below ``size`` (a Kubernetes StatefulSet behind a headless Service)."""

    dns_pattern: str = Field(min_length=1, description="host:port with {i} for the rank, e.g. "
                             "'decent-{i}.decent.default.svc:7700'")
    size: int = Field(ge=1, le=65536, description="the number of ranks")

    @field_validator("dns_pattern")
    @classmethod
    def _check_pattern(cls, pattern: str) -> str:
        if "{i}" not in pattern:
            raise ValueError(f"dns_pattern {pattern!r} has no {{i}} for the rank")
        try:
            pattern.format(i=0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"dns_pattern {pattern!r}: {exc}") from None
        return pattern

    def addresses(self) -> list[str]:
        """The peer list the pattern stands for."""
        return [self.dns_pattern.format(i=i) for i in range(self.size)]


class MetricsConfig(_Strict):
    """Prometheus metrics over HTTP (``/metrics``); off unless ``port`` is set."""

    port: int | None = Field(None, ge=0, le=65535, description="serve /metrics on this port "
                             "(0: any free port); unset: no metrics")
    host: str = Field("127.0.0.1", description="0.0.0.0 to be scraped from other hosts")


class TimelineConfig(_Strict):
    """A Chrome trace of every op's phases (``$DECENT_TIMELINE`` also sets ``path``)."""

    path: str | None = Field(
        None, description="the trace file; ``{rank}`` in it is replaced by the daemon's rank, "
        "else ``.rank<N>`` goes before the suffix. Unset: no recording")


class FaultConfig(_Strict):
    """What a daemon does when peers die, drop or come back (docs/faults.md)."""

    peer_dead_after: float | None = Field(
        None, gt=0, le=3600, description="a peer silent on every connection this long "
        "(seconds) is dead; default: 3 heartbeats")
    on_peer_loss: Literal["reweight", "fail"] = Field(
        "reweight", description="``reweight``: a neighbor op completes without a dead "
        "in-neighbor, whose weight goes to self; ``fail``: the op fails with PEER_UNAVAILABLE "
        "naming the rank")
    min_nodes: int | None = Field(
        None, ge=1, description="start once this many daemons (this one included) are up; the "
        "rest may join later (default: all of them)")
    reconnect_max_delay: float = Field(
        1.0, gt=0, le=60, description="the longest wait between two attempts to reach a peer "
        "that is down (seconds)")


class NodeConfig(_Strict):
    """Everything one ``decentd`` needs to know."""

    cluster_id: str = Field("decent", min_length=1, description="peers with another id are "
                            "refused at handshake")
    rank: int | Literal["auto"] = Field(
        0, description="this node's rank, or ``auto``: $DECENT_RANK, $RANK, $SLURM_PROCID, else "
        "the trailing ordinal of the hostname (Kubernetes StatefulSet pods are ``name-0``, "
        "``name-1``, ...)")
    peers: list[str] = Field(
        default_factory=list, description="peer addresses ``host:port`` indexed by rank, this "
        "node included; empty: a one-node cluster. Or ``{dns_pattern, size}``, expanded into "
        "that list")
    listen: str | None = Field(
        None, description="where to listen for peers; default ``<host>:<port of peers[rank]>`` "
        "where host is 127.0.0.1 when peers[rank] is a loopback address, else 0.0.0.0")
    socket: str = Field(
        default_factory=default_socket, description="Unix socket for local workers; default "
        "``$XDG_RUNTIME_DIR/decentd.sock``, else ``/tmp/decentd-<uid>/decentd.sock``")
    workers_per_node: int = Field(
        1, ge=1, le=1024, description="workers each daemon serves (the same on every node): "
        "worker ranks are ``rank * workers_per_node + local_rank``, and ``topology`` is over "
        "all workers")
    topology: TopologyConfig = Field(default_factory=TopologyConfig)
    machine_topology: TopologyConfig | None = Field(
        None, description="the daemons' graph for hierarchical averaging (same keys as "
        "``topology``); default: ``topology``'s kind and scheme over the daemons")
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    timeline: TimelineConfig = Field(default_factory=TimelineConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the daemon's log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="``json``: one JSON object per line (time, level, rank, message; "
        "job, op and peer when known)")

    @field_validator("peers", mode="before")
    @classmethod
    def _expand_peers(cls, peers: Any) -> Any:
        if isinstance(peers, dict):
            return PeerPattern.model_validate(peers).addresses()
        return peers

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, peers: list[str]) -> list[str]:
        for address in peers:
            check_address(address, "peer address", any_port=False)
        if len(set(peers)) != len(peers):
            raise ValueError("peer addresses must be distinct")
        return peers

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, listen: str | None) -> str | None:
        if listen is not None:
            check_address(listen, "listen address", any_port=True)
        return listen

    @field_validator("socket")
    @classmethod
    def _check_socket(cls, path: str) -> str:
        check_socket_path(path)
        return path

    @model_validator(mode="after")
    def _check_rank(self) -> NodeConfig:
        if isinstance(self.rank, int) and self.peers and not 0 <= self.rank < len(self.peers):
            raise ValueError(f"rank {self.rank} is outside peers (there are {len(self.peers)})")
        if isinstance(self.rank, int) and self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")
        if (self.faults.min_nodes or 0) > self.size:
            raise ValueError(f"faults.min_nodes {self.faults.min_nodes} is more than the "
                             f"{self.size} daemon(s) in peers: the cluster could never start")
        return self

    @property
    def size(self) -> int:
        """Number of nodes (daemons) in the cluster."""
        return max(1, len(self.peers))

    @property
    def worker_count(self) -> int:
        """Number of workers in the cluster."""
        return self.size * self.workers_per_node

    def machine_topology_config(self) -> TopologyConfig:
        """The daemons' graph: ``machine_topology``, else ``topology``'s kind and scheme (a
        ``custom`` one, whose edges are between workers: ``exponential``)."""
        if self.machine_topology is not None:
            return self.machine_topology
        kind = "exponential" if self.topology.kind == "custom" else self.topology.kind
        return TopologyConfig(kind=kind, scheme=self.topology.scheme)

    def resolved_rank(self) -> int:
        """The numeric rank, deriving it from the environment when ``rank: auto``."""
        if isinstance(self.rank, int):
            return self.rank
        for var in ("DECENT_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
            if os.environ.get(var, "").isdigit():
                return int(os.environ[var])
        match = re.search(r"-(\d+)$", socket.gethostname())
        if match:
            return int(match.group(1))
        raise ConfigError(
            "config error: rank: 'auto' found none of $DECENT_RANK, $RANK, $SLURM_PROCID and the "
            f"hostname {socket.gethostname()!r} has no trailing -N ordinal"
        )

    def listen_address(self) -> str:
        """The TCP address the peer service binds."""
        if self.listen:
            return self.listen
        if self.peers:
            host, port = self.peers[self.resolved_rank()].rsplit(":", 1)
            return f"{'127.0.0.1' if is_loopback(host) else '0.0.0.0'}:{port}"
        return "127.0.0.1:0"

    def exposure_error(self) -> str | None:
        """Why this daemon must not start as configured: listening off loopback with no
        security mode (None when it may)."""
        host = self.listen_address().rsplit(":", 1)[0]
        if self.security.mode is not None or not self.peers or is_loopback(host):
            return None
        return (f"config error: rank {self.resolved_rank()} would listen on {host}, off "
                "loopback, with no security: set security.mode to secret (with "
                "security.secret_file: the same secret file on every node; decentrun makes "
                "one) or mtls (with security.ca/cert/key from `decentctl certs`), or to "
                "insecure on a network you trust (--security-mode, --secret-file)")


def check_address(address: str, what: str, any_port: bool) -> None:
    """ValueError unless ``address`` is host:port with a port in range (0 too: any free one,
    when ``any_port``)."""
    match = re.fullmatch(r"(\[?[\w.\-:]+\]?):(\d{1,5})", address)
    if not match:
        raise ValueError(f"{what} {address!r} is not host:port")
    port = int(match.group(2))
    if not (0 if any_port else 1) <= port <= 65535:
        raise ValueError(f"{what} {address!r}: port {port} is outside 1..65535")


#: the longest path a Unix socket address holds (sun_path, with its terminating NUL)
MAX_SOCKET_PATH = 107


def check_socket_path(path: str) -> None:
    """ValueError unless a Unix socket can be created at ``path`` (and its .data/.mem)."""
    longest = len(os.fsencode(path)) + len(".data")
    if longest > MAX_SOCKET_PATH:
        raise ValueError(f"socket path {path!r} is {longest - 5} bytes; a Unix socket path "
                         f"(plus '.data') holds at most {MAX_SOCKET_PATH}")
    parent = Path(path).parent
    if not parent.is_dir():
        raise ValueError(f"socket path {path!r}: directory {str(parent)!r} does not exist")
    if Path(path).is_dir():
        raise ValueError(f"socket path {path!r} is a directory")


def _format_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"])
        value = item.get("input")
        message = item["msg"].removeprefix("Value error, ")  # pydantic's, for a ValueError
        if not key:  # a check across keys: its message names them
            lines.append(message)
        elif item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (value {value!r})")
        else:
            lines.append(f"{key}: {message} (got {value!r})")
    return "config error: " + "; ".join(lines)


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | None = None, overrides: dict[str, Any] | None = None) -> NodeConfig:
    """Read ``path`` (YAML, optional), apply dotted-key ``overrides``, validate.

    Raises ConfigError with a message that names the bad key and value.
    """
    data: dict[str, Any] = {}
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"config error: cannot read {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config error: {path} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            kind = type(loaded).__name__
            raise ConfigError(f"config error: {path} must hold a mapping, not a {kind}")
        data = loaded
    for key, value in (overrides or {}).items():
        _set_path(data, key, value)
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


def parse_set(items: list[str]) -> dict[str, Any]:
    """Turn ``--set a.b=v`` items into overrides; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"config error: --set {item!r} is not key=value")
        key, raw = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw)
    return out
