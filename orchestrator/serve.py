"""The Ray Serve app: an OpenAI-compatible front door over the router.

Endpoints: /v1/completions, /v1/chat/completions (streaming and not), /v1/models, /health,
/metrics. The ingress tokenizes (so prefill and decode engines see the same token ids),
checks the request against the model's limits, and hands it to the router.

`serve run orchestrator.serve:build_app config=examples/1p1d-cpu.yaml` starts the engine
pools and this app in one go; `tandem serve` does the same with clean teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError

from actors.kv_index import index_actor_name
from actors.protocol import EngineChunk
from orchestrator.cache_view import CacheView
from orchestrator.config import TandemConfig, parse_config
from orchestrator.metrics import TandemMetrics
from orchestrator.models import resolve_local
from orchestrator.openai_api import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
    make_id,
    message_text,
    now,
    reject_unsupported,
    usage,
)
from orchestrator.protocol import DeploymentStatus
from orchestrator.router import (
    EngineFailure,
    MigrationLimitError,
    NoEngineError,
    RequestTrace,
    Router,
    is_client_error,
    needs_cache_view,
)

logger = logging.getLogger("tandem.serve")

api = FastAPI(title="Tandem", description="Disaggregated LLM serving on Ray (OpenAI-compatible)")


@api.exception_handler(Exception)
async def _unexpected(request: Request, err: Exception) -> JSONResponse:
    """Last resort: an OpenAI-shaped 500 that says what broke, instead of a bare text page."""
    logger.exception("unhandled error serving %s", request.url.path)
    body = ApiError(500, f"internal error: {type(err).__name__}: {err}", kind="internal_error").body()
    return JSONResponse(body, status_code=500)


class IngressArgs(msgspec.Struct, frozen=True):
    config: dict[str, Any]
    # The pool manager's actor name and namespace (orchestrator.pools), which every ingress
    # replica asks for the engines in routing.
    manager: str
    namespace: str
    max_model_len: int


# A client's own request id (header X-Request-Id, as vLLM's server takes it): it names the
# request in every engine's logs, so it must be short and printable.
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# /health and /metrics do not wait longer than this for the manager or an engine.
PROBE_TIMEOUT_S = 5.0


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# What a request can end with once the router has it: an engine's verdict on the input, or
# no engine left to serve it.
GENERATION_ERRORS = (RayError, EngineFailure, NoEngineError, MigrationLimitError)


def _engine_error(err: Exception) -> ApiError:
    """Map a failure while generating: vLLM's own input checks are the client's fault (400);
    no engine left, or too many moves, is the service's (503, retry later)."""
    if is_client_error(err):
        return ApiError(400, f"the engine rejected the request: {err.cause}")  # type: ignore[attr-defined]
    if isinstance(err, (NoEngineError, MigrationLimitError, EngineFailure)):
        return ApiError(503, str(err), kind="service_unavailable")
    return ApiError(500, f"internal error while generating: {err}", kind="internal_error")


