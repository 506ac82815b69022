"""Survive SIGBUS in memory a worker shrank under the daemon (the C module daemon/workers/sigbus.c).
"""

def install() -> None:
    """Handle SIGBUS in watched ranges from now on (idempotent)."""

def watch(address: int, nbytes: int) -> None:
    """A SIGBUS in ``[address, address + nbytes)`` maps a zero page there and is counted
    (OverflowError when every slot is taken)."""

def unwatch(address: int) -> int:
    """Stop watching the range at ``address`` (once it is unmapped); the faults it had."""

def faults(address: int) -> int:
    """The faults of the range at ``address``."""

def total() -> int:
    """Faults in every range since the start."""
