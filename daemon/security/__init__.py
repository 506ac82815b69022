"""Who may speak to this daemon: peers proving their rank, and local processes.

- ``auth``: secret-mode challenge-response, session keys and HELLO proofs (:class:`PeerAuth`).
- ``certs``: the cluster's certificates (``decentctl certs``) and the
  ``decent://<cluster>/rank/<n>`` identity in them.
- ``tls``: mutual-TLS credentials and contexts for gRPC and the bulk path.
- ``local_access``: which local processes may use the worker sockets and arenas (modes, group,
  SO_PEERCRED).

Imports nothing of the daemon but its root modules.
"""
