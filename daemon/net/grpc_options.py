"""gRPC options of the daemon's channels and servers."""

from __future__ import annotations

#: every channel and server
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
    # peers start in any order: retry a peer that is not up yet soon, not after gRPC's 1 s
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a second daemon on a port in use must fail to bind, not share the port with the first
    ("grpc.so_reuseport", 0),
]

#: the peer gRPC server: it carries only challenges and handshakes (a few hundred bytes), to
#: callers not proven yet; idle connections are closed, streams per connection bounded
PEER_SERVER_OPTIONS: list[tuple[str, int]] = [
    *(o for o in GRPC_OPTIONS if o[0] != "grpc.max_receive_message_length"),
    ("grpc.max_receive_message_length", 64 << 10),
    ("grpc.max_concurrent_streams", 16),
    ("grpc.max_connection_idle_ms", 60_000),
]
