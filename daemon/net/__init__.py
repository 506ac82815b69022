"""The links between daemons: connections, frames in and out, flow control, handshakes.

- ``inbound``: the raw stream in (``Inbound``, a ``BufferedProtocol``; the ``Gate`` of
  unproven connections).
- ``outbound``: the raw stream out (``Sender``, a thread per peer writing with ``sendmsg``).
- ``loopback``: the daemon as its own peer (frames between its workers, no socket).
- ``flow``: per-link credit both ways; ``buffers``: reusable receive buffers.
- ``peer``: one peer as the links see it (``PeerLink``) and address helpers.
- ``links``: every peer's link, addressing, sending (eager or RTS) and control frames.
- ``dial``: reaching one peer (handshake, bulk connection, HELLO); ``handshake``: the callee's
  checks of a handshake; ``grpc_options``: the options of every gRPC channel and server.
- ``late_rounds``: round offsets of peers that joined late, translated both ways.

Imports nothing from ``mailbox``, ``ops`` or ``engine``: frames go up through the ``FrameSink``
protocol that ``mailbox.receiver`` implements.
"""
