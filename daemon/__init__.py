"""decentd: the per-node daemon of decent (peer connections, topology schedule, request queue)."""

__version__ = "0.1.0"
