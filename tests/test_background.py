"""orchestrator.background: work a request starts that must outlive it (an abort, a failure
report, the routing followers) runs on when the request is cancelled, by Ray's recursive
cancellation of a Serve request whose client left or by an anyio cancel scope."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import anyio
import pytest
import ray

from orchestrator.background import outlive, spawn


@ray.remote
class Target:
    """An async actor, like an engine: a call in flight here is what Ray cancels."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.done: list[str] = []

    async def hold(self, tag: str, seconds: float) -> None:
        self.started.append(tag)
        await asyncio.sleep(seconds)
        self.done.append(tag)

    def seen(self) -> tuple[list[str], list[str]]:
        return self.started, self.done


@ray.remote
class Replica:
    """An ingress replica's request: it starts a Ray call, then waits until it is cancelled."""

    def __init__(self, target: ray.actor.ActorHandle) -> None:
        self.target = target

    async def request(self, tag: str, detached: bool) -> None:
        call = self._call(tag)
        if detached:
            spawn(call)
        else:  # a task of the request's own, as asyncio makes it: the request's context
            asyncio.ensure_future(call)
        await asyncio.sleep(60)

    async def _call(self, tag: str) -> None:
        await self.target.hold.remote(tag, 1.0)


@pytest.fixture(scope="module")
def actors(ray_local: None) -> Iterator[tuple[ray.actor.ActorHandle, ray.actor.ActorHandle]]:
    target = Target.remote()
    replica = Replica.remote(target)
    ray.get([target.__ray_ready__.remote(), replica.__ray_ready__.remote()])
    yield target, replica
    ray.kill(replica)
    ray.kill(target)


def _cancel_while_in_flight(target: ray.actor.ActorHandle, replica: ray.actor.ActorHandle,
                            tag: str, detached: bool) -> bool:
    """Start a request whose call reaches the target, cancel the request as Serve does for a
    client that left, and say whether the call ran to its end."""
    ref = replica.request.remote(tag, detached)
    deadline = time.monotonic() + 30
    while tag not in ray.get(target.seen.remote())[0]:
        assert time.monotonic() < deadline, "the request's call never reached the target"
        time.sleep(0.05)
    ray.cancel(ref)  # recursive, as Serve's proxy cancels a request
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=30)
    time.sleep(1.5)  # the call's own second, and some
    return tag in ray.get(target.seen.remote())[1]


def test_a_call_started_outside_the_request_survives_its_cancellation(actors) -> None:
    target, replica = actors
    assert _cancel_while_in_flight(target, replica, "spawned", detached=True)


def test_a_call_made_in_the_requests_context_dies_with_it(actors) -> None:
    """The control: what `spawn` protects against does happen (were it to stop happening in
    a later Ray, the module's reason to be would be gone)."""
    target, replica = actors
    assert not _cancel_while_in_flight(target, replica, "in-context", detached=False)


def test_outlive_runs_its_work_to_the_end_when_an_anyio_scope_cancels_the_caller() -> None:
    """Serve and Starlette cancel a request with an anyio scope, which cancels every later
    await of the task, in `finally` too: the abort awaited there still runs."""
    finished: list[str] = []

    async def abort() -> str:
        await asyncio.sleep(0.2)
        finished.append("abort")
        return "held"

    async def request() -> None:
        with anyio.CancelScope() as scope:
            try:
                scope.cancel()
                await asyncio.sleep(10)
            finally:
                with pytest.raises(asyncio.CancelledError):
                    await outlive(abort())  # cancelled at once: the caller stops waiting
        await asyncio.sleep(0.5)

    asyncio.run(request())
    assert finished == ["abort"]


def test_outlive_returns_the_result_to_a_caller_that_is_not_cancelled() -> None:
    async def work() -> int:
        await asyncio.sleep(0.01)
        return 7

    async def caller() -> int:
        return await outlive(work())

    assert asyncio.run(caller()) == 7
