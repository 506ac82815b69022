"""asyncio helpers the daemon's services share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any


async def gather_all(*aws: Awaitable[Any]) -> list[Any]:
    """Like asyncio.gather, but when one fails the others are cancelled and waited for.

    A send still reading the worker's arena slot must end before the op reports its failure
    (after which the worker may reuse the slot). A lone awaitable is awaited in place (no task).
    """
    if len(aws) == 1:
        return [await aws[0]]
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class TaskSet:
    """Background tasks kept referenced until they end (asyncio holds only weak references)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
