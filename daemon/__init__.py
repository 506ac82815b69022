"""decentd: the per-node daemon of decent (peer connections, topology schedule, request queue).

The rooms, bottom up; each imports only its own room, the rooms below it and the root modules
(``scripts/import_graph.py --check`` holds the code to this):

==============  ===============================================================================
root            ``errors``, ``keys`` (op names and tensors on the wire), ``logs``, ``concurrency``
``security``    who may speak: peer proofs, certificates, TLS, local access
``workers``     the local workers: sessions, arenas, staging, the data channel
``net``         the links between daemons: frames in and out, flow control, handshakes
``mailbox``     what peers sent, matched to the ops that take it
``windows``     the window services that answer peers' one-sided requests themselves
``membership``  who is alive: the view, heartbeats, reconnects
``ops``         the ops, over one ``OpContext`` (``ops.api``): neighbor, collective, window ops
``engine``      worker requests to running ops; node-level (hierarchical) collectives
``service``     the daemon process: assembly, gRPC services, config, metrics, timeline
``tools``       ``decentctl`` and ``decentrun``; the daemon never imports them
==============  ===============================================================================

``docs/architecture.md`` walks one call through these rooms.
"""

__version__ = "0.1.0"
