"""vLLM RequestOutputs as fake engines stream them (one delta per call), for router unit tests."""

from __future__ import annotations

from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput


def output(text: str, token_ids: list[int], finished: bool = False, finish_reason: str | None = None,
           kv_transfer_params: dict[str, Any] | None = None, num_cached_tokens: int = 0) -> RequestOutput:
    """One streamed delta of a one-sequence request, the shape vLLM's AsyncLLM yields."""
    comp = CompletionOutput(index=0, text=text, token_ids=list(token_ids), cumulative_logprob=None, logprobs=None,
                            finish_reason=finish_reason)
    return RequestOutput("fake", None, [], None, [comp], finished, num_cached_tokens=num_cached_tokens,
                         kv_transfer_params=kv_transfer_params)


def tokens(outputs: list[RequestOutput]) -> list[int]:
    """Every token a stream of deltas carried, in order."""
    return [t for o in outputs for t in o.outputs[0].token_ids]
