"""Every NIXL agent Tandem makes: the P/D connector's in each engine, and the CPU tier's
parties (the per-node store, an engine's tier worker).

One builder because the same two NIXL defaults need overriding everywhere. NIXL's Python API
(``nixl_agent``) hard-codes ``pthrDelay = 0``: a UCX progress thread, where one is wanted,
busy-polls a whole core (PLATFORM.md). The delay is handed to the binding that this one call
constructs the agent through (`_agent_class`): no module is patched, so any other agent made
in the process, vLLM's included, is untouched. It lives with the actors, below the
connectors (docs/design.md, "Layers").
"""

from __future__ import annotations

import importlib
import types
from functools import cache
from typing import Any, Literal

SyncMode = Literal["none", "strict", "rw"]
# How long a UCX progress thread sleeps between polls: transfers still complete in
# microseconds while the thread costs a few percent of a core instead of all of it.
PROGRESS_DELAY_US = 200
# The environment of every process whose agent reads GPU memory (disaggregated GPU engines,
# benchmarks.nixl_micro's GPU paths). UCX turns off reads over cuda_ipc unless NVML reports
# NVLinks, and a NIXL READ of another process's GPU blocks then runs as a software read over
# TCP: 583 ms instead of 46-64 ms for a 2k-token 8B prompt on one H200 (docs/performance.md,
# "The KV transfer on an H200"). Where NVLinks are seen, UCX allows the reads already.
GPU_UCX_ENV: dict[str, str] = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def agent_config_kwargs(
    progress_thread: bool, backends: list[str], num_threads: int = 0, sync_mode: SyncMode = "none",
    capture_telemetry: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of ``nixl_agent_config`` (sync mode as a name). ``num_threads`` only
    applies to the UCX backend's thread pool; other backends keep NIXL's defaults, as vLLM
    does."""
    kwargs: dict[str, Any] = {
        "enable_prog_thread": progress_thread,
        "capture_telemetry": capture_telemetry,
        "backends": list(backends),
        "sync_mode": sync_mode,
    }
    if backends == ["UCX"]:
        kwargs["num_threads"] = num_threads
    return kwargs


def make_nixl_agent(
    name: str,
    progress_thread: bool,
    backends: list[str] | None = None,
    num_threads: int = 0,
    sync_mode: SyncMode = "none",
    capture_telemetry: bool = False,
    api_module: str = "nixl._api",
    progress_delay_us: int = PROGRESS_DELAY_US,
) -> Any:
    """A NIXL agent; a progress thread, if asked for, sleeps `progress_delay_us` between polls.
    `sync_mode` "none" suits an agent one thread calls; vLLM's connector calls its agent from
    its handshake thread too ("strict" or "rw"). `api_module` is the NIXL Python API to use
    (the connector passes the one vLLM picked for the platform)."""
    api = importlib.import_module(api_module)
    kwargs = agent_config_kwargs(progress_thread, backends or ["UCX"], num_threads, sync_mode, capture_telemetry)
    kwargs["sync_mode"] = {
        "none": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        "strict": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        "rw": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    }[sync_mode]
    cls = _agent_class(api_module, progress_delay_us) if progress_thread else api.nixl_agent
    return cls(name, api.nixl_agent_config(**kwargs))


class _DelayingBinding:
    """The NIXL binding module, except that the agents it constructs get a progress delay."""

    def __init__(self, binding: Any, delay_us: int) -> None:
        self._binding = binding
        self._delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def nixlAgent(self, name: str, cfg: Any) -> Any:  # noqa: N802 (the binding's name)
        cfg.pthrDelay = self._delay_us
        return self._binding.nixlAgent(name, cfg)


@cache
def _agent_class(api_module: str, delay_us: int) -> type:
    """A subclass of the API's ``nixl_agent`` whose constructor is the API's own, run
    against a binding that sets the progress delay on the agent it builds."""
    base = importlib.import_module(api_module).nixl_agent
    init = base.__init__
    scope = {**init.__globals__, "nixlBind": _DelayingBinding(init.__globals__["nixlBind"], delay_us)}
    own_init = types.FunctionType(init.__code__, scope, init.__name__, init.__defaults__, init.__closure__)
    own_init.__kwdefaults__ = init.__kwdefaults__
    return type(f"{base.__name__}_with_progress_delay", (base,), {"__init__": own_init})
