"""Worker requests to running ops.

- ``requests``: the ``Engine``: validation, worker-level ops, tasks, timeouts, ABORT to the
  participants, the stall inspector.
- ``hierarchy``: node-level collectives (a node's workers combined first, then one op among the
  daemons); ``node_gathers``: their requests gathered per tensor and launched.

Ops are reached only through ``decentd.ops`` (their ``OpSpec`` table and ``OpContext``).
"""
