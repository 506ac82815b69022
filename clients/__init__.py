"""decent: clients of the decent daemon.

``decent.core`` is the framework-agnostic client (connection, shared-memory arena, handles);
``decent.torch`` and ``decent.tf`` adapt it to a framework. Importing ``decent`` imports no
framework.
"""

__version__ = "0.1.0"
