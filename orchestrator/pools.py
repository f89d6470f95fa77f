"""The pool manager: one Ray actor per deployment that keeps every engine pool at strength.

What Ray already does, and this actor leaves to it (docs/design.md says why):
- restart a dead engine actor in its placement-group bundle (``max_restarts=-1``), so it
  comes back on the same node and cores, its children (vLLM's engine core and workers)
  reaped; the engine starts in the actor's constructor, so a restart is a whole engine;
- fail a pending call the moment the actor's process dies: every replica keeps one call
  (``EngineActor.watch``) pending as its death notice, no polling.

What it adds, because Ray cannot know it:
- a cheap periodic health call per replica (``health.period_s``/``timeout_s``): a live
  process whose engine core died or that hangs is killed so that Ray restarts it;
- routing membership: a replica leaves the routing table the moment it fails (a check, a
  death notice, or a call a router reports) and rejoins only once it answers its health
  call again and its NIXL handshakes with the other pool are pre-warmed; every ingress
  long-polls the table (``routing_table``);
- a dead engine's CPU-tier pins and slots released at once (``CpuTier.release_engine``);
- autoscaling between min_replicas and max_replicas on the load the engines report with
  every health call (``orchestrator.autoscale``), a shrinking pool draining its replica
  first so no request is cut off;
- the operator's view (``status``): each replica's state, node, pid, load and restarts.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine import EngineActor
from actors.logs import setup_logging
from actors.protocol import EngineInfo, EngineLoad, EngineRequest, Role
from orchestrator.autoscale import ScaleDecider
from orchestrator.config import TandemConfig, parse_config
from orchestrator.placement import EngineSlot, PortBases, SlotAllocator, actor_resources, binding_cores, placement_bundles
from orchestrator.protocol import (
    DeploymentStatus,
    EngineRef,
    PoolStatus,
    ReplicaState,
    ReplicaStatus,
    RoutingTable,
    pool_role,
)
from orchestrator.router import RequestTrace, Router
from orchestrator.specs import (
    dtype_mismatch,
    dtype_warning,
    engine_env,
    engine_spec,
    float32_notice,
    native_engine_args,
    niceness_warning,
)
from orchestrator.tier import NODE_CHECK_S, CpuTier

logger = logging.getLogger("tandem.pools")

# How long a replica's placement group may wait for resources before the start fails.
PLACEMENT_TIMEOUT_S = 120.0
# After a draining replica's last request, how long its KV may still be read by a decode
# engine (a prefill's answer is pulled just after it is sent).
DRAIN_GRACE_S = 2.0
# A handshake pre-warm (the first NIXL handshake takes seconds) that takes longer failed.
PREWARM_TIMEOUT_S = 120.0
# An engine's warm-up prompt (EngineActor.warm_up, one prompt of a chat turn's size) that takes
# longer failed: the engine is started again.
WARM_UP_TIMEOUT_S = 120.0
# Engine calls on the way down (vLLM's shutdown) are not waited on longer than this.
SHUTDOWN_TIMEOUT_S = 60.0
# A health check whose timeout fired this much later than due timed out because the pool
# manager itself stalled, not the engine.
LOOP_LAG_S = 2.0


class DeployError(RuntimeError):
    """The deployment could not start; the message says which part and why."""


def manager_name(app: str) -> str:
    """The named actor of a deployment's pool manager (how ingresses and `tandem status` find it)."""
    return f"{app}:pools"


def _warn_of_hosts(infos: Sequence[EngineInfo]) -> None:
    """Tell the operator what on these engines' hosts slows them (a lowered niceness, a half
    dtype computed without native instructions): at start for the first replicas, and for
    each replica that joins later, which a scale-up may place on another kind of node."""
    for warning in (niceness_warning(infos), dtype_warning(infos)):
        if warning:
            logger.warning(warning)


def _first_line(err: BaseException) -> str:
    """An error in one line an operator can act on: the cause of a failed Ray task, or for an
    actor whose constructor raised (vLLM's start-up), the last error line of that traceback."""
    if isinstance(err, RayTaskError) and err.cause is not None:
        err = err.cause
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if isinstance(err, RayActorError) and err.actor_init_failed:
        causes = [line for line in lines if "Error" in line.split(":", 1)[0] or "error," in line]
        if causes:
            return f"its engine failed to start: {causes[-1]}"
    return f"{type(err).__name__}: {lines[0] if lines else 'no detail'}"


