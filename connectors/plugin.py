"""Tandem's vLLM general plugin (entry point `vllm.general_plugins`). vLLM loads it in each of
its processes, in an engine core before the executor starts its workers; it acts only in the
engine core of an engine Tandem started (`ENGINE_MARK` in the environment, set by the pool
manager). Everywhere else, a plain `vllm serve` in the same environment included, it does
nothing.

What it does there: the engine core forks its workers instead of spawning them. vLLM spawns
an engine core started inside a Ray actor (a Ray worker must not be forked), and the engine
core passes that choice on to its own workers through the environment, although it is a plain
process outside Ray that has not initialised CUDA or run a parallel region: the state in which
vLLM forks its workers outside Ray. A spawned worker imports torch and vLLM again, 10-15 s of a
core on every engine start and restart here (docs/startup.md); a forked one has them loaded.
"""

from __future__ import annotations

import os
import sys

from connectors.config import ENGINE_MARK

START_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"


def register() -> None:
    """Make this process fork its workers if it is a Tandem engine's engine core."""
    if os.environ.get(ENGINE_MARK) == "1" and not _in_ray():
        os.environ[START_METHOD] = "fork"


def _in_ray() -> bool:
    """Whether this process joined Ray (the engine actor itself), so must keep spawning.
    (Ray is imported there already; importing it here would cost an engine core a second.)"""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()
