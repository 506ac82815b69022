"""Matching what peers send to the ops that take it.

- ``slots``: the ``Mailbox``: one slot per ``(peer, name, round, tag)``, early arrivals,
  acknowledgements, aborts before an op opens, RTS announcements.
- ``arrivals``: a received payload and its parts, released part by part.
- ``absences``: workers that left and rounds peers ran without us (nothing waits for them).
- ``receiver``: the peers' frames taken apart: flow checks, parts to the mailbox or to the
  one-sided handlers (the window services, handed in), credit back.

Calls down into ``net`` only; an open op hears from its slot through ``OpListener``.
"""
