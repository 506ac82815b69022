"""Host buffers for the Keras optimizer's algorithms that are not adapt-then-combine.

TensorFlow tensors never change, so arithmetic on them makes a new tensor each time. Instead the
Keras optimizer runs such an algorithm over numpy arrays it keeps across steps, as the torch
adapter does over its own tensors: ``x_k`` and ``d_k`` in two sets of buffers used in turn (an
algorithm may keep the previous step's for one step; in the arena when they fit, so exchanging
them copies nothing to the daemon), and each new value in a *home*: a buffer
of a pool that the variable takes as it lies (an assign takes the buffer it is given) and gives
back to the pool when TensorFlow lets go of it (its next assign), so after the first steps no
step allocates a variable-sized buffer.

Variables numpy cannot hold (bfloat16) or that live on a GPU are not served here
(:func:`hostable`): the optimizer keeps TensorFlow arithmetic for them.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from decent.tf.codec import ALIGNMENT, host_view

#: a buffer's shape and numpy dtype
Layout = tuple[tuple[int, ...], np.dtype]


def hostable(values: Sequence[tf.Tensor]) -> bool:
    """Whether every value (or variable) can be served by host buffers: on the CPU, in a dtype
    numpy has, with a known shape and some elements."""
    return all("GPU" not in (v.device or "").upper() and v.dtype != tf.bfloat16
               and v.shape.is_fully_defined() and v.shape.num_elements() for v in values)


def view_of(value: tf.Tensor) -> np.ndarray:
    """A read-only numpy view of a CPU tensor's memory (no copy; :func:`hostable` values)."""
    view = host_view(value)
    if view is None:
        raise TypeError(f"a {value.dtype.name} tensor on {value.device!r} has no host view")
    return view


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose memory TensorFlow's kernels can take
    (aligned to :data:`decent.tf.codec.ALIGNMENT`)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class HomePool:
    """Aligned buffers that variables hold their values in; a buffer comes back when the
    TensorFlow tensor over it is freed. Thread-safe without a lock (TensorFlow frees on its own
    threads, and a garbage collection inside a give-back may give back another): a deque's
    append and pop are atomic."""

    def __init__(self) -> None:
        self._free: dict[Layout, collections.deque[np.ndarray]] = {}

    def tensor_of(self, value: np.ndarray) -> tf.Tensor:
        """A tensor holding a copy of ``value``, in a buffer of the pool."""
        home = self._take((value.shape, value.dtype))
        np.copyto(home, value)
        lent = home.view()  # only the tensor holds this view: when it goes, the home returns
        weakref.finalize(lent, self._give_back, home)
        return tf.experimental.dlpack.from_dlpack(lent.__dlpack__())

    def _take(self, layout: Layout) -> np.ndarray:
        try:
            return self._free[layout].pop()
        except (KeyError, IndexError):
            return aligned_empty(*layout)  # every home of this layout is still held

    def _give_back(self, home: np.ndarray) -> None:
        self._free.setdefault((home.shape, home.dtype), collections.deque()).append(home)


class HostSteps:
    """``x_k`` and ``d_k`` of the variables in numpy buffers kept across steps (two sets, used
    in turn), and the homes of their new values (:class:`HomePool`)."""

    def __init__(self, shared: Callable[[np.ndarray], np.ndarray | None]) -> None:
        """``shared(a)``: a copy of ``a`` in the arena, or None when it has no room."""
        self._shared = shared
        self._sets: list[tuple[list[np.ndarray], list[np.ndarray]]] = []
        self._turn = 0
        self.homes = HomePool()

    def snapshot(self, values: Sequence[tf.Tensor]) -> None:
        """``x_k``: a copy of each value, in this step's set."""
        views = [view_of(v) for v in values]
        layout = [(v.shape, v.dtype) for v in views]
        if not self._sets or [(b.shape, b.dtype) for b in self._sets[0][0]] != layout:
            self._sets = [self._allocate(layout), self._allocate(layout)]
        self._turn ^= 1
        xs = self._sets[self._turn][0]
        for x, view in zip(xs, views, strict=True):
            np.copyto(x, view)

    def xs(self) -> list[np.ndarray]:
        """This step's ``x_k`` (:meth:`snapshot`)."""
        return list(self._sets[self._turn][0])

    def _allocate(self, layout: list[Layout]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return [self._buffer(*lay) for lay in layout], [self._buffer(*lay) for lay in layout]

    def _buffer(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialized array: in the arena if it fits."""
        empty = np.empty(shape, dtype)
        shared = self._shared(empty)
        return empty if shared is None else shared

    def updates(self, values: Sequence[tf.Tensor]) -> list[np.ndarray]:
        """``d_k = x_k - x_k'``: the wrapped optimizer's update, from the values after it."""
        xs, ds = self._sets[self._turn]
        for d, x, v in zip(ds, xs, values, strict=True):
            np.subtract(x, view_of(v), out=d)
        return list(ds)

    def tensors(self, new: Sequence[np.ndarray]) -> list[tf.Tensor]:
        """The new values as tensors in homes (one copy each, no allocation once the pool has
        a free home per variable)."""
        return [self.homes.tensor_of(np.asarray(n)) for n in new]
