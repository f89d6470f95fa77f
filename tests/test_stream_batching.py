"""How the engine actor regroups vLLM's streamed outputs (actors.engine.batched), on a
synthetic stream with known timing; the real engine's batching is tested in test_serving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import pytest

from actors.engine import batched


class Source:
    """An async stream of `values` (0..n-1 by default), `gap_s` apart, that can fail after
    `fail_after` items and records whether it was closed before its end."""

    def __init__(self, n: int, gap_s: float = 0.0, fail_after: int | None = None, values: list | None = None) -> None:
        self.values = values if values is not None else list(range(n))
        self.gap_s, self.fail_after = gap_s, fail_after
        self.closed_early = False

    async def items(self) -> AsyncGenerator:
        done = False
        try:
            for i, value in enumerate(self.values):
                if i == self.fail_after:
                    raise ValueError(f"stream failed after {i} items")
                if i:
                    await asyncio.sleep(self.gap_s)
                yield value
            done = True
        finally:
            self.closed_early = not done


async def collect(source: Source, interval_s: float) -> list[list[int]]:
    return [group async for group in batched(source.items(), interval_s)]


def test_no_interval_passes_every_item_on_its_own() -> None:
    assert asyncio.run(collect(Source(5), 0.0)) == [[0], [1], [2], [3], [4]]


def test_first_item_and_end_of_stream_do_not_wait_for_the_interval() -> None:
    interval_s = 60.0
    t0 = time.perf_counter()
    groups = asyncio.run(collect(Source(6, gap_s=0.01), interval_s))
    assert groups == [[0], [1, 2, 3, 4, 5]]
    assert time.perf_counter() - t0 < interval_s


def test_groups_leave_at_most_once_per_interval_and_keep_every_item_in_order() -> None:
    interval_s, n = 0.05, 30

    async def run() -> tuple[list[list[int]], list[float]]:
        groups, times = [], []
        async for group in batched(Source(n, gap_s=0.01).items(), interval_s):
            groups.append(group)
            times.append(time.perf_counter())
        return groups, times

    groups, times = asyncio.run(run())
    assert [i for g in groups for i in g] == list(range(n))
    assert groups[0] == [0]
    # Between groups that did not end the stream, at least one interval passes.
    assert all(b - a >= interval_s * 0.99 for a, b in zip(times[:-2], times[1:-1]))
    assert max(len(g) for g in groups) > 1


def test_items_leave_at_once_until_something_visible_has_left() -> None:
    """A first token that decodes to no text (part of a UTF-8 character) must not hold the
    first text back for a whole interval: the client's time to first token counts text."""
    interval_s, texts = 60.0, ["", "", "a", "b", "", "c", "d"]
    t0 = time.perf_counter()

    async def run() -> list[list[str]]:
        return [g async for g in batched(Source(0, gap_s=0.05, values=texts).items(), interval_s, visible=bool)]

    assert asyncio.run(run()) == [[""], [""], ["a"], ["b", "", "c", "d"]]
    assert time.perf_counter() - t0 < interval_s


@pytest.mark.parametrize("interval_s", [0.0, 0.05])
def test_a_failing_stream_raises_after_its_items(interval_s: float) -> None:
    seen: list[int] = []

    async def run() -> None:
        async for group in batched(Source(10, gap_s=0.01, fail_after=3).items(), interval_s):
            seen.extend(group)

    with pytest.raises(ValueError, match="after 3 items"):
        asyncio.run(run())
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("interval_s", [0.0, 0.05])
def test_closing_the_groups_closes_the_source(interval_s: float) -> None:
    """vLLM aborts a request when its generator is closed, so a consumer that stops early
    (a client gone) must close the source at once, not leave it to the garbage collector."""
    source = Source(1000, gap_s=0.01)

    async def run() -> tuple[list[int], bool]:
        groups = batched(source.items(), interval_s)
        first = await anext(groups)
        await groups.aclose()
        return first, source.closed_early  # before asyncio.run closes leftover generators

    assert asyncio.run(run()) == ([0], True)
