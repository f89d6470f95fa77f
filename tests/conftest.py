"""Shared fixtures: the tiny model, a loopback Ray per test module, free ports.

Engine-backed fixtures live in the modules that use them and are module-scoped, so at
most a few tiny-model engines are alive at once (each takes 2-3 GB).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.scenarios import free_ports

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive TCP ports free on 127.0.0.1 now, none handed out before
    (benchmarks.scenarios.free_ports: outside the ephemeral range, where Ray's own outgoing
    connections would race a server for it)."""
    return free_ports(count)


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
