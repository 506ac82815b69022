"""The daemon's local workers: their sessions, their shared memory, and the channel their
requests come in on.

- ``arena``: a worker's sealed shared-memory arena and the memory it registered; ``sigbus``
  (C): the guard that survives a worker shrinking registered memory.
- ``staging``: an input the worker is still copying in (``FillState``, and ``FillGate`` for the
  senders), and an output it copies out as it becomes final (``Drain``).
- ``sessions``: the registered workers (``WorkerSession``) and their lifetime (``Sessions``).
- ``channel``: the data channel (requests in, completions out) and the memory socket.

Who runs the requests is not known here: the channel and the sessions talk to it through the
``Requests`` protocol (the engine implements it), so this room sits below the network.
"""
