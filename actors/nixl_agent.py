"""The NIXL agent of a CPU-tier party (the tier's store, an engine's tier worker).

It lives with the actors, which the connectors sit above (docs/design.md, "Layers"), so the
store and the engine-side worker build theirs in one place.
"""

from __future__ import annotations

import sys
from typing import Any


def make_nixl_agent(name: str, progress_thread: bool, progress_delay_us: int = 200) -> Any:
    """A NIXL agent whose UCX progress thread (if any) sleeps `progress_delay_us` between
    polls. The nixl Python API hard-codes ``pthrDelay = 0``, a busy loop that costs a whole
    core per agent (see PLATFORM.md); the delay is applied by wrapping the binding's agent
    constructor for the duration of this call."""
    from nixl._api import nixl_agent, nixl_agent_config

    bind = sys.modules[nixl_agent.__module__].nixlBind
    real = bind.nixlAgent

    def with_delay(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = progress_delay_us
        return real(agent_name, cfg)

    bind.nixlAgent = with_delay
    try:
        return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
    finally:
        bind.nixlAgent = real
