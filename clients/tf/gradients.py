"""Collectives that ``tf.GradientTape`` differentiates: a blocking out-of-place ``allreduce``,
``broadcast``, ``allgather`` or ``neighbor_allreduce`` of a floating tensor returns a tensor whose
gradient is
the adjoint collective (:mod:`decent.core.surface.adjoints`), through ``tf.custom_gradient`` (also
inside
``tf.function``, where a topology's weights are those at tracing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from decent.core.surface.adjoints import Adjoint


def tracked(tensor: Any) -> bool:
    """Whether a gradient can flow through ``tensor`` (a floating tensor or variable; never a
    numpy array)."""
    if isinstance(tensor, np.ndarray):
        return False
    dtype = getattr(tensor, "dtype", None)
    return dtype is not None and tf.as_dtype(dtype).is_floating


def differentiable(x: Any, run: Callable[[Any], Any], adjoint: Adjoint,
                   plain: Callable[[str], Callable[..., Any]]) -> Any:
    """``run(x)`` with ``adjoint`` (through ``plain(op)``, the client's op of that name without
    gradients) as its gradient."""

    @tf.custom_gradient
    def collective(t: tf.Tensor) -> tuple[Any, Callable[[tf.Tensor], Any]]:
        def grad(upstream: tf.Tensor) -> Any:
            return adjoint.keep(plain(adjoint.op)(upstream, **adjoint.kwargs))
        return run(t), grad

    value = x.read_value() if isinstance(x, tf.Variable) else x
    return collective(value)