@serve.deployment(name="openai", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(self, args: IngressArgs) -> None:
        from transformers import AutoTokenizer

        self.cfg: TandemConfig = parse_config(args.config)
        self.model_name = self.cfg.model.name
        self.max_model_len = args.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_local(self.cfg.model.source))
        # Tokenizing a long prompt or rendering a chat template takes milliseconds that would
        # stall every other request's stream on the event loop; one thread, like vLLM's server,
        # because a Hugging Face tokenizer is not safe to call from two threads at once.
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenize")
        self.manager = ray.get_actor(args.manager, namespace=args.namespace)
        table = ray.get(self.manager.routing_table.remote(-1, 0))
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
            self.cfg.serve.stream_batch_ms / 1000,
            disaggregated=self.cfg.disaggregated,
            report_failure=self._report_failure,
            cache_view=cache_view,
        )
        self.metrics = TandemMetrics(self.cfg.serve.app_name)
        self._watcher: asyncio.Task[None] | None = None

    def _report_failure(self, failure: EngineFailure) -> None:
        e = failure.engine
        self.manager.report_failure.remote(e.engine_id, e.incarnation, failure.cause, failure.engine_down)

    def _watch_routing(self) -> None:
        """Keep the router's engines in step with the manager's routing table (started with
        the first request: the replica's event loop runs by then)."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._follow_table())

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

    # ---- endpoints -------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> Response:
        """200 while every pool has a healthy replica ("degraded" when some replica is not),
        503 when a pool has none or the pool manager does not answer."""
        self._watch_routing()
        status = await self._status()
        if status is None:
            return JSONResponse({"status": "down", "error": "the pool manager did not answer"}, status_code=503)
        pools = {
            p.role: {"healthy": p.num_healthy, "replicas": {r.id: r.state for r in p.replicas}} for p in status.pools
        }
        return JSONResponse({"status": status.health, "pools": pools}, status_code=503 if status.health == "down" else 200)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": now(), "owned_by": "tandem", "max_model_len": self.max_model_len}],
        }

    @api.get("/metrics")
    async def metrics(self) -> Response:
        self._watch_routing()
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

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    # ---- request handling ------------------------------------------------------------

    async def _handle(self, request: Request, endpoint: str) -> Response:
        self._watch_routing()
        try:
            own_id = request.headers.get("x-request-id")
            if own_id is not None and not REQUEST_ID.match(own_id):
                raise ApiError(400, "header X-Request-Id must be 1-128 letters, digits or . _ : -", param="X-Request-Id")
            body = await request.body()
            req: CompletionRequest | ChatCompletionRequest
            req = decode_request(body, ChatCompletionRequest if endpoint == "chat" else CompletionRequest)
            reject_unsupported(req)
            if req.model != self.model_name:
                raise ApiError(404, f"the model `{req.model}` does not exist; this server serves `{self.model_name}`", param="model", kind="not_found_error")
            prompt_ids = await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, self._prompt_ids, req)
            sampling = req.sampling(self._max_tokens(req, len(prompt_ids)))
        except ApiError as err:
            self.metrics.observe_request(endpoint, err.status)
            return JSONResponse(err.body(), status_code=err.status)
        except asyncio.CancelledError:
            self.router.note_abort("queued")  # the client left before its request reached an engine
            raise
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        rid = f"{prefix}-{own_id}" if own_id else make_id(prefix)
        trace = RequestTrace()
        chunks = self.router.generate(rid, prompt_ids, sampling, trace)
        if req.stream:
            self.metrics.observe_request(endpoint, 200)
            return StreamingResponse(self._stream(endpoint, rid, req, chunks, trace, len(prompt_ids)), media_type="text/event-stream")
        return await self._complete(endpoint, rid, req, chunks, trace, prompt_ids)

    def _prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The request's prompt as token ids (runs on the tokenizer thread)."""
        return self._chat_prompt(req) if isinstance(req, ChatCompletionRequest) else self._completion_prompt(req)

    def _completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
        else:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(400, "prompt must be a string or a list of token ids (integers)", param="prompt")
            ids = list(prompt)
            vocab = len(self.tokenizer)
            if bad := [t for t in ids if not 0 <= t < vocab]:
                raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        conversation = [{"role": m.role, "content": message_text(m, i)} for i, m in enumerate(req.messages)]
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # jinja errors of the model's own template
            raise ApiError(400, f"the chat template could not render these messages: {err}", param="messages") from None
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _max_tokens(self, req: CompletionRequest | ChatCompletionRequest, num_prompt: int) -> int:
        room = self.max_model_len - num_prompt
        asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise ApiError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{num_prompt} prompt tokens and asks for {asked if asked is not None else 'at least 1'} "
                "completion tokens. Shorten the prompt or lower max_tokens",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        return asked if asked is not None else room

    async def _complete(
        self,
        endpoint: str,
        rid: str,
        req: CompletionRequest | ChatCompletionRequest,
        chunks: AsyncIterator[EngineChunk],
        trace: RequestTrace,
        prompt_ids: list[int],
    ) -> Response:
        text, token_ids, last = [], [], None
        try:
            async with contextlib.aclosing(chunks):
                async for c in chunks:
                    text.append(c.text)
                    token_ids.extend(c.token_ids)
                    last = c
        except GENERATION_ERRORS as err:
            api_err = _engine_error(err)
            self.metrics.observe_request(endpoint, api_err.status)
            return JSONResponse(api_err.body(), status_code=api_err.status)
        self.metrics.observe_request(endpoint, 200)
        self.metrics.observe_trace(trace, len(prompt_ids), len(token_ids))
        finish = last.finish_reason if last else None
        u = usage(len(prompt_ids), len(token_ids), trace.num_cached_tokens)
        extra = {"token_ids": token_ids} if req.return_token_ids else {}
        body: dict[str, Any] = {"id": rid, "created": now(), "model": self.model_name, "usage": u}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        if endpoint == "chat":
            message = {"role": "assistant", "content": "".join(text)}
            body |= {"object": "chat.completion", "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish, **extra}]}
        else:
            body |= {"object": "text_completion", "choices": [{"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": finish, **extra}]}
        return JSONResponse(body)

    async def _stream(
        self,
        endpoint: str,
        rid: str,
        req: CompletionRequest | ChatCompletionRequest,
        chunks: AsyncIterator[EngineChunk],
        trace: RequestTrace,
        num_prompt: int,
    ) -> AsyncIterator[bytes]:
        chat = endpoint == "chat"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now(), "model": self.model_name}

        def event(text: str | None, finish: str | None, role: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return _sse({**head, "choices": [choice], **({"usage": None} if req.include_usage else {})})

        n_out = 0
        try:
            if chat:
                yield event(None, None, role=True)
            # Closing the router's stream (the client left) aborts the request on its engines.
            async with contextlib.aclosing(chunks):
                async for c in chunks:
                    n_out += len(c.token_ids)
                    if c.text or c.finished:
                        yield event(c.text, c.finish_reason if c.finished else None)
        except GENERATION_ERRORS as err:
            yield _sse(_engine_error(err).body())
        else:
            self.metrics.observe_trace(trace, num_prompt, n_out)
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": usage(num_prompt, n_out, trace.num_cached_tokens)})
        yield b"data: [DONE]\n\n"


def build_ingress(cfg: TandemConfig, max_model_len: int) -> serve.Application:
    """The Serve application for a deployment whose pool manager is running."""
    from orchestrator.config import to_dict
    from orchestrator.pools import manager_name

    return OpenAIIngress.options(num_replicas=cfg.serve.ingress_replicas).bind(IngressArgs(
        config=to_dict(cfg),
        manager=manager_name(cfg.serve.app_name),
        namespace=ray.get_runtime_context().namespace,
        max_model_len=max_model_len,
    ))


def build_app(args: dict[str, str]) -> serve.Application:
    """`serve run orchestrator.serve:build_app config=PATH`: start the pools, return the app.

    `serve run` calls this before it connects to Ray, so Ray is started (or joined, with
    `address=...` or RAY_ADDRESS) here. The engines belong to the `serve run` process and
    stop with it; HTTP host and port are `serve run`'s, not the config's.
    """
    import ray

    from orchestrator.cluster import init_ray
    from orchestrator.config import load_config
    from orchestrator.deploy import Deployment
    from orchestrator.preflight import preflight

    cfg = load_config(args.get("config"))
    preflight(cfg)
    if not ray.is_initialized():
        init_ray(cfg, args.get("address"))
    deployment = Deployment(cfg)
    deployment.start()
    return build_ingress(cfg, min(i.max_model_len for i in deployment.infos))
