"""Calls turned into requests to the daemon, and their completions.

- ``connection``: registration (gRPC), the data channel, the memory socket;
  ``completions``: who reads the completions off the data channel (a caller blocked on an op,
  else a background thread).
- ``calls``: what one call asks (``OpCall``); ``submitter``: arena slots, rounds, fusion,
  completions and results; ``fusion``: the buckets; ``combine``: an in-place result the worker
  combines itself; ``handles``: ``Pending`` states and the ``Handle`` users hold.
"""
