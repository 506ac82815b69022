"""The op surface users call, written once for torch, TensorFlow and numpy.

- ``client``: ``Client``; ``default_client``: the module-level shortcuts' client.
- ``methods``: every op's methods, generated from the op table (``decent_wire.ops``) by
  ``scripts/gen_surface.py``; ``op_calls`` and ``window_calls``: each op's one hand-written
  call; ``topology_ops``: the topology control request; ``args``: typed wire arguments.
- ``compat``: BlueFog's and Horovod's names, in one table.
- ``adjoints``: the gradients of the collectives; ``membership``: the daemon's view;
  ``rejoin``: who brings a late rank up to date; ``horovod_compression``: Horovod's gradient
  compression (a cast before the reduction; the daemon's gossip compressors are another thing).
"""
