"""The HTTP front door: vLLM's own OpenAI server routes over Tandem's engine client.

Every generative endpoint of `vllm serve` (/v1/chat/completions, /v1/completions,
/v1/responses, /v1/messages, /tokenize, /detokenize, /v1/models) is vLLM's code with vLLM's
request validation and error shapes; `orchestrator.engine_client` routes what they generate.
Tandem adds what a front door of a cluster needs before any of that runs: a request body
over `serve.max_request_bytes` is refused with 413 unread, a malformed X-Request-Id (it
names the request in every engine's log) with 400; and /health and /metrics describe the
pools instead of one engine.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.config import TandemConfig

# A client's own request id (header X-Request-Id, as vLLM's server takes it): it names the
# request in every engine's logs, so it must be short and printable.
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
SUPPORTED_TASKS = ("generate",)


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """An error in vLLM's (and OpenAI's) shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def frontend_args(cfg: TandemConfig, model_path: str, vllm_config: Any) -> argparse.Namespace:
    """`vllm serve`'s parsed arguments for the front end: the served model, usage with cached
    tokens, and `serve.openai_args`. The reasoning parser is the engines' own."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", model_path, "--served-model-name", cfg.model.name, "--enable-prompt-tokens-details",
            *cfg.serve.openai_args]
    try:
        args = make_arg_parser(FlexibleArgumentParser(exit_on_error=False)).parse_args(argv)
        validate_parsed_serve_args(args)
    except (argparse.ArgumentError, SystemExit, TypeError, ValueError) as err:
        raise ValueError(f"serve.openai_args {cfg.serve.openai_args!r} are not valid `vllm serve` flags: {err}") from None
    args.structured_outputs_config = vllm_config.structured_outputs_config
    return args


class RequestGate:
    """ASGI middleware: 413 for a body over `max_bytes` (by its Content-Length, or while it
    streams in when it has none), 400 for a malformed X-Request-Id; both before any parsing.
    `count(path, status)` sees every answer's status."""

    def __init__(self, app: ASGIApp, max_bytes: int, count: Callable[[str, int], None]) -> None:
        self.app, self.max_bytes, self.count = app, max_bytes, count

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
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.count(path, message["status"])
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._refuse(send, 413, self._too_large())
                self.count(path, 413)

    def _too_large(self) -> str:
        return (f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                "(serve.max_request_bytes); send a shorter prompt")

    @staticmethod
    async def _refuse(send: Send, status: int, message: str, param: str | None = None) -> None:
        kind = "RequestEntityTooLarge" if status == 413 else "BadRequestError"
        await JSONResponse(error_body(status, message, kind, param), status_code=status)({"type": "http"}, _no_body, send)


class _TooLarge(Exception):
    pass


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def build_app(
    cfg: TandemConfig,
    args: argparse.Namespace,
    health: Callable[[], Awaitable[Response]],
    metrics: Callable[[], Awaitable[Response]],
    count: Callable[[str, int], None],
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
    app.add_middleware(RequestGate, max_bytes=cfg.serve.max_request_bytes, count=count)
    return app
