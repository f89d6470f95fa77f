"""vLLM's `EngineClient` over Tandem's router, so vLLM's own OpenAI serving layer runs on top of
the disaggregated path.

vLLM's serving classes (chat, completions, responses, tokenization) render each request to
token ids and SamplingParams, then call `generate()` as they would on AsyncLLM. Here that call
is routed: prefill on one pool, KV hand-off, decode on another, failover and cancellation as
the router does them. Everything the serving layer derives from the request (structured
outputs, logprobs, logit_bias, n, stop strings, the model's generation_config defaults) rides
in the SamplingParams to the engine, so Tandem serves what a plain `vllm serve` serves.

The configuration is the engines' own (`EngineActor.vllm_config`), so the renderer here
tokenizes exactly as the engines would and `max_model_len` is theirs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from contextvars import ContextVar
from typing import Any

from vllm.engine.protocol import EngineClient
from vllm.exceptions import RetryableRequestError, VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.renderers import renderer_from_config
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import InputProcessor

from actors.protocol import EngineRequest
from orchestrator.router import (
    EngineFailure,
    MigrationLimitError,
    NoEngineError,
    RequestTrace,
    Router,
    UnresumableError,
)

class Arrival:
    """One HTTP request as the HTTP layer (openai_app.RequestGate) sees it, set in
    REACHED_ROUTER: whether it reached the router (a client that leaves earlier, while vLLM
    renders its request, is counted as aborted in phase "queued"), the tasks consuming its
    routed streams, and the traces of its generations (one per prompt), whose engines its
    response headers name. vLLM runs a non-streaming handler in a task of its own that
    Serve's cancellation of the request does not reach; the gate cancels these tasks, which
    aborts the request on its engines."""

    def __init__(self) -> None:
        self.routed = False
        self.consumers: list[asyncio.Task[Any]] = []
        self.traces: list[RequestTrace] = []
        # Before vLLM's serving layer parses, renders and tokenizes it (RequestTrace.t_received).
        self.t = time.perf_counter()


REACHED_ROUTER: ContextVar[Arrival | None] = ContextVar("tandem_reached_router", default=None)
# What a routed request can fail with once it is under way: the service's fault, retryable.
SERVICE_ERRORS = (NoEngineError, MigrationLimitError, UnresumableError, EngineFailure)


class TandemEngineClient(EngineClient):
    """Serves vLLM's OpenAI layer in a Tandem ingress replica: requests go to the router."""

    def __init__(self, vllm_config: Any, router: Router, on_done: Callable[[RequestTrace, int, int], None]) -> None:
        """`on_done(trace, prompt_tokens, completion_tokens)` is called for every request that ends."""
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self.router = router
        self._on_done = on_done
        # The tasks consuming each request id's streams, so that abort() can stop them: like
        # vLLM's, an abort stops every request sent under the id (clients may reuse X-Request-Id).
        self._consumers: dict[str, set[asyncio.Task[Any]]] = {}

    async def generate(  # type: ignore[override]
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Route one rendered request and stream its outputs as `sampling_params.output_kind` asks."""
        if lora_request is not None:
            raise VLLMValidationError("LoRA adapters are not served by Tandem; use the base model", parameter="model")
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt or prompt.get("type", "token") != "token":
            raise VLLMValidationError("Tandem serves text prompts only (no multi-modal or embedding inputs)", parameter="prompt")
        # The keyword arguments of AsyncLLM.generate that travel to the engine as they are.
        forwarded = {"priority": priority, "trace_headers": trace_headers, "reasoning_ended": reasoning_ended,
                     "reasoning_parser_kwargs": reasoning_parser_kwargs}
        request = EngineRequest(
            request_id,
            list(prompt["prompt_token_ids"]),
            sampling_params,
            prompt_fields={k: v for k, v in prompt.items() if k in ("prompt", "cache_salt") and v is not None},
            generate_kwargs={k: v for k, v in forwarded.items() if v},
        )
        consumer: asyncio.Task[Any] = asyncio.current_task()  # type: ignore[assignment]
        trace = RequestTrace()
        if (arrival := REACHED_ROUTER.get()) is not None:
            arrival.routed = True
            arrival.consumers.append(consumer)
            arrival.traces.append(trace)
            trace.t_received = arrival.t
        kind = sampling_params.output_kind
        merged: RequestOutput | None = None
        num_out = 0
        self._consumers.setdefault(request_id, set()).add(consumer)
        try:
            async for out in self.router.generate(request, trace):
                num_out += sum(len(c.token_ids) for c in out.outputs)
                if kind == RequestOutputKind.DELTA:
                    yield out
                    continue
                if merged is None:
                    merged = out
                else:
                    merged.add(out, aggregate=True)
                if kind == RequestOutputKind.CUMULATIVE or merged.finished:
                    yield merged
        except SERVICE_ERRORS as err:
            raise RetryableRequestError(str(err)) from err
        else:
            self._on_done(trace, len(request.prompt_token_ids), num_out)
        finally:
            same_id = self._consumers[request_id]
            same_id.discard(consumer)
            if not same_id:
                del self._consumers[request_id]

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now: their consumers are cancelled, which aborts them on their engines."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            for task in self._consumers.get(rid, ()):
                task.cancel()

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("Tandem serves generative models; pooling (embeddings, scores) is not served")

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    # The engines run and heal under the pool manager; the ingress's /health reports them.
    @property
    def is_running(self) -> bool:
        return True

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        return False

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError()

    async def check_health(self) -> None:
        return None

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def notify_kv_transfer_request_rejected(self, request_id: str, kv_transfer_params: dict[str, Any], *,
                                                  data_parallel_rank: int | None = None) -> None:
        raise NotImplementedError("Tandem moves KV itself; a client's kv_transfer_params are not taken")

    # Engine administration is the pool manager's (`tandem status`, restarts), not the API's.
    def _not_here(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"{what} is not available through Tandem's API")

    async def add_lora(self, lora_request: Any) -> bool:
        raise self._not_here("loading LoRA adapters")

    async def start_profile(self, *args: Any, **kwargs: Any) -> None:
        raise self._not_here("profiling")

    async def stop_profile(self) -> None:
        raise self._not_here("profiling")

    async def reset_mm_cache(self) -> None:
        raise self._not_here("resetting caches")

    async def reset_encoder_cache(self) -> None:
        raise self._not_here("resetting caches")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        raise self._not_here("resetting caches")

    async def sleep(self, level: int = 1, mode: Any = "abort") -> None:
        raise self._not_here("sleep mode")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        raise self._not_here("sleep mode")

    async def is_sleeping(self) -> bool:
        return False

    async def release_kv_cache_memory(self) -> None:
        raise self._not_here("releasing KV cache memory")

    async def pause_generation(self, *, mode: Any = "abort", clear_cache: bool = True) -> None:
        raise self._not_here("pausing generation")

    async def resume_generation(self) -> None:
        raise self._not_here("pausing generation")

    async def is_paused(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        self.renderer.shutdown()
