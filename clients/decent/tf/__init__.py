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

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from decent.core import Client, DecentError, Handle
from decent.core.shortcuts import DefaultClient, default_client_method
from decent.tf.codec import TFCodec
from decent.tf.optim import (
    BroadcastGlobalVariablesCallback,
    DecentralizedOptimizer,
    MetricAverageCallback,
)

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "Client",
    "DecentError",
    "DecentralizedOptimizer",
    "Handle",
    "MetricAverageCallback",
    "TFClient",
    "connect",
    "init",
    "rank",
    "shutdown",
    "size",
]

#: blocking ops that also work inside tf.function, with the result's static shape
_GRAPH_OPS: dict[str, Callable[[tf.TensorShape], tf.TensorShape]] = {
    "neighbor_allreduce": lambda s: s,
    "allreduce": lambda s: s,
    "broadcast": lambda s: s,
    "neighbor_allgather": lambda s: tf.TensorShape([None]).concatenate(s),
    "compressed_neighbor_allreduce": lambda s: tf.TensorShape([2]).concatenate(s),
}
#: in-place forms: on a tf.Variable the result is assigned to it
_IN_PLACE = {"neighbor_allreduce_": "neighbor_allreduce", "allreduce_": "allreduce",
             "broadcast_": "broadcast"}


class TFClient(Client[Any]):
    """:class:`decent.core.Client` for TensorFlow (see the module docs for tf.function)."""

    def _submit(self, *args: Any, **kwargs: Any) -> Handle[Any]:
        if not tf.executing_eagerly():
            raise RuntimeError("decent.tf: asynchronous ops return handles, which a tf.function "
                               "cannot hold; inside tf.function use the blocking ops "
                               "(neighbor_allreduce, allreduce, ...) or start them eagerly")
        return super()._submit(*args, **kwargs)

    def _staged(self, method: str, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """``Client.<method>(tensor, ...)`` now, or as a py_function node inside tf.function."""
        run = getattr(Client, method)
        if tf.executing_eagerly():
            return run(self, tensor, *args, **kwargs)
        value = tensor.read_value() if isinstance(tensor, tf.Variable) else tensor
        out = tf.py_function(lambda t: run(self, t, *args, **kwargs), [value],
                             Tout=value.dtype)
        out.set_shape(_GRAPH_OPS[method](value.shape))
        return out

    def _in_place(self, method: str, variable: Any, **kwargs: Any) -> Any:
        if tf.executing_eagerly():
            return getattr(Client, method)(self, variable, **kwargs)
        if not isinstance(variable, tf.Variable):
            raise TypeError(f"{method}: in place needs a tf.Variable, got "
                            f"{type(variable).__name__}")
        variable.assign(self._staged(_IN_PLACE[method], variable, **kwargs))
        return variable

    def barrier(self, name: str | None = None, timeout: float | None = None) -> None:
        """Wait for every rank (also inside tf.function)."""
        if tf.executing_eagerly():
            Client.barrier(self, name=name, timeout=timeout)
            return
        tf.py_function(lambda: Client.barrier(self, name=name, timeout=timeout), [], Tout=[])




def connect(address: str | None = None, connect_timeout: float = 120.0,
            job: str | None = None, fusion_threshold: int | None = None,
            cycle_time: float | None = None) -> TFClient:
    """A new client of the local daemon (the arguments as in ``decent.torch.connect``)."""
    return TFClient(TFCodec(), address, connect_timeout, job, fusion_threshold, cycle_time,
                    register=False)


def _staged_method(method: str) -> Callable[..., Any]:
    def call(self: TFClient, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._staged(method, tensor, *args, **kwargs)

    call.__name__ = call.__qualname__ = method
    call.__doc__ = f"Blocking {method} (also inside tf.function)."
    return call


def _in_place_method(method: str) -> Callable[..., Any]:
    def call(self: TFClient, variable: Any, **kwargs: Any) -> Any:
        return self._in_place(method, variable, **kwargs)

    call.__name__ = call.__qualname__ = method
    call.__doc__ = f"Blocking in-place {method[:-1]} on a tf.Variable (also inside tf.function)."
    return call


for _name in _GRAPH_OPS:
    setattr(TFClient, _name, _staged_method(_name))
for _name in _IN_PLACE:
    setattr(TFClient, _name, _in_place_method(_name))


_holder = DefaultClient("decent.tf", connect)
init, shutdown, rank, size, _client = (_holder.init, _holder.shutdown, _holder.rank,
                                       _holder.size, _holder.get)


_SHORTCUTS = (
    "neighbor_allreduce_async", "neighbor_allreduce", "neighbor_allreduce_async_",
    "neighbor_allreduce_", "compressed_neighbor_allreduce_async",
    "compressed_neighbor_allreduce", "neighbor_allgather_async", "neighbor_allgather",
    "allreduce_async", "allreduce", "allreduce_async_", "allreduce_", "broadcast_async",
    "broadcast", "broadcast_async_", "broadcast_", "barrier", "flush", "in_neighbors",
    "out_neighbors", "win_create", "win_put_async", "win_put", "win_accumulate_async",
    "win_accumulate", "win_get_async", "win_get", "win_update", "win_publish", "win_free",
    "win_info", "win_versions", "win_exchange_async", "win_exchange", "win_add",
    "group_allreduce_async", "group_allreduce",
)
globals().update({name: default_client_method(_client, name) for name in _SHORTCUTS})
__all__ += list(_SHORTCUTS)
