"""Module-level shortcuts (``decent.torch.neighbor_allreduce(t)``, ...) over a default client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class _Closable(Protocol):
    rank: int
    size: int

    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


def default_client_method(get_client: Callable[[], Any], method: str) -> Callable[..., Any]:
    """A function that calls ``Client.<method>`` on the client ``get_client()`` returns."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(get_client(), method)(*args, **kwargs)

    call.__name__ = call.__qualname__ = method
    call.__doc__ = f"See :meth:`decent.core.Client.{method}` (on the default client)."
    return call


class DefaultClient(Generic[C]):
    """The default client of a framework module (``decent.torch``, ``decent.tf``): created
    once by ``init()``, used by the module-level functions, closed by ``shutdown()``."""

    def __init__(self, module: str, connect: Callable[[str | None], C]) -> None:
        self.module = module
        self._connect = connect
        self.client: C | None = None

    def init(self, address: str | None = None) -> C:
        """Create (once) the default client the module-level functions use, and return it."""
        if self.client is None:
            self.client = self._connect(address)
        return self.client

    def get(self) -> C:
        """The default client; RuntimeError before ``init()``."""
        if self.client is None:
            raise RuntimeError(f"{self.module} is not initialized: call {self.module}.init() "
                               "first")
        return self.client

    def shutdown(self) -> None:
        """Close the default client."""
        if self.client is not None:
            self.client.close()
            self.client = None

    def rank(self) -> int:
        """This worker's rank."""
        return int(self.get().rank)

    def size(self) -> int:
        """Number of workers."""
        return int(self.get().size)
