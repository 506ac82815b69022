"""decentd: the per-node daemon of decent (peer connections, topology schedule, request queue)."""

__version__ = "0.1.0"

#: Wire protocol version (decent.v1.ProtocolVersion.PROTOCOL_VERSION_CURRENT).
PROTOCOL_VERSION = 1
