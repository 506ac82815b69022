"""The op surface users call, written once for torch, TensorFlow and numpy.

- ``client``: ``Client``; ``default_client``: the module-level shortcuts' client.
- ``window_ops``, ``topology_ops``, ``hierarchy_ops``: the window, topology and hierarchical
  parts of the surface; ``args``: typed wire arguments.
- ``adjoints``: the gradients of the collectives; ``membership``: the daemon's view;
  ``rejoin``: who brings a late rank up to date; ``horovod_compression``: Horovod's gradient
  compression (a cast before the reduction; the daemon's gossip compressors are another thing).
"""
