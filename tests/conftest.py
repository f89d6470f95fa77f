"""Shared fixtures: the tiny model, a loopback Ray per test module, free ports.

Engine-backed fixtures live in the modules that use them and are module-scoped, so at
most a few tiny-model engines are alive at once (each takes 2-3 GB).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from benchmarks.scenarios import free_ports

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1 now, none handed out before
    (benchmarks.scenarios.free_ports: outside the ephemeral range, where Ray's own outgoing
    connections would race a server for it)."""
    return free_ports(count)


@contextmanager
def together(*servers: AbstractContextManager[Any]) -> Iterator[tuple[Any, ...]]:
    """Enter `servers` side by side (the first in this thread, the rest in threads of their
    own) and yield what each yields: a module that needs a deployment and a reference server
    waits for their start-ups at once, not one after the other, which on a host of few cores
    still overlaps each one's waits (imports, Ray's scheduling, the plain server's readiness
    poll) with the other's work. Exits them in reverse order; when one fails to start, those
    that started are exited before its error is raised."""
    values: list[Any] = []
    errors: list[BaseException] = []
    with ExitStack() as stack:
        with ThreadPoolExecutor(max(1, len(servers) - 1)) as pool:
            rest = [pool.submit(s.__enter__) for s in servers[1:]]
            for server, enter in zip(servers, [servers[0].__enter__, *(f.result for f in rest)]):
                try:
                    values.append(enter())
                except BaseException as err:  # wait for the others, to stop them before raising
                    errors.append(err)
                else:
                    stack.push(server.__exit__)
        if errors:
            raise errors[0]
        yield tuple(values)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from orchestrator.tiny_model import prepare_tiny_model

    return prepare_tiny_model()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    """An embedded single-node Ray bound to loopback, for one test module."""
    import ray

    from orchestrator.cluster import start_embedded_ray

    # The same embedded Ray `tandem serve` starts: a fresh instance, never a Ray already
    # running on this machine (another user's `ray start`, another test run).
    start_embedded_ray(8, log_to_driver=False)
    try:
        yield
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
