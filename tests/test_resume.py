"""A request resumed on another engine continues its text exactly where the client's left off
(actors.resume), with vLLM's own detokenizer and the tiny model's tokenizer."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm.sampling_params import SamplingParams
from actors.resume import ResumedText


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(tiny_model))


def undisturbed(
    tokenizer: Any, prompt: list[int], output: list[int], sampling: SamplingParams, finished: bool = True
) -> tuple[str, list[int]]:
    """The text and tokens vLLM's detokenizer streams for `output` of one uninterrupted request
    (all of it when the request finished; while it runs, the tail a stop string may still
    claim is held back)."""
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(max_tokens=len(output), stop=sampling.stop or None, min_tokens=sampling.min_tokens)
    detok = IncrementalDetokenizer.from_new_request(
        tokenizer, SimpleNamespace(request_id="r", prompt_token_ids=prompt, prompt_embeds=None, sampling_params=params)
    )
    text = ""
    for t in output:
        if detok.update([t], False) is not None:  # a stop string ends the request
            finished = True
            break
        text += detok.get_next_output_text(False, True)
    return text + detok.get_next_output_text(finished, True), detok.output_token_ids


def resumed_text(
    tokenizer: Any, prompt: list[int], output: list[int], cut: int, sampling: SamplingParams
) -> tuple[str, list[int], str | None]:
    """What the client sees when the first engine streamed output[:cut] and died, and the stop
    string that ended the rest, if one did."""
    first, _ = undisturbed(tokenizer, prompt, output[:cut], sampling, finished=False)
    rest = ResumedText(tokenizer, prompt, output[:cut], sampling)
    text, kept, stop = first, list(output[:cut]), None
    for i, t in enumerate(output[cut:]):
        delta, new, stop = rest.feed([t], i == len(output) - cut - 1, False)
        text += delta
        kept += new
        if stop is not None:
            break
    return text, kept, stop


def test_resumed_text_equals_the_undisturbed_text_at_any_cut(tokenizer: Any) -> None:
    """Random byte-level tokens end inside multi-byte characters at many cuts; priming vLLM's
    detokenizer with the longer prompt repeated text there (a quarter of the cuts)."""
    rng = random.Random(0)
    prompt = tokenizer.encode("hello world")
    for _ in range(200):
        output = [rng.randrange(3, len(tokenizer)) for _ in range(30)]
        cut = rng.randrange(1, 29)
        expected, _ = undisturbed(tokenizer, prompt, output, SamplingParams(max_tokens=30))
        got, _, stop = resumed_text(tokenizer, prompt, output, cut, SamplingParams(max_tokens=30 - cut))
        assert got == expected and stop is None, f"cut at {cut}"


def test_a_stop_string_spanning_the_cut_ends_the_resumed_request(tokenizer: Any) -> None:
    prompt = tokenizer.encode("hello")
    output = tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    sampling = SamplingParams(max_tokens=len(output), stop=["brown fox"])
    expected, expected_tokens = undisturbed(tokenizer, prompt, output, sampling)
    cut = next(i for i in range(1, len(output)) if "brown" in tokenizer.decode(output[:i]))
    got, kept, stop = resumed_text(tokenizer, prompt, output, cut, sampling)
    assert "fox" not in got and got == expected and kept == expected_tokens
    assert stop == "brown fox"  # vLLM's stop_reason for a stop string
