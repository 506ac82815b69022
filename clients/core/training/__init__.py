"""Training on top of the surface.

- ``algorithms``: the decentralized algorithms (``algorithms.md``), written once.
- ``state``: a training state as tensors and plain values (never a pickle); ``transfer``:
  sending it to a rank that joined late, from several donors in ``chunks`` (checksummed).
"""
