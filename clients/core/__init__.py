"""decent.core: the framework-neutral client, in four rooms (bottom up; each imports only the
rooms below it, ``scripts/import_graph.py --check``):

- ``memory``: tensor memory shared with the daemon (arena, registered regions, spills, results);
- ``requests``: calls turned into requests and completions (connection, submitter, handles);
- ``surface``: the op surface users call (``Client`` and the module shortcuts' client);
- ``training``: the algorithms and training state, over the surface.

The adapters ``decent.torch`` and ``decent.tf`` stand on top; this module exports what they and
numpy users need.
"""

from decent.core.memory.arena import ClientArena
from decent.core.memory.codec import TensorCodec
from decent.core.memory.numpy_codec import NumpyCodec
from decent.core.requests.connection import default_address
from decent.core.requests.handles import Handle
from decent.core.surface.client import Client
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
