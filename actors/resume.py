"""The text of a request resumed on this engine after another engine died mid-stream.

The router resumes a request from its prompt plus the tokens already streamed, sent as one
longer prompt. vLLM's detokenizer would start that request's text from the longer prompt: its
fast path primes the tokenizer's DecodeStream with every prompt id, which, when the tokens
already streamed end inside a multi-byte character, emits text the client already has (seen:
a quarter of random cut points repeated the whole prompt's text). And its stop-string check
would not see a stop string that spans the cut.

So the engine actor detokenizes a resumed request's new tokens itself, with vLLM's own
incremental detokenizer in the state the first engine's was in at the cut: primed with the
original prompt, then fed the tokens already streamed. The text continues exactly where the
client's left off, and stop strings are checked over the whole output, as vLLM does.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class ResumedText:
    """Text deltas and stop strings of a resumed request, as the undisturbed stream's would be."""

    def __init__(self, tokenizer: Any, prompt: list[int], streamed: list[int], sampling: Any) -> None:
        """`sampling`: the resumed request's vLLM SamplingParams."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            # `sampling` is the rest's (min_tokens less what was streamed); the detokenizer
            # counts the streamed tokens too.
            min_tokens=sampling.min_tokens + len(streamed) if sampling.min_tokens else 0,
            stop=sampling.stop or None,
            include_stop_str_in_output=sampling.include_stop_str_in_output,
            skip_special_tokens=sampling.skip_special_tokens,
        )
        # The fields vLLM's detokenizers read from an EngineCoreRequest.
        request = SimpleNamespace(request_id="resumed", prompt_token_ids=prompt, prompt_embeds=None, sampling_params=params)
        self._detok = IncrementalDetokenizer.from_new_request(tokenizer, request)  # type: ignore[arg-type]
        self._detok.update(streamed, False)
        self._detok.get_next_output_text(False, True)  # the client has this text already

    def feed(self, token_ids: list[int], finished: bool, stop_token: bool) -> tuple[str, list[int], str | None]:
        """(new text, the new tokens kept, the stop string that ended the request, if one did:
        vLLM's `stop_reason`). `stop_token`: the engine ended the request on a stop token (EOS
        or stop_token_ids), which gets no text. A stop string drops the tokens after it, as
        vLLM does."""
        before = self._detok.num_output_tokens()
        stop = self._detok.update(token_ids, stop_token)
        kept = self._detok.output_token_ids[before:]
        return self._detok.get_next_output_text(finished or stop is not None, True), kept, stop