def shrink_victim(active: list[Replica]) -> Replica:
    """The replica a shrinking pool gives up: one still starting (the newest), which serves
    nothing yet, else the healthy one with the fewest requests (the newest on a tie). Draining
    a serving replica while another only starts would leave the pool with none serving when
    a burst that asked for growth ends before the new replica is up."""
    starting = [r for r in active if r.state == "starting"]
    if starting:
        return max(starting, key=lambda r: int(r.engine_id.rsplit("-", 1)[1]))
    healthy = [r for r in active if r.state == "healthy"] or active
    return min(healthy, key=lambda r: (r.load.num_requests if r.load else 0, -int(r.engine_id.rsplit("-", 1)[1])))


@dataclass(eq=False)
class Replica:
    """One engine replica and what the manager knows of it."""

    engine_id: str
    role: Role
    pg: PlacementGroup
    slot: EngineSlot
    handle: Any = None
    state: ReplicaState = "starting"
    # The running incarnation's facts; None while it has no serving process.
    info: EngineInfo | None = None
    load: EngineLoad | None = None
    restarts: int = 0
    last_error: str | None = None
    # The incarnation that failed last: a call it still answers while dying is not a restart.
    failed_incarnation: str | None = None
    # Set when the pool shrinks: the replica drains and is stopped, never restarted.
    retiring: bool = False
    # A router reported a failed call: check now instead of at the next period.
    suspect: str | None = None
    missed_checks: int = 0
    # Whether the engine loads prefixes from / saves them to the CPU tier (routers weigh tier
    # hits and evictions by them).
    loads_tier: bool = False
    saves_tier: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def ref(self) -> EngineRef:
        assert self.info is not None
        i = self.info
        return EngineRef(self.engine_id, self.role, self.handle, i.incarnation, i.block_size, i.hash_algo, i.hash_seed,
                         i.node_id, self.loads_tier, i.num_blocks, i.stream_address, self.saves_tier, i.node_ip,
                         tuple(sorted(binding_cores(i.cpu_binding))) if i.cpu_binding else (),
                         tuple(sorted(i.cores)) if i.cores else ())

    def status(self) -> ReplicaStatus:
        live = self.info is not None
        return ReplicaStatus(
            id=self.engine_id,
            state=self.state,
            node=self.info.node_ip if self.info else self.slot.node_ip,
            pid=self.info.pid if live else None,
            outstanding=self.load.num_requests if self.load else 0,
            restarts=self.restarts,
            incarnation=self.info.incarnation if self.info else None,
            last_error=self.last_error,
            missed_checks=self.missed_checks,
            child_pids=self.info.child_pids if live else [],
            cores=self.info.cores if live else self.slot.pinned_to,
            cpu_binding=self.info.cpu_binding if live else self.slot.cpu_binding,
        )


