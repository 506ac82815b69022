"""Framework-agnostic client core: connection, arena, requests and handles, the op surface,
the algorithms, and a numpy codec."""

from decent.core.arena import ClientArena
from decent.core.client import Client
from decent.core.codec import TensorCodec
from decent.core.connection import default_address
from decent.core.handles import Handle
from decent.core.numpy_codec import NumpyCodec
from decent_wire.errors import DecentError

__all__ = [
    "Client",
    "ClientArena",
    "DecentError",
    "Handle",
    "NumpyCodec",
    "TensorCodec",
    "default_address",
]
