"""Work an ingress replica starts from inside a request that must not end with it: an abort
and the release of KV it hands back, a failure report, the followers of the routing table and
of the engines' caches (started with the first request).

A request's task is a poor home for such work. Ray records the caller of an async actor's
Ray call in a context variable, and a Serve request that is cancelled (its client left) is
cancelled with `ray.cancel(recursive=True)`, which cancels every call that request's context
has in flight, even those made by tasks it started (ray-project/ray#52476: Serve's own
long-poll client starts in an empty context for this reason). And Serve and Starlette run a
request in an anyio cancel scope, which cancels every await in the cancelled task again,
`finally` blocks included: an abort awaited there is dropped as it starts. A task started
here runs in an empty context, so neither reaches it."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# asyncio keeps only weak references to tasks: these are held until they end.
_RUNNING: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Run `coro` in a task of its own, outside the current request."""
    task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return task


async def outlive(coro: Coroutine[Any, Any, T]) -> T:
    """Await `coro` run outside the current request: a caller cancelled meanwhile stops
    waiting, and `coro` runs on to its end."""
    return await asyncio.shield(spawn(coro))
