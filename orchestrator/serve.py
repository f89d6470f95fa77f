"""The Ray Serve app: vLLM's OpenAI API over the router, in one or more ingress replicas.

Each replica runs vLLM's own OpenAI serving layer (orchestrator.openai_app) on a
`TandemEngineClient` (orchestrator.engine_client): vLLM renders each request to token ids and
sampling parameters, the router sends them through the pools. /health and /metrics are
Tandem's: they describe the pools, their engines and the router.

`serve run orchestrator.serve:build_app config=examples/1p1d-cpu.yaml` starts the engine
pools and this app in one go; `tandem serve` does the same with clean teardown.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import ray
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.exceptions import RayError

from actors.kv_index import index_actor_name
from actors.logs import setup_logging
from orchestrator.background import spawn
from orchestrator.cache_view import CacheView
from orchestrator.config import TandemConfig, parse_config
from orchestrator.http_server import DirectHTTP
from orchestrator.metrics import TandemMetrics
from orchestrator.models import resolve_local
from orchestrator.protocol import DeploymentStatus
from orchestrator.router import EngineFailure, RequestTrace, Router, needs_cache_view

logger = logging.getLogger("tandem.serve")
# serve.log_requests: one line per finished request.
request_log = logging.getLogger("tandem.requests")


class IngressArgs(msgspec.Struct, frozen=True):
    config: dict[str, Any]
    # The pool manager's actor name and namespace (orchestrator.pools), which every ingress
    # replica asks for the engines in routing.
    manager: str
    namespace: str


# /health and /metrics do not wait longer than this for the manager or an engine.
PROBE_TIMEOUT_S = 5.0
# Paths counted by name on /metrics (tandem_requests); any other is counted as "other".
COUNTED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models",
    "/tokenize", "/detokenize", "/health", "/metrics",
})


@serve.deployment(name="openai", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress()
class OpenAIIngress:
    async def __init__(self, args: IngressArgs) -> None:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.utils.gc_utils import freeze_gc_heap

        from orchestrator.engine_client import TandemEngineClient
        from orchestrator.openai_app import SUPPORTED_TASKS, build_app, frontend_args

        setup_logging()
        self.cfg: TandemConfig = parse_config(args.config)
        self.manager = ray.get_actor(args.manager, namespace=args.namespace)
        table = await self.manager.routing_table.remote(-1, 0)
        self.table_version = table.version
        cache_view = None
        if needs_cache_view(self.cfg.routing):
            tier_index = None
            if self.cfg.cpu_tier.enabled:
                tier_index = ray.get_actor(index_actor_name(self.cfg.serve.app_name), namespace=args.namespace)
            cache_view = CacheView(tier_index)
        self.router = Router(
            table.engines,
            self.cfg.routing,
            self.cfg.stream_batch_s,
            disaggregated=self.cfg.disaggregated,
            report_failure=self._report_failure,
            cache_view=cache_view,
        )
        self.metrics = TandemMetrics(self.cfg.serve.app_name)
        self._watcher: asyncio.Task[None] | None = None
        # The engines' own configuration: this replica renders requests exactly as they run them.
        vllm_config = await table.engines[0].handle.vllm_config.remote()
        self.client = TandemEngineClient(vllm_config, self.router, self._done)
        vllm_args = frontend_args(self.cfg, resolve_local(self.cfg.model.source), vllm_config)
        self.api = build_app(self.cfg, vllm_args, self.health, self.metrics_page, self._count,
                             lambda: self.router.note_abort("queued"))
        await init_app_state(self.client, self.api.state, vllm_args, SUPPORTED_TASKS)
        # As vLLM's server does after start-up: a full collection over the ~600k objects of
        # torch, vLLM and Ray took ~0.3 s here, a stall of every request this replica serves.
        freeze_gc_heap()
        self.http: DirectHTTP | None = None
        if self.cfg.serve.http == "direct":
            self.http = DirectHTTP(self.api, self.cfg.serve.host, self.cfg.serve.port)
            await self.http.start()
        # Follow the routing table and the engines' caches from now (Serve runs this on the
        # event loop that serves the requests), not from the first request: a replica started
        # under traffic then routes that request knowing what the others' requests used (an
        # engine's first answer brings the last WORKING_SET_S of it).
        self._watch_routing()
        if cache_view is not None:
            cache_view.sync()

    def _done(self, trace: RequestTrace, prompt_tokens: int, completion_tokens: int) -> None:
        self.metrics.observe_trace(trace, prompt_tokens, completion_tokens)
        if self.cfg.serve.log_requests:
            request_log.info("%s", trace.describe(prompt_tokens, completion_tokens))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.api

    def url(self) -> str:
        """Where this replica's HTTP endpoint is reached (its own with `serve.http: direct`)."""
        host = self.cfg.serve.host
        if host in ("0.0.0.0", "::"):
            host = ray.util.get_node_ip_address()
        return f"http://{host}:{self.cfg.serve.port}"

    def check_health(self) -> None:
        """Serve's health check: a replica whose HTTP server stopped is restarted."""
        if self.http is not None and not self.http.alive:
            raise RuntimeError("the ingress replica's HTTP server stopped")

    async def __del__(self) -> None:
        """Serve stops the replica: stop accepting, let requests in flight finish."""
        if getattr(self, "http", None) is not None:  # None too when __init__ failed early
            await self.http.stop()

    def _count(self, path: str, status: int) -> None:
        self.metrics.observe_request(path if path in COUNTED_PATHS else "other", status)
        self._watch_routing()

    def _report_failure(self, failure: EngineFailure) -> None:
        e = failure.engine
        spawn(self._send_report(e.engine_id, e.incarnation, failure.cause, failure.engine_down))

    async def _send_report(self, engine_id: str, incarnation: str, cause: str, engine_down: bool) -> None:
        try:
            await self.manager.report_failure.remote(engine_id, incarnation, cause, engine_down)
        except RayError as err:
            logger.warning("could not tell the pool manager that engine %s failed (%s); its health checks will find it", engine_id, err)

    def _watch_routing(self) -> None:
        """Keep the router's engines in step with the manager's routing table (from start-up;
        a request restarts the task should it have ended)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = spawn(self._follow_table())

    async def _follow_table(self) -> None:
        while True:
            try:
                table = await self.manager.routing_table.remote(self.table_version, 30.0)
            except RayError as err:
                logger.warning("could not read the routing table from the pool manager (%s); retrying", err)
                await asyncio.sleep(1.0)
                continue
            if table.version != self.table_version:
                self.router.set_engines(table.engines)
                self.table_version = table.version

    async def _status(self) -> DeploymentStatus | None:
        try:
            return await asyncio.wait_for(self.manager.status.remote(), PROBE_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as err:
            logger.warning("the pool manager did not answer for its status within %.0f s (%s)", PROBE_TIMEOUT_S,
                           type(err).__name__)
            return None

    async def health(self) -> Response:
        """200 while every pool has a healthy replica ("degraded" when some replica is not),
        503 when a pool has none or the pool manager does not answer."""
        status = await self._status()
        if status is None:
            return JSONResponse({"status": "down", "error": "the pool manager did not answer"}, status_code=503)
        pools = {
            p.role: {"healthy": p.num_healthy, "replicas": {r.id: r.state for r in p.replicas}} for p in status.pools
        }
        return JSONResponse({"status": status.health, "pools": pools}, status_code=503 if status.health == "down" else 200)

    async def metrics_page(self) -> Response:
        """Tandem's metrics in Prometheus' text format: requests, router, pools, engines."""
        engines = self.router.engines
        stats, status = await asyncio.gather(
            asyncio.gather(*(asyncio.wait_for(e.handle.get_stats.remote(), PROBE_TIMEOUT_S) for e in engines),
                           return_exceptions=True),
            self._status(),
        )
        live = [s for s in stats if not isinstance(s, BaseException)]
        outstanding = {k: v for p in self.router.pools.values() for k, v in p.outstanding.items()}
        page = self.metrics.render(live, outstanding, status, self.router.stats)
        return Response(page, media_type="text/plain; version=0.0.4")


def build_ingress(cfg: TandemConfig) -> serve.Application:
    """The Serve application for a deployment whose pool manager is running."""
    from orchestrator.config import to_dict
    from orchestrator.pools import manager_name

    return OpenAIIngress.options(num_replicas=cfg.serve.ingress_replicas).bind(IngressArgs(
        config=to_dict(cfg),
        manager=manager_name(cfg.serve.app_name),
        namespace=ray.get_runtime_context().namespace,
    ))


def build_app(args: dict[str, str]) -> serve.Application:
    """`serve run orchestrator.serve:build_app config=PATH`: start the pools, return the app.

    `serve run` calls this before it connects to Ray, so Ray is started (or joined, with
    `address=...` or RAY_ADDRESS) here. The engines belong to the `serve run` process and
    stop with it; HTTP is `serve run`'s own proxy (`serve.http: proxy`, on `serve run`'s host
    and port, not the config's).
    """
    import ray

    from orchestrator.cluster import init_ray
    from orchestrator.config import load_config
    from orchestrator.deploy import Deployment, keep_own_ray_off_engines
    from orchestrator.preflight import preflight

    cfg = load_config(args.get("config"))
    cfg = msgspec.structs.replace(cfg, serve=msgspec.structs.replace(cfg.serve, http="proxy"))
    preflight(cfg)
    if not ray.is_initialized():
        init_ray(cfg, args.get("address"))
    deployment = Deployment(cfg)
    deployment.start()
    # Serve's controller, proxy and ingress start after this returns, as workers of the raylet
    # confined here: they inherit its cores (a Ray started here only; serve run stops it).
    keep_own_ray_off_engines()
    return build_ingress(cfg)