@ray.remote(num_cpus=0)
class PoolManager:
    """Starts, watches, heals and scales the engine pools of one config."""

    def __init__(self, config: dict[str, Any]) -> None:
        setup_logging()
        self.cfg: TandemConfig = parse_config(config)
        ctx = ray.get_runtime_context()
        self.app = self.cfg.serve.app_name
        self.health = self.cfg.health
        self.tier = CpuTier(self.cfg, ctx.namespace) if self.cfg.cpu_tier.enabled else None
        self.allocator = SlotAllocator(
            PortBases(self.cfg.kv_transfer.side_channel_base_port, self.cfg.serve.token_path_base_port),
            bind_cores=self.cfg.device == "cpu" and self.cfg.cpu.bind_cores == "auto",
            model_source=self.cfg.model.source,
        )
        self.replicas: dict[str, Replica] = {}
        self._next_index: dict[str, int] = {role: 0 for role in self.cfg.pools}
        # Replicas being added (placement under way) per pool: they count as the pool's already.
        self._growing: dict[str, int] = {role: 0 for role in self.cfg.pools}
        self._deciders = {
            role: ScaleDecider(pool.autoscaling, pool.min_size, pool.max_size)
            for role, pool in self.cfg.pools.items()
            if pool.autoscaled
        }
        self._version = 0
        self._changed = asyncio.Event()
        # Pre-warming a replica and letting it join routing happen one replica at a time,
        # so two replicas coming up together still pre-warm their pair.
        self._joining = asyncio.Lock()
        # During the first start every failure is fatal (the deployment reports it); later a
        # replica that cannot start is left down and the rest serve.
        self._starting = True
        self._stopping = False
        # Background loops started once serving: the autoscaler, the tier's node check.
        self._loops: list[asyncio.Task[None]] = []
        self._vllm_sampling: asyncio.Future[Any] | None = None  # vllm.sampling_params, imported by start()
        # Whether the first replicas' CPU nodes lack native half precision: engines then get
        # float32 where the config names no dtype, those added later too (specs.native_engine_args).
        self._lacks_half_precision = False

    # ---- start ----

    async def start(self, timeout_s: float) -> list[EngineInfo]:
        """Place and start every pool's first replicas, pre-warm their handshakes, then
        watch them. Raises DeployError naming what failed."""
        t0 = time.perf_counter()
        # The pre-warm requests are built from vLLM's SamplingParams; importing vLLM takes
        # seconds of one core, so a thread does it while the engines start, not the event loop.
        self._vllm_sampling = asyncio.ensure_future(asyncio.to_thread(importlib.import_module, "vllm.sampling_params"))
        planned: list[tuple[Role, str, PlacementGroup]] = []
        for role, pool in self.cfg.pools.items():
            for _ in range(pool.replicas):
                engine_id = self._new_engine_id(role)  # type: ignore[arg-type]
                planned.append((role, engine_id, self._reserve(role, engine_id)))  # type: ignore[arg-type]
        waits = [asyncio.ensure_future(_resolve(pg.ready())) for _, _, pg in planned]
        _, pending = await asyncio.wait(waits, timeout=PLACEMENT_TIMEOUT_S)
        if pending:
            missing = [eid for (_, eid, _), w in zip(planned, waits) if w in pending]
            for _, _, pg in planned:
                remove_placement_group(pg)
            raise DeployError(
                f"could not reserve resources for engines {missing} within {PLACEMENT_TIMEOUT_S:.0f} s; the "
                f"cluster has {ray.available_resources()} available. Fix: lower num_cpus/num_gpus per replica or "
                "the replica counts, or add nodes"
            )
        nodes = [placement_group_table(pg)["bundles_to_node_id"][0] for _, _, pg in planned]
        roles = [role for role, _, _ in planned]
        slots = await self.allocator.place_all(nodes, roles, [self.cfg.pools[role].tensor_parallel_size for role in roles])
        if self.cfg.device == "cpu" and (lacking := self.allocator.lacking_half_precision()):
            self._lacks_half_precision = True
            if any(native_engine_args(args, True) != args for args in map(self.cfg.engine_args_for, self.cfg.pools)):
                logger.warning(float32_notice(lacking))
        if self.tier is not None:
            await asyncio.gather(*(self.tier.ensure_store(n) for n in sorted(set(nodes))))
        for (role, engine_id, pg), slot in zip(planned, slots):
            self._launch(self._replica(engine_id, role, pg, slot))
        await self._wait_until_serving(timeout_s)
        self._starting = False
        infos = [r.info for r in self.replicas.values() if r.info is not None]
        logger.info("%d engines up in %.1f s", len(infos), time.perf_counter() - t0)
        _warn_of_hosts(infos)
        if self._deciders:
            self._loops.append(asyncio.ensure_future(self._autoscale()))
        if self.tier is not None:
            self._loops.append(asyncio.ensure_future(self._check_tier_nodes()))
        return infos

    async def _wait_until_serving(self, timeout_s: float) -> None:
        """Until every replica is healthy; DeployError naming those that gave up or took too long."""
        deadline = time.monotonic() + timeout_s
        while not all(r.state == "healthy" for r in self.replicas.values()):
            given_up = [r for r in self.replicas.values() if r.task is not None and r.task.done()]
            if given_up or time.monotonic() > deadline:
                bad = given_up or [r for r in self.replicas.values() if r.state != "healthy"]
                raise DeployError("; ".join(f"engine {r.engine_id} did not start: {self._why_down(r, timeout_s)}" for r in bad))
            await asyncio.sleep(0.1)

    @staticmethod
    def _why_down(r: Replica, timeout_s: float) -> str:
        if r.task is not None and r.task.done() and not r.task.cancelled() and r.task.exception() is not None:
            return _first_line(r.task.exception())  # type: ignore[arg-type]
        return r.last_error or f"not serving within {timeout_s:.0f} s"

    def _new_engine_id(self, role: Role) -> str:
        i = self._next_index[role]
        self._next_index[role] = i + 1
        return f"{role}-{i}"

    def _reserve(self, role: Role, engine_id: str) -> PlacementGroup:
        bundles = placement_bundles(self.cfg.pools[role], self.cfg.device)
        return placement_group(bundles, strategy="STRICT_PACK", name=f"{self.app}-{engine_id}")

    def _replica(self, engine_id: str, role: Role, pg: PlacementGroup, slot: EngineSlot) -> Replica:
        save_from, load_into = self.cfg.tier_pools()
        on = self.cfg.cpu_tier.enabled
        return Replica(engine_id, role, pg, slot, loads_tier=on and role in load_into, saves_tier=on and role in save_from)

    def _launch(self, r: Replica) -> None:
        """Create the replica's engine actor in its placement group and supervise it."""
        self.replicas[r.engine_id] = r
        self._create_actor(r)
        r.task = asyncio.ensure_future(self._supervise(r))

    def _create_actor(self, r: Replica) -> None:
        pool = self.cfg.pools[r.role]
        tier = self.tier.settings(r.role, r.slot.node_id) if self.tier is not None else None
        spec = engine_spec(self.cfg, r.role, r.engine_id, r.slot, tier, self._lacks_half_precision)
        r.handle = EngineActor.options(  # type: ignore[attr-defined]
            name=f"{self.app}:{r.engine_id}",
            max_restarts=-1,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                r.pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            ),
            runtime_env={"env_vars": engine_env(self.cfg, r.slot)},
            **actor_resources(pool, self.cfg.device),
        ).remote(spec)
        logger.info("starting engine %s on node %s (side channel %s:%d, compute cores %s, other threads on %s)",
                    r.engine_id, r.slot.node_ip, r.slot.node_ip, r.slot.side_channel_port, r.slot.cpu_binding or "unbound",
                    r.slot.pinned_to or "any core")

    # ---- supervision ----

    async def _supervise(self, r: Replica) -> None:
        """A replica's life: come up, serve while healthy, restart on failure; until retired."""
        first = True
        while not (r.retiring or self._stopping):
            if not await self._bring_up(r, first):
                return
            first = False
            reason, dead = await self._watch(r)
            if r.retiring or self._stopping:
                return
            self._fail(r, reason, dead)

    def _fail(self, r: Replica, reason: str, dead: bool) -> None:
        """Take a failed replica out of routing, release what it held, and have Ray restart it."""
        logger.warning("engine %s failed: %s; it leaves routing and restarts", r.engine_id, reason)
        r.last_error = reason
        self._set_state(r, "unhealthy")
        if not dead:
            # A live process whose engine is dead or hung: kill it, Ray starts it anew.
            ray.kill(r.handle, no_restart=False)
        if self.tier is not None and r.info is not None:
            # Only once the process is gone: its slots are reused after a short quarantine.
            self.tier.release_engine(f"{r.engine_id}@{r.info.incarnation}")
        r.failed_incarnation = r.info.incarnation if r.info is not None else r.failed_incarnation
        r.info, r.load = None, None
        r.restarts += 1
        self._set_state(r, "restarting")

    async def _bring_up(self, r: Replica, first: bool) -> bool:
        """Wait for a new incarnation of the replica's engine to serve (recreating the actor if
        its start failed), pre-warm its handshakes and let it join routing. False: it cannot
        start and is left down."""
        self._set_state(r, "starting" if first else "restarting")
        failed_starts = 0
        while True:
            reason, replace = await self._await_new_incarnation(r)
            if reason is None:
                reason = await self._join(r)
                if reason is None:
                    return True
                self._fail(r, reason, dead=False)  # it came up, but not healthy: start it again
            if self._stopping or r.retiring:
                return False
            failed_starts += 1
            r.last_error = reason
            limit = 0 if self._starting else self.health.max_failed_starts
            if failed_starts > limit:
                logger.error("engine %s cannot start (%s); it stays down", r.engine_id, reason)
                self._set_state(r, "unhealthy")
                return False
            logger.warning("engine %s failed to start (%s); trying again (%d of %d)",
                           r.engine_id, reason, failed_starts, limit)
            await asyncio.sleep(min(30.0, 2.0**failed_starts))
            if replace:
                await self._replace_actor(r)

    async def _await_new_incarnation(self, r: Replica) -> tuple[str | None, bool]:
        """Until the replica's actor answers from a process started after its last failure
        (a killed process may still answer a call or two while it dies). Returns (why it did
        not come up, whether its actor is dead for good and must be replaced), or (None,
        False) once `r.info` is the new incarnation's."""
        deadline = time.monotonic() + self.health.start_timeout_s
        while time.monotonic() < deadline:
            try:
                info: EngineInfo = await asyncio.wait_for(r.handle.info.remote(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
            except ActorUnavailableError:
                await asyncio.sleep(0.2)  # the process is coming back; ask again
                continue
            except RayActorError as err:  # its constructor raised: Ray does not restart it
                return _first_line(err), True
            if info.incarnation != r.failed_incarnation:
                r.info = info
                return None, False
            await asyncio.sleep(0.2)
        ray.kill(r.handle, no_restart=False)
        return f"the engine did not come up within {self.health.start_timeout_s:.0f} s", False

    async def _replace_actor(self, r: Replica) -> None:
        """A new actor for a replica whose actor is dead for good, in the same placement group;
        placed anew when Ray moved the group to another node (its old node died)."""
        ray.kill(r.handle, no_restart=True)
        node = placement_group_table(r.pg)["bundles_to_node_id"].get(0)
        if node is not None and node != r.slot.node_id:
            self.allocator.release(r.slot)
            r.slot = await self.allocator.place_one(node, r.role, self.cfg.pools[r.role].tensor_parallel_size)
            if self.tier is not None:
                await self.tier.ensure_store(node)
        self._create_actor(r)

    async def _join(self, r: Replica) -> str | None:
        """Warm the replica's engine up, pre-warm its handshakes with the healthy replicas of the
        other pool, check its health once, and let it join routing. Returns why it could not,
        or None."""
        async with self._joining:
            if (self.cfg.disaggregated or self.cfg.cpu_tier.enabled) and r.info is not None:
                others = [p.info for p in self.replicas.values() if p is not r and p.info is not None]
                if (mismatch := dtype_mismatch(r.info, others)) is not None:
                    return mismatch
            try:
                took = await asyncio.wait_for(r.handle.warm_up.remote(), WARM_UP_TIMEOUT_S)
            except asyncio.TimeoutError:
                return f"its warm-up prompt took over {WARM_UP_TIMEOUT_S:.0f} s"
            except RayError as err:
                return f"its warm-up prompt failed: {_first_line(err)}"
            logger.info("engine %s (%s) warmed up in %.2f s", r.engine_id, r.role, took)
            if self.cfg.disaggregated and self.cfg.kv_transfer.prewarm_handshakes:
                other = "decode" if r.role == "prefill" else "prefill"
                for peer in [p for p in self.replicas.values() if p.role == other and p.state == "healthy"]:
                    pair = (r, peer) if r.role == "prefill" else (peer, r)
                    try:
                        error = await asyncio.wait_for(self._prewarm(*pair), PREWARM_TIMEOUT_S)
                    except asyncio.TimeoutError:
                        error = f"handshake pre-warm {pair[0].engine_id} -> {pair[1].engine_id} took over {PREWARM_TIMEOUT_S:.0f} s"
                    if error is not None:
                        if self._starting:
                            return error
                        # The peer may be the sick one; the handshake happens on first use.
                        logger.warning(error)
            try:
                r.load = await asyncio.wait_for(r.handle.health.remote(), self.health.timeout_s)
            except (RayError, asyncio.TimeoutError) as err:
                return f"its health check after start failed: {_first_line(err)}"
            logger.info("engine %s (%s) serving: pid %d on %s, incarnation %s",
                        r.engine_id, r.role, r.info.pid, r.info.node_ip, r.info.incarnation)  # type: ignore[union-attr]
            if not self._starting:  # the first replicas' are told together, once all serve
                _warn_of_hosts([r.info])  # type: ignore[list-item]
            self._set_state(r, "healthy")
            return None

    async def _prewarm(self, p: Replica, d: Replica) -> str | None:
        """Send one request through a prefill -> decode pair so the NIXL handshake (seconds)
        happens now, not on a user's request. Returns what went wrong, or None."""
        assert p.info is not None and d.info is not None and self._vllm_sampling is not None
        SamplingParams = (await self._vllm_sampling).SamplingParams

        # Both engines are pinned: nothing is routed, so no cache view.
        router = Router([p.ref(), d.ref()], msgspec.structs.replace(self.cfg.routing, policy="round_robin", disaggregation="always"))
        # Long enough to fill at least one KV block, so real bytes move.
        n = min(p.info.block_size + 1, p.info.max_model_len - 2)
        trace = RequestTrace()
        t0 = time.perf_counter()
        try:
            async for _ in router.generate(
                EngineRequest(
                    f"prewarm-{p.engine_id}-{p.info.incarnation}-{d.engine_id}-{d.info.incarnation}",
                    list(range(10, 10 + n)),
                    SamplingParams(max_tokens=1, temperature=0.0),
                ),
                trace,
                prefill_engine=p.ref(),
                decode_engine=d.ref(),
            ):
                pass
        except Exception as err:
            return f"handshake pre-warm {p.engine_id} -> {d.engine_id} failed: {_first_line(err)}"
        finally:
            await router.close()
        if trace.fallback:
            return (
                f"handshake pre-warm {p.engine_id} -> {d.engine_id} failed ({trace.fallback}); check the "
                "kv_transfer settings and that the side-channel ports are reachable between nodes"
            )
        logger.info("pre-warmed the %s -> %s handshake in %.1f s", p.engine_id, d.engine_id, time.perf_counter() - t0)
        return None

    async def _watch(self, r: Replica) -> tuple[str, bool]:
        """Health-check the replica every period until it fails; returns (why, whether its
        process is dead). Ray's death notice (the pending `watch` call) cuts the wait short."""
        notice = asyncio.ensure_future(_resolve(r.handle.watch.remote()))
        try:
            while True:
                waker = asyncio.ensure_future(r.wake.wait())
                done, _ = await asyncio.wait({notice, waker}, timeout=self.health.period_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                waker.cancel()
                r.wake.clear()
                if notice in done:
                    err = notice.exception()
                    return f"its process died ({_first_line(err) if err else 'the watch call returned'})", True
                suspect, r.suspect = r.suspect, None
                try:
                    if not await self._answers(r):
                        return f"its health check went unanswered twice, {self.health.timeout_s:.0f} s each", False
                except RayActorError as err:
                    return f"its process died ({_first_line(err)})", True
                except RayTaskError as err:
                    return f"its health check failed ({_first_line(err)})", False
                if r.state == "unhealthy" and not r.retiring:
                    logger.info("engine %s answers its health check after %s; back in routing", r.engine_id,
                                suspect or "a missed one")
                    self._set_state(r, "healthy")
        finally:
            notice.cancel()

    async def _answers(self, r: Replica) -> bool:
        """One health check, confirmed before a replica is condemned: after a call that went
        unanswered for `timeout_s` the replica leaves routing (unless it is the last in its
        pool's routing: a slow engine serves better than none) and is asked once more. One
        stall is more often the host than the engine: a 2-core run saw all three engines
        miss the same check and all three restarted, failing 64 of 96 requests. A check that
        timed out only because this actor's own loop ran late is not counted at all."""
        for attempt in (1, 2):
            t0 = time.monotonic()
            try:
                r.load = await asyncio.wait_for(r.handle.health.remote(), self.health.timeout_s)
                return True
            except asyncio.TimeoutError:
                late = time.monotonic() - t0 - self.health.timeout_s
                if late > LOOP_LAG_S:
                    logger.warning("the pool manager ran %.1f s late; engine %s's health check is not counted",
                                   late, r.engine_id)
                    return True
                r.missed_checks += 1
            if attempt == 1:
                others = [o for o in self.replicas.values() if o.role == r.role and o is not r and o.state == "healthy"]
                if others and r.state == "healthy":
                    self._set_state(r, "unhealthy")
                logger.warning("engine %s did not answer its health check within %.0f s; %s, checking once more",
                               r.engine_id, self.health.timeout_s,
                               "out of routing" if r.state == "unhealthy" else "kept in routing as its pool's last")
        return False

    async def report_failure(self, engine_id: str, incarnation: str, cause: str, engine_down: bool) -> None:
        """A router's call to this engine failed. A dead or unreachable process leaves routing
        at once; either way it is health-checked now."""
        r = self.replicas.get(engine_id)
        if r is None or r.info is None or r.info.incarnation != incarnation or r.state != "healthy":
            return
        if engine_down:
            logger.warning("engine %s: a router's call failed (%s); out of routing until it answers", engine_id, cause)
            self._set_state(r, "unhealthy")
        r.suspect = cause
        r.wake.set()

    # ---- routing table ----

    def _set_state(self, r: Replica, state: ReplicaState) -> None:
        in_routing = r.state == "healthy"
        r.state = state
        if in_routing != (state == "healthy"):
            self._version += 1
            self._changed.set()
            self._changed = asyncio.Event()

    def _table(self) -> RoutingTable:
        return RoutingTable(self._version, [r.ref() for r in self.replicas.values() if r.state == "healthy"])

    async def routing_table(self, after_version: int = -1, timeout_s: float = 30.0) -> RoutingTable:
        """The engines requests may go to; waits up to `timeout_s` for a version newer than
        `after_version` (a long poll: ingresses hear of a change at once)."""
        if self._version <= after_version:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self._table()

    # ---- autoscaling ----

    async def _autoscale(self) -> None:
        """Every health period, move each autoscaled pool one replica toward what its load asks."""
        while not self._stopping:
            await asyncio.sleep(self.health.period_s)
            for role, decider in self._deciders.items():
                pool = self.cfg.pools[role]
                active = [r for r in self.replicas.values() if r.role == role and not r.retiring]
                per_replica = [
                    (r.load.mean_tokens if pool.autoscaling.metric == "outstanding_tokens" else r.load.mean_requests)
                    for r in active if r.load is not None and r.state == "healthy"
                ]
                size = len(active) + self._growing[role]
                target = decider.decide(time.monotonic(), sum(per_replica), size)
                if target > size:
                    logger.info("pool %s: load %.1f over %d replicas asks for %d; adding one",
                                pool_role(role), sum(per_replica), size, decider.wanted(sum(per_replica)))  # type: ignore[arg-type]
                    asyncio.ensure_future(self._grow(role))  # type: ignore[arg-type]
                elif target < size and active:
                    victim = shrink_victim(active)
                    logger.info("pool %s: load %.1f asks for %d replicas; %s %s",
                                pool_role(role), sum(per_replica), target,  # type: ignore[arg-type]
                                "stopping the not yet serving" if victim.state == "starting" else "draining",
                                victim.engine_id)
                    asyncio.ensure_future(self._retire(victim))

    async def _check_tier_nodes(self) -> None:
        """Every NODE_CHECK_S, forget the CPU tier stores of nodes that left the cluster."""
        assert self.tier is not None
        while not self._stopping:
            await asyncio.sleep(NODE_CHECK_S)
            try:
                await self.tier.forget_lost_nodes()
            except Exception as err:  # the GCS is briefly unreachable: the next check tries again
                logger.warning("could not check the nodes of the CPU tier's stores: %s", err)

    async def _grow(self, role: Role) -> None:
        self._growing[role] += 1
        try:
            engine_id = self._new_engine_id(role)
            pg = self._reserve(role, engine_id)
            try:
                await asyncio.wait_for(pg.ready(), PLACEMENT_TIMEOUT_S)
            except asyncio.TimeoutError:
                remove_placement_group(pg)
                logger.warning("pool %s cannot grow: no resources for another replica within %.0f s (%s available)",
                               pool_role(role), PLACEMENT_TIMEOUT_S, ray.available_resources())
                return
            node = placement_group_table(pg)["bundles_to_node_id"][0]
            slot = await self.allocator.place_one(node, role, self.cfg.pools[role].tensor_parallel_size)
            if self.tier is not None:
                await self.tier.ensure_store(node)
            self._launch(self._replica(engine_id, role, pg, slot))
        finally:
            self._growing[role] -= 1

    async def _retire(self, r: Replica) -> None:
        """Drain a replica (out of routing, its requests finish), then stop it for good; one
        still starting never served and holds no KV, so it is stopped at once."""
        r.retiring = True
        if r.state == "starting":
            await self._stop_replica(r)
            logger.info("engine %s stopped before it served", r.engine_id)
            return
        self._set_state(r, "draining")
        deadline = time.monotonic() + self.cfg.pools[r.role].autoscaling.drain_timeout_s
        watched = r.task is not None and not r.task.done()  # its health calls keep r.load fresh
        while watched and r.info is not None and (r.load is None or r.load.num_requests > 0) and time.monotonic() < deadline:
            await asyncio.sleep(self.health.period_s)
            watched = r.task is not None and not r.task.done()
        if r.load is not None and r.load.num_requests > 0:
            logger.warning("engine %s still had %d requests after draining for %.0f s; stopping it anyway",
                           r.engine_id, r.load.num_requests, self.cfg.pools[r.role].autoscaling.drain_timeout_s)
        await asyncio.sleep(DRAIN_GRACE_S)
        await self._stop_replica(r)
        logger.info("engine %s drained and stopped", r.engine_id)

    async def _stop_replica(self, r: Replica) -> None:
        if r.task is not None:
            r.task.cancel()
        if r.info is not None:  # a serving process: let vLLM stop its engine core first
            try:
                await asyncio.wait_for(r.handle.shutdown.remote(), SHUTDOWN_TIMEOUT_S)
            except (RayError, asyncio.TimeoutError):
                pass  # dead or stuck: the kill below ends it either way
        ray.kill(r.handle, no_restart=True)
        remove_placement_group(r.pg)
        self.allocator.release(r.slot)
        if self.tier is not None and r.info is not None:
            self.tier.release_engine(f"{r.engine_id}@{r.info.incarnation}")
        self.replicas.pop(r.engine_id, None)

    # ---- operator view and teardown ----

    async def status(self) -> DeploymentStatus:
        pools = []
        for role, pool in self.cfg.pools.items():
            replicas = sorted((r for r in self.replicas.values() if r.role == role),
                              key=lambda r: int(r.engine_id.rsplit("-", 1)[1]))
            pools.append(PoolStatus(pool_role(role), pool.min_size, pool.max_size, [r.status() for r in replicas]))  # type: ignore[arg-type]
        tier = await self.tier.status() if self.tier is not None else None
        return DeploymentStatus(self.app, pools, tier)

    def tier_actors(self) -> tuple[Any, dict[str, Any]]:
        """The tier's index and stores by node id (tests and benchmarks read them)."""
        if self.tier is None:
            return None, {}
        return self.tier.index, dict(self.tier.stores)

    async def stop(self) -> None:
        """Stop every engine (vLLM's processes first), free the reservations, stop the tier."""
        self._stopping = True
        for loop in self._loops:
            loop.cancel()
        replicas = list(self.replicas.values())
        await asyncio.gather(*(self._stop_replica(r) for r in replicas))
        logger.info("stopped %d engines", len(replicas))
        if self.tier is not None:
            self.tier.stop()


async def _resolve(ref: Any) -> Any:
    return await ref
