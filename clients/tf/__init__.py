"""TensorFlow client of decentd: the torch client's API for ``tf.Tensor`` and ``tf.Variable``.

    import decent.tf as dtf
    client = dtf.connect()                       # $DECENT_DAEMON, else the default socket
    h = client.neighbor_allreduce_async(t)       # returns at once
    y = h.wait()                                 # a tf.Tensor, same dtype, shape and device
    client.neighbor_allreduce_(v)                # a tf.Variable: the result is assigned to it

What runs where: every op runs eagerly in the calling Python thread (the daemon does the work).
Inside a ``tf.function`` the *blocking* ops (``neighbor_allreduce``, ``allreduce``,
``broadcast``, their in-place forms on variables, ``neighbor_allgather``,
``compressed_neighbor_allreduce``, ``barrier``) are staged as ``tf.py_function`` nodes, so they
run each time the graph runs, in graph order; asynchronous ops return handles, which a graph
cannot hold, so they are refused inside a ``tf.function`` (start them eagerly). TensorFlow does
not expose its buffers: each op copies the tensor into the daemon's shared memory and the result
out (``client.shared()`` and memory registration are torch-only).
"""

from __future__ import annotations

from typing import Any

from decent.core import Client, DecentError, Handle
from decent.core.surface.default_client import SHORTCUTS
from decent.tf import callbacks
from decent.tf.client import TFClient, connect, default_client
from decent.tf.compression import Compression
from decent.tf.horovod import DistributedOptimizer, LearningRateWarmupCallback
from decent.tf.optim import (
    BroadcastGlobalVariablesCallback,
    DecentralizedOptimizer,
    MetricAverageCallback,
)

#: Horovod's reduction ops (decent's allreduce takes the same names)
Average = "average"
Sum = "sum"

# the module-level shortcuts: the default client's, from the op table (every op's methods) and
# the client's queries (decent.core.surface.default_client)
globals().update(default_client.shortcuts())


def __getattr__(name: str) -> Any:
    """Only for names that do not exist (the shortcuts above are set when the module loads)."""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Average", "BroadcastGlobalVariablesCallback", "Client", "Compression", "DecentError",
           "DecentralizedOptimizer", "DistributedOptimizer", "Handle",
           "LearningRateWarmupCallback", "MetricAverageCallback",
           "Sum", "TFClient", "callbacks", "connect", *SHORTCUTS]
