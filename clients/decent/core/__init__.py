"""Framework-agnostic client core: connection, arena, handles, and a numpy codec."""

from decent.core.arena import ClientArena
from decent.core.client import Client, Handle, TensorCodec, default_address
from decent.core.errors import DecentError
from decent.core.numpy_codec import NumpyCodec

__all__ = [
    "Client",
    "ClientArena",
    "DecentError",
    "Handle",
    "NumpyCodec",
    "TensorCodec",
    "default_address",
]
