"""Joining a Ray cluster, or starting an embedded one for a single machine."""

from __future__ import annotations

import os

import ray

from orchestrator.config import TandemConfig


def init_ray(cfg: TandemConfig, address: str | None) -> bool:
    """Join `address` (or RAY_ADDRESS), else start an embedded single-machine Ray; True if embedded."""
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address or os.environ["RAY_ADDRESS"], log_to_driver=True)
        return False
    need = sum(p.num_cpus * p.replicas for p in cfg.pools.values())
    # Embedded Ray serves one machine: always a new instance ("local", never a `ray start`
    # cluster that happens to run here), asked for the local address (Ray 2.60 resolves it
    # to the machine's own interface); logical CPUs cover every engine.
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, int(need) + 1),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
    )
    return True
