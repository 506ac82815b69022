"""Matching what peers send to the ops that take it.

- ``slots``: the ``Mailbox``: one slot per ``(peer, name, round, tag)``, early arrivals,
  acknowledgements, aborts before an op opens, RTS announcements.
- ``records``: a part's key, the ``Slot`` of one key, and the interfaces the mailbox talks
  through (``Outbox``, an open op's ``OpListener``).
- ``arrivals``: a received payload and its parts, released part by part.
- ``absences``: workers that left and rounds peers ran without us (nothing waits for them).
- ``horizons``: one numbering of rounds across a count-out: the last round of each of our keys
  started here (told to a peer back from a count-out), and up to which round each peer ran a
  key without us.
- ``receiver``: the peers' frames taken apart: flow checks, parts to the mailbox or to the
  one-sided handlers (the window services, handed in), credit back.

Calls down into ``net`` only; an open op hears from its slot through ``OpListener``.
"""
