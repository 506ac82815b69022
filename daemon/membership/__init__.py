"""Who is alive: peer states, incarnations and the view (epoch, live set).

- ``view``: each peer daemon's state and incarnation, and the membership view.
- ``liveness``: the ``Supervisor`` that connects, watches (heartbeats) and reconnects the links.
"""
