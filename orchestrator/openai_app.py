"""The HTTP front door: vLLM's own OpenAI server routes over Tandem's engine client.

Every generative endpoint of `vllm serve` (/v1/chat/completions, /v1/completions,
/v1/responses, /v1/messages, /tokenize, /detokenize, /v1/models) is vLLM's code with vLLM's
request validation and error shapes; `orchestrator.engine_client` routes what they generate.
Tandem adds what a front door of a cluster needs before any of that runs: a request body
over `serve.max_request_bytes` is refused with 413 unread, a malformed X-Request-Id (it
names the request in every engine's log) with 400; /health and /metrics describe the pools
instead of one engine; and every generative response names the engines it ran on
(`route_headers`), as llm-d's gateway names its endpoint in x-gateway-destination-endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.config import ConfigError, TandemConfig
from orchestrator.engine_client import REACHED_ROUTER, Arrival
from orchestrator.router import RequestTrace

# A client's own request id (header X-Request-Id, as vLLM's server takes it): it names the
# request in every engine's logs, so it must be short and printable.
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
SUPPORTED_TASKS = ("generate",)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """An error in vLLM's (and OpenAI's) shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def parse_frontend_args(cfg: TandemConfig, model: str) -> argparse.Namespace:
    """`vllm serve`'s parsed arguments for the front end: the served model, usage with cached
    tokens, and `serve.openai_args`; a ConfigError naming the field when vLLM refuses them."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", model, "--served-model-name", cfg.model.name, "--enable-prompt-tokens-details",
            *cfg.serve.openai_args]
    try:
        args, unknown = make_arg_parser(FlexibleArgumentParser(exit_on_error=False)).parse_known_args(argv)
        if unknown:
            raise ValueError(f"unknown flags {unknown}")
        validate_parsed_serve_args(args)
    except (argparse.ArgumentError, TypeError, ValueError) as err:
        raise ConfigError(f"`serve.openai_args` {cfg.serve.openai_args!r} are not valid `vllm serve` front-end flags "
                          f"({err}); fix: see `vllm serve --help=Frontend`") from None
    return args


def frontend_args(cfg: TandemConfig, model_path: str, vllm_config: Any) -> argparse.Namespace:
    """The front end's arguments (parse_frontend_args) with the engines' structured-output
    settings, which carry the reasoning parser."""
    args = parse_frontend_args(cfg, model_path)
    args.structured_outputs_config = vllm_config.structured_outputs_config
    return args


def route_headers(traces: Sequence[RequestTrace]) -> list[tuple[bytes, bytes]]:
    """Where a response's generations ran, one comma-separated value per generation ("none"
    where it has none): x-tandem-engine, the engine streaming the output (a stream's when its
    headers left; a whole response's last, after any migration); x-tandem-prefill-engine, the engine whose remote prefill it used;
    x-tandem-disaggregation, the decision (RequestTrace.placement). A header no generation
    has a value for is left out."""
    values = {
        b"x-tandem-engine": [t.output_engine for t in traces],
        b"x-tandem-prefill-engine": [t.prefill_engine for t in traces],
        b"x-tandem-disaggregation": [t.placement() for t in traces],
    }
    return [(name, ", ".join(v or "none" for v in vs).encode()) for name, vs in values.items() if any(vs)]


class RequestGate:
    """ASGI middleware: 413 for a body over `max_bytes` (by its Content-Length, or as it is read
    when it has none), 400 for a malformed X-Request-Id; both before any parsing.
    `count(path, status)` sees every answer's status; `left_early()` every client that left
    before its request reached the router (however the server tells that a client left).
    With `name_route`, a response's headers are held until its engines are chosen (a stream's
    first output; what a stream sends before that, such as /v1/responses' `response.created`,
    waits with them) or its body ends, and leave with `route_headers`."""

    def __init__(self, app: ASGIApp, max_bytes: int, count: Callable[[str, int], None],
                 left_early: Callable[[], None], *, name_route: bool) -> None:
        self.app, self.max_bytes, self.count, self.left_early = app, max_bytes, count, left_early
        self.name_route = name_route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        own_id = headers.get("x-request-id")
        path = scope["path"]
        if own_id is not None and not REQUEST_ID.match(own_id):
            await self._refuse(send, 400, "header X-Request-Id must be 1-128 letters, digits or . _ : -", "X-Request-Id")
            self.count(path, 400)
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, 413, self._too_large())
            self.count(path, 413)
            return
        if not length.isdigit() and scope["method"] in ("POST", "PUT", "PATCH"):
            # No Content-Length (a chunked body): read it here, at most one byte over the cap,
            # then hand what was read to the app.
            parts, size, more = [], 0, True
            while more and size <= self.max_bytes:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                parts.append(message.get("body", b""))
                size += len(parts[-1])
                more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._refuse(send, 413, self._too_large())
                self.count(path, 413)
                return
            receive = _replay(b"".join(parts), receive)

        answered = left = False
        arrival = Arrival()
        held: list[Message] = []  # the response's start, then what followed it, until its route is known

        async def tracked(message: Message) -> None:
            nonlocal answered
            if left:
                return  # nobody to answer (vLLM's cancelled handler still returns a body)
            if message["type"] == "http.response.start":
                answered = True
                self.count(path, message["status"])
                if self.name_route:
                    held.append(message)
                    return
            elif held:
                held.append(message)
                if message.get("more_body") and not any(t.output_engine or t.prefill_engine for t in arrival.traces):
                    return  # e.g. /v1/responses' response.created, streamed before any engine is chosen
                start, *rest = held
                held.clear()
                await send({**start, "headers": [*start.get("headers", ()), *route_headers(arrival.traces)]})
                for m in rest:
                    await send(m)
                return
            await send(message)

        async def watched() -> Message:
            # Served directly (uvicorn), a client that leaves shows as a disconnect message,
            # on which vLLM's handlers cancel their own work.
            nonlocal left
            message = await receive()
            left = left or (message["type"] == "http.disconnect" and not answered)
            return message

        reset = REACHED_ROUTER.set(arrival)
        try:
            await self.app(scope, watched, tracked)
        except asyncio.CancelledError:
            # Behind Serve's proxy, a client that leaves cancels this call instead.
            left = True
            me = asyncio.current_task()
            for task in arrival.consumers:
                if task is not me and not task.done():
                    task.cancel()  # abort what it asked for on the engines
            raise
        finally:
            REACHED_ROUTER.reset(reset)
            if left and not arrival.routed:
                self.left_early()

    def _too_large(self) -> str:
        return (f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                "(serve.max_request_bytes); send a shorter prompt")

    @staticmethod
    async def _refuse(send: Send, status: int, message: str, param: str | None = None) -> None:
        kind = "RequestEntityTooLarge" if status == 413 else "BadRequestError"
        await JSONResponse(error_body(status, message, kind, param), status_code=status)({"type": "http"}, _no_body, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """An ASGI receive that gives the already read `body` first, then the client's own
    messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def build_app(
    cfg: TandemConfig,
    args: argparse.Namespace,
    health: Callable[[], Awaitable[Response]],
    metrics: Callable[[], Awaitable[Response]],
    count: Callable[[str, int], None],
    left_early: Callable[[], None],
) -> FastAPI:
    """vLLM's generative routes, exception handlers and middleware (API keys, CORS), Tandem's
    /health and /metrics, the request gate outermost."""
    from vllm.entrypoints.generate.api_router import register_generate_api_routers
    from vllm.entrypoints.openai.models.api_router import attach_router as attach_models
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.entrypoints.serve.tokenize.api_router import attach_router as attach_tokenize

    app = FastAPI(title="Tandem", description="Disaggregated LLM serving on Ray (vLLM's OpenAI API)")
    app.state.args = args  # vLLM's routers read their flags from here
    app.add_api_route("/health", health, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    register_generate_api_routers(app)
    attach_models(app)
    attach_tokenize(app)
    init_exception_handler(app)
    # No generate task here: vLLM's elastic-EP scaling middleware has nothing to scale.
    init_entrypoints_middleware(args, app, ())
    app.add_middleware(RequestGate, max_bytes=cfg.serve.max_request_bytes, count=count, left_early=left_early,
                       name_route=cfg.serve.route_headers)
    return app
