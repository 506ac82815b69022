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

from decent.core import Client
from decent.core.surface import adjoints
from decent.core.surface.default_client import DefaultClient
from decent.core.surface.methods import OpMethods
from decent.tf.codec import TFCodec
from decent.tf.gradients import differentiable, tracked
from decent_wire.ops import BY_NAME, USER_OPS, OpDecl, Result

#: the ops a graph may stage (the window ops hold state a graph cannot replay; they run eagerly)
STAGED = frozenset(op.name for op in USER_OPS if not op.name.startswith(("win_", "group_")))


def _static_shape(op: OpDecl, shape: tf.TensorShape) -> tf.TensorShape:
    """The static shape of ``op``'s result for an input of ``shape`` (unknown first dimension
    where it depends on the other ranks)."""
    if op.result is Result.PAIR:
        return tf.TensorShape([2]).concatenate(shape)
    if op.result is Result.STACKED:
        return tf.TensorShape([None]).concatenate(shape)
    if op.result is Result.GATHERED:
        return tf.TensorShape([None]).concatenate(shape[1:])
    return shape


class TFClient(Client[Any]):
    """:class:`decent.core.Client` for TensorFlow (see the module docs for tf.function)."""

    def _blocking(self, op: OpDecl, kwargs: dict[str, Any]) -> Any:
        """The blocking form of ``op``: differentiable for a floating tensor when the op is,
        and staged as a ``tf.py_function`` inside a ``tf.function``."""
        tensor, into = kwargs.get("tensor"), kwargs.get("into")
        if into is not None:
            return self._in_place(op, into, kwargs)
        if not op.differentiable or not tracked(tensor):
            return self._staged(op, tensor, lambda t: OpMethods._blocking(
                self, op, kwargs if t is None else {**kwargs, "tensor": t}))
        if op.name == "allgather":
            value = tensor.read_value() if isinstance(tensor, tf.Variable) else tensor
            rows = self._plain_op("allgather")(tf.shape(value, out_type=tf.int64)[:1],
                                               name=f"{kwargs.get('name') or 'allgather'}.rows")
            start = tf.reduce_sum(rows[:self.rank])
            adjoint = adjoints.allgather(start, start + rows[self.rank], kwargs)
        else:
            adjoint = adjoints.of(op.name, self, kwargs)
        return differentiable(tensor, lambda t: self._staged(op, t, lambda x: OpMethods._blocking(
            self, op, {**kwargs, "tensor": x})), adjoint, self._plain_op)

    def _staged(self, op: OpDecl, tensor: Any, run: Callable[[Any], Any]) -> Any:
        """``run(tensor)`` now, or as a py_function node inside tf.function."""
        if tf.executing_eagerly() or op.name not in STAGED:
            return run(tensor)
        if tensor is None:  # barrier
            tf.py_function(lambda: run(None), [], Tout=[])
            return None
        value = tensor.read_value() if isinstance(tensor, tf.Variable) else tensor
        out = tf.py_function(run, [value], Tout=value.dtype)
        out.set_shape(_static_shape(op, value.shape))
        return out

    def _in_place(self, op: OpDecl, variable: Any, kwargs: dict[str, Any]) -> Any:
        """The in-place form now, or inside tf.function the staged op assigned to it."""
        if tf.executing_eagerly() or op.name not in STAGED:
            return super()._blocking(op, kwargs)
        if not isinstance(variable, tf.Variable):
            raise TypeError(f"{op.name}_: in place needs a tf.Variable, got "
                            f"{type(variable).__name__}")
        variable.assign(self._blocking(op, {**kwargs, "into": None}))
        return variable

    def _plain_op(self, op: str) -> Callable[..., Any]:
        """The blocking op ``op`` without gradients (also inside tf.function)."""
        decl = BY_NAME[op]
        return lambda tensor, **kwargs: self._staged(
            decl, tensor, lambda t: self._plain(op, t, **kwargs))


def connect(address: str | None = None, connect_timeout: float = 120.0,
            job: str | None = None, fusion_threshold: int | None = None,
            cycle_time: float | None = None, local_rank: int | None = None) -> TFClient:
    """A new client of the local daemon (the arguments as in ``decent.torch.connect``)."""
    client = TFClient(TFCodec(), address, connect_timeout, job, fusion_threshold, cycle_time,
                      register=False, local_rank=local_rank)
    default_client.adopt(client)
    return client


#: the default client of ``decent.tf``: ``init()`` creates it
default_client: DefaultClient[Any, TFClient] = DefaultClient("decent.tf", connect)
