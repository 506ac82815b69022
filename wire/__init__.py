"""decent_wire: what the daemon (``decentd``) and the clients (``decent``) share and neither owns.

The generated protocol modules (:mod:`decent_wire.v1`, built from ``proto/``), the one framing
of length-prefixed messages (:mod:`decent_wire.framing`), the protocol version
(:mod:`decent_wire.protocol`), the dtype table (:mod:`decent_wire.dtypes`), the error type that
carries a wire error code (:mod:`decent_wire.errors`) and the topology library
(:mod:`decent_wire.topology`). Both sides import it; it imports neither.
"""

__version__ = "0.1.0"
