"""`tandem status`: each pool and replica of a running deployment, as an operator reads it.

Joins the cluster as a short-lived driver, asks the deployment's pool manager, prints a
table (or the JSON of orchestrator.protocol.DeploymentStatus with --json) and leaves.
"""

from __future__ import annotations

import json
import logging

import msgspec

from orchestrator.protocol import DeploymentStatus


class StatusError(RuntimeError):
    """No deployment answered; the message says where it looked and what to try."""


def fetch_status(address: str, app: str, timeout_s: float = 30.0) -> DeploymentStatus:
    import ray

    from orchestrator.cluster import NAMESPACE, join_ray
    from orchestrator.pools import manager_name

    try:
        join_ray(address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
    except ConnectionError as err:
        raise StatusError(f"{err}; pass the address `tandem serve` printed with --address") from None
    try:
        try:
            manager = ray.get_actor(manager_name(app), namespace=NAMESPACE)
        except ValueError:
            raise StatusError(
                f"no Tandem deployment named {app!r} runs on the Ray cluster at {address!r}; "
                "pass its serve.app_name with --app"
            ) from None
        return ray.get(manager.status.remote(), timeout=timeout_s)
    finally:
        ray.shutdown()


def to_json(status: DeploymentStatus) -> str:
    return json.dumps(msgspec.to_builtins(status), indent=2)


def render(status: DeploymentStatus) -> str:
    """A plain table per pool, then the CPU tier's fill."""
    lines = [f"deployment {status.app}: {status.health}"]
    for pool in status.pools:
        lines.append(
            f"\n{pool.role} pool: {pool.num_healthy}/{len(pool.replicas)} healthy "
            f"(min {pool.min_replicas}, max {pool.max_replicas})"
        )
        rows = [("replica", "state", "node", "pid", "outstanding", "restarts", "last error")]
        for r in pool.replicas:
            rows.append((r.id, r.state, r.node or "-", str(r.pid or "-"), str(r.outstanding), str(r.restarts), r.last_error or ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    tier = status.cpu_tier
    if tier is None:
        lines.append("\nCPU tier: off or not answering")
    else:
        fill = tier.blocks / tier.capacity if tier.capacity else 0.0
        lines.append(f"\nCPU tier: {tier.blocks}/{tier.capacity} blocks ({fill:.0%}), {tier.pinned} pinned, "
                     f"{tier.open_grants} slots being written")
        lines.append(f"  since the index started: {tier.lookups} lookups found {tier.hit_blocks} blocks, "
                     f"{tier.saved_blocks} saved, {tier.evicted_blocks} evicted, {tier.forgotten_blocks} lost with a store, "
                     f"{tier.expired_pins + tier.expired_grants} leases expired")
        for store, (held, cap) in sorted(tier.stores.items()):
            lines.append(f"  store {store}: {held}/{cap}")
    return "\n".join(lines)
