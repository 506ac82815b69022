"""The TensorFlow client: :class:`decent.core.Client` for ``tf.Tensor`` and ``tf.Variable``.

Every op runs eagerly in the calling Python thread (the daemon does the work). Inside a
``tf.function`` the *blocking* ops are staged as ``tf.py_function`` nodes, so they run each time
the graph runs, in graph order; asynchronous ops return handles, which a graph cannot hold, so
they are refused there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from decent.core import Client, Handle
from decent.core.requests.calls import OpCall
from decent.core.surface import adjoints
from decent.core.surface.default_client import DefaultClient
from decent.tf.codec import TFCodec
from decent.tf.gradients import differentiable, tracked


class TFClient(Client[Any]):
    """:class:`decent.core.Client` for TensorFlow (see the module docs for tf.function)."""

    def _call(self, call: OpCall, tensor: Any, name: str | None, timeout: float | None,
              **options: Any) -> Handle[Any]:
        if not tf.executing_eagerly():
            raise RuntimeError("decent.tf: asynchronous ops return handles, which a tf.function "
                               "cannot hold; inside tf.function use the blocking ops "
                               "(neighbor_allreduce, allreduce, ...) or start them eagerly")
        return super()._call(call, tensor, name, timeout, **options)

    def _staged(self, run: Callable[..., Any], tensor: Any,
                shape: Callable[[tf.TensorShape], tf.TensorShape], **kwargs: Any) -> Any:
        """``run(tensor, **kwargs)`` now, or as a py_function node inside tf.function (whose
        result has the static ``shape`` of the input's)."""
        if tf.executing_eagerly():
            return run(tensor, **kwargs)
        value = tensor.read_value() if isinstance(tensor, tf.Variable) else tensor
        out = tf.py_function(lambda t: run(t, **kwargs), [value], Tout=value.dtype)
        out.set_shape(shape(value.shape))
        return out

    def _in_place(self, run: Callable[..., Any], staged: Callable[..., Any], variable: Any,
                  **kwargs: Any) -> Any:
        """``run(variable)`` now, or inside tf.function the staged op assigned to it."""
        if tf.executing_eagerly():
            return run(variable, **kwargs)
        if not isinstance(variable, tf.Variable):
            raise TypeError(f"{run.__name__}: in place needs a tf.Variable, got "
                            f"{type(variable).__name__}")
        variable.assign(staged(variable, **kwargs))
        return variable

    def neighbor_allreduce(self, tensor: Any, **kwargs: Any) -> Any:
        """Blocking neighbor_allreduce (also inside tf.function); its gradient is the same op
        with W transposed."""
        if not tracked(tensor):
            return self._staged(super().neighbor_allreduce, tensor, _same, **kwargs)
        return differentiable(tensor, lambda t: self._plain("neighbor_allreduce")(t, **kwargs),
                              adjoints.neighbor_allreduce(*adjoints.neighbor_plan(self, kwargs),
                                                          kwargs), self._plain)

    def hierarchical_neighbor_allreduce(self, tensor: Any, **kwargs: Any) -> Any:
        """Blocking hierarchical_neighbor_allreduce (also inside tf.function)."""
        return self._staged(super().hierarchical_neighbor_allreduce, tensor, _same, **kwargs)

    def allreduce(self, tensor: Any, **kwargs: Any) -> Any:
        """Blocking allreduce (also inside tf.function); its gradient is the allreduce of the
        gradients."""
        if not tracked(tensor):
            return self._staged(super().allreduce, tensor, _same, **kwargs)
        return differentiable(tensor, lambda t: self._plain("allreduce")(t, **kwargs),
                              adjoints.allreduce(kwargs), self._plain)

    def broadcast(self, tensor: Any, root: int = 0, **kwargs: Any) -> Any:
        """Blocking broadcast (also inside tf.function); its gradient is the sum of the
        gradients, on the root."""
        if not tracked(tensor):
            return self._staged(super().broadcast, tensor, _same, root=root, **kwargs)
        return differentiable(tensor, lambda t: self._plain("broadcast")(t, root=root, **kwargs),
                              adjoints.broadcast(self.rank, root, kwargs), self._plain)

    def allgather(self, tensor: Any, **kwargs: Any) -> Any:
        """Blocking allgather (also inside tf.function); its gradient is this rank's rows of
        the summed gradients."""
        if not tracked(tensor):
            return self._gather(tensor, **kwargs)
        value = tensor.read_value() if isinstance(tensor, tf.Variable) else tensor
        rows = self._gather(tf.shape(value, out_type=tf.int64)[:1],
                            name=f"{kwargs.get('name') or 'allgather'}.rows")
        start = tf.reduce_sum(rows[:self.rank])
        return differentiable(tensor, lambda t: self._gather(t, **kwargs),
                              adjoints.allgather(start, start + rows[self.rank], kwargs),
                              self._plain)

    def _gather(self, tensor: Any, **kwargs: Any) -> Any:
        """The blocking allgather without gradients (also inside tf.function)."""
        return self._staged(super().allgather, tensor,
                            lambda s: tf.TensorShape([None]).concatenate(s[1:]), **kwargs)

    def _plain(self, op: str) -> Callable[..., Any]:
        """The blocking op ``op`` without gradients (also inside tf.function)."""
        run = getattr(super(), op)
        return lambda tensor, **kwargs: self._staged(run, tensor, _same, **kwargs)

    def neighbor_allgather(self, tensor: Any, **kwargs: Any) -> Any:
        """Blocking neighbor_allgather (also inside tf.function)."""
        return self._staged(super().neighbor_allgather, tensor,
                            lambda s: tf.TensorShape([None]).concatenate(s), **kwargs)

    def compressed_neighbor_allreduce(self, tensor: Any, compressor: str, **kwargs: Any) -> Any:
        """Blocking compressed_neighbor_allreduce (also inside tf.function)."""
        return self._staged(super().compressed_neighbor_allreduce, tensor,
                            lambda s: tf.TensorShape([2]).concatenate(s),
                            compressor=compressor, **kwargs)

    def neighbor_allreduce_(self, tensor: Any, **kwargs: Any) -> Any:
        """Blocking in-place neighbor_allreduce on a tf.Variable (also inside tf.function)."""
        return self._in_place(super().neighbor_allreduce_, self.neighbor_allreduce, tensor,
                              **kwargs)

    def allreduce_(self, tensor: Any, **kwargs: Any) -> Any:
        """Blocking in-place allreduce on a tf.Variable (also inside tf.function)."""
        return self._in_place(super().allreduce_, self.allreduce, tensor, **kwargs)

    def broadcast_(self, tensor: Any, root: int = 0, **kwargs: Any) -> Any:
        """Blocking in-place broadcast on a tf.Variable (also inside tf.function)."""
        return self._in_place(super().broadcast_, self.broadcast, tensor, root=root, **kwargs)

    def barrier(self, name: str | None = None, timeout: float | None = None) -> None:
        """Wait for every rank (also inside tf.function)."""
        if tf.executing_eagerly():
            super().barrier(name=name, timeout=timeout)
            return
        wait = super().barrier
        tf.py_function(lambda: wait(name=name, timeout=timeout), [], Tout=[])


def _same(shape: tf.TensorShape) -> tf.TensorShape:
    return shape


def connect(address: str | None = None, connect_timeout: float = 120.0,
            job: str | None = None, fusion_threshold: int | None = None,
            cycle_time: float | None = None, local_rank: int | None = None) -> TFClient:
    """A new client of the local daemon (the arguments as in ``decent.torch.connect``)."""
    return TFClient(TFCodec(), address, connect_timeout, job, fusion_threshold, cycle_time,
                    register=False, local_rank=local_rank)


#: the default client of ``decent.tf``: ``init()`` creates it
default_client: DefaultClient[Any, TFClient] = DefaultClient("decent.tf", connect)
