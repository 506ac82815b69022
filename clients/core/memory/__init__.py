"""Tensor memory the worker shares with its daemon.

- ``codec``: what a framework adapter supplies (``TensorCodec``); ``numpy_codec``: numpy's.
- ``arena``: the worker's side of the shared-memory arena (slots for requests).
- ``regions``, ``registrar``: tensors in shared memory handed to the daemon once.
- ``spill``: memory beyond a full arena; ``results``: out-of-place results as tensors over
  the memory the daemon wrote them into.
"""
