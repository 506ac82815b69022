"""The daemon process: assembly, control services and operations.

- ``server``: every part built once from the config, then served until SIGTERM.
- ``rpc``: the gRPC services (``Worker`` on the Unix socket, ``Peer`` for daemons).
- ``config``: ``node.yaml``, validated (pydantic); ``cli``: ``decentd``; ``reload``: SIGHUP.
- ``notify``: systemd readiness; ``metrics``: Prometheus; ``timeline``: the Chrome trace;
  ``peer_status``: every daemon's status, asked by one.
"""
