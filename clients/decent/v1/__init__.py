"""Generated wire modules for protocol package ``decent.v1`` (built from ``proto/``)."""
