"""gRPC options of the daemon's channels and servers."""

from __future__ import annotations

#: how long one connection attempt to a peer may take (a few round trips of the slowest link)
MIN_CONNECT_TIMEOUT_MS = 5000

#: every channel and server
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", 16 << 20),
    ("grpc.max_receive_message_length", 16 << 20),
    # peers start in any order: retry a peer that is not up yet soon, not after gRPC's 1 s
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # gRPC also takes this as each connection attempt's deadline: at 100 ms (it once was), a
    # peer 100 ms of RTT away was never reached (TCP's and HTTP/2's handshakes take two round
    # trips); a refused attempt fails at once whatever it is
    ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
    # a second daemon on a port in use must fail to bind, not share the port with the first
    ("grpc.so_reuseport", 0),
]

#: our channels to a peer: each its own TCP connection. gRPC otherwise shares one connection
#: attempt between every channel to an address, and one started while the peer was cut off
#: waits out the kernel's SYN retries (1, 3, 7, 15 s): a fresh channel for each attempt to
#: reach a peer again would wait on it too (a healed partition then took 8 s instead of 1)
PEER_CHANNEL_OPTIONS: list[tuple[str, int]] = [*GRPC_OPTIONS,
                                               ("grpc.use_local_subchannel_pool", 1)]


def peer_server_options(auth_timeout: float) -> list[tuple[str, int]]:
    """The peer gRPC server's: it carries only challenges, handshakes and status requests (a
    few hundred bytes), to callers not proven yet. Streams per connection are bounded, idle
    connections closed, and every connection is closed after ``3 * auth_timeout`` seconds
    (the callers of a real peer open a new one): a call still open ``auth_timeout`` after that
    (a request never finished, a half-open stream) is cut."""
    return [
        *(o for o in GRPC_OPTIONS if o[0] != "grpc.max_receive_message_length"),
        ("grpc.max_receive_message_length", 64 << 10),
        ("grpc.max_concurrent_streams", 16),
        ("grpc.max_connection_idle_ms", 60_000),
        ("grpc.max_connection_age_ms", int(3000 * auth_timeout)),
        ("grpc.max_connection_age_grace_ms", int(1000 * auth_timeout)),
    ]
