"""Benchmark workloads: lengths, reproducibility, shared prefixes, exact token counts."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from benchmarks.workloads import (
    ConversationWorkload,
    DatasetWorkload,
    Fixed,
    LengthDist,
    Normal,
    RandomWorkload,
    Uniform,
    WorkloadSpec,
    load_dataset,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A small byte-level BPE tokenizer trained here and loaded back from its folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = "serve model token prefill decode cache block engine ray node request stream".split()
    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(words, size=12)) for _ in range(500)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    folder: Path = tmp_path_factory.mktemp("tokenizer")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return load_tokenizer(folder)


def test_fixed_lengths_are_all_equal() -> None:
    assert Fixed(7).sample(np.random.default_rng(0), 4) == [7, 7, 7, 7]


def test_uniform_lengths_cover_both_ends() -> None:
    lengths = Uniform(3, 6).sample(np.random.default_rng(0), 500)
    assert min(lengths) == 3 and max(lengths) == 6


def test_normal_lengths_are_clipped() -> None:
    lengths = Normal(mean=10, std=100, low=5, high=15).sample(np.random.default_rng(0), 500)
    assert min(lengths) == 5 and max(lengths) == 15
    assert all(isinstance(n, int) for n in lengths)


def test_lengths_and_workloads_decode_from_config() -> None:
    assert msgspec.json.decode(b'{"type": "uniform", "low": 1, "high": 3}', type=LengthDist) == (
        Uniform(1, 3)
    )
    spec = msgspec.json.decode(
        b'{"type": "random", "input_len": {"type": "fixed", "value": 8},'
        b' "output_len": {"type": "normal", "mean": 16, "std": 4}}',
        type=WorkloadSpec,
    )
    assert spec == RandomWorkload(Fixed(8), Normal(16, 4))


def test_random_prompts_without_tokenizer_have_the_requested_word_counts() -> None:
    requests = RandomWorkload(Uniform(5, 50), Fixed(32)).sample(20, seed=1)
    inputs = Uniform(5, 50).sample(np.random.default_rng(1), 20)
    assert [len(r.prompt.split()) for r in requests] == inputs
    assert all(r.max_tokens == 32 and r.prompt_tokens is None for r in requests)


def test_random_prompts_are_reproducible_from_the_seed() -> None:
    workload = RandomWorkload(Uniform(5, 50), Uniform(1, 64))
    assert workload.sample(10, seed=3) == workload.sample(10, seed=3)
    assert workload.sample(10, seed=3) != workload.sample(10, seed=4)


def test_random_prompts_have_exact_token_lengths_with_a_tokenizer(tokenizer) -> None:
    requests = RandomWorkload(Uniform(1, 120), Fixed(8)).sample(30, seed=0, tokenizer=tokenizer)
    expected = Uniform(1, 120).sample(np.random.default_rng(0), 30)
    counted = [len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in requests]
    assert counted == expected
    assert [r.prompt_tokens for r in requests] == expected


def test_conversations_are_ordered_turn_by_turn() -> None:
    workload = ConversationWorkload(turns=3, system_len=20, user_len=Fixed(5), reply_len=Fixed(4))
    requests = workload.sample(9, seed=0)
    first, second, third = requests[0:3], requests[3:6], requests[6:9]
    # Each later turn extends exactly one chat's previous turn (in a shuffled order).
    for later, earlier in ((second, first), (third, second)):
        assert sorted(sum(r.prompt.startswith(e.prompt) for e in earlier) for r in later) == [1, 1, 1]
    assert len({r.prompt for r in first}) == 3


def test_conversations_share_one_system_prompt() -> None:
    workload = ConversationWorkload(turns=2, system_len=30, user_len=Fixed(5), reply_len=Fixed(4))
    requests = workload.sample(8, seed=0)
    system = requests[0].prompt.split("\n")[0]
    assert system.startswith("System: ") and len(system.split()) == 31
    assert all(r.prompt.startswith(system + "\n") for r in requests)


def test_conversation_history_holds_a_reply_of_the_previous_max_tokens() -> None:
    workload = ConversationWorkload(
        turns=2, system_len=3, user_len=Fixed(2), reply_len=Uniform(5, 9)
    )
    first, second = workload.sample(2, seed=5)
    reply = second.prompt[len(first.prompt) :].split("\n")[0]
    assert len(reply.split()) == first.max_tokens


def test_a_conversation_of_server_replies_holds_only_each_turns_new_text() -> None:
    """The load generator puts the chat's earlier prompt and the server's answer before it."""
    synthetic = ConversationWorkload(turns=3, system_len=4, user_len=Fixed(2), reply_len=Fixed(3)).sample(6, seed=1)
    live = ConversationWorkload(turns=3, system_len=4, user_len=Fixed(2), reply_len=Fixed(3), replies="server").sample(6, seed=1)
    assert [r.max_tokens for r in live] == [r.max_tokens for r in synthetic]
    first, later = live[:2], live[2:]
    assert sorted(r.chat for r in first) == sorted(r.chat for r in later[:2]) == [0, 1]
    assert all(r.prompt.startswith("System: ") and r.prompt.endswith("\nAssistant:") for r in first)
    # A later turn: what follows the answer, the user's message and the assistant's cue.
    assert all(r.prompt.startswith("\nUser: ") and r.prompt.endswith("\nAssistant:") for r in later)
    assert all(len(r.prompt.split()) == 4 for r in later)  # "User:", the two words, "Assistant:"



def test_staggered_chats_open_among_the_turns_of_earlier_ones() -> None:
    """The same turns as in turn order, each chat's in its own order, first turns spread
    among later ones (chat c's turn t at step 2t + c), as on a service."""
    by_turns = ConversationWorkload(turns=4, system_len=3, user_len=Fixed(2), reply_len=Fixed(2), replies="server")
    staggered = msgspec.structs.replace(by_turns, order="staggered")
    ordered, spread = by_turns.sample(32, seed=3), staggered.sample(32, seed=3)
    assert sorted(r.prompt for r in spread) == sorted(r.prompt for r in ordered)
    # Steps 0, 1 and 2: chat 0's first turn, chat 1's, then chat 0's second and chat 2's first.
    assert [r.chat for r in spread[:2]] == [0, 1] and sorted(r.chat for r in spread[2:4]) == [0, 2]
    turns = [sum(q.chat == r.chat for q in spread[:i]) for i, r in enumerate(spread)]
    firsts = [i for i, t in enumerate(turns) if t == 0]
    assert len(firsts) == 8 and firsts[-1] > 8 + 8  # not all before the second turns
    for chat in range(8):  # each chat's turns in its own order: the opener first, as sampled
        assert [r.prompt for r in spread if r.chat == chat] == [r.prompt for r in ordered if r.chat == chat]
    assert staggered.sample(32, seed=3) == spread  # the seed decides the ties

def test_conversations_stop_at_the_requested_count() -> None:
    workload = ConversationWorkload(turns=4, system_len=3, user_len=Fixed(2), reply_len=Fixed(2))
    assert len(workload.sample(7, seed=0)) == 7


def test_conversation_prompts_count_their_tokens_with_a_tokenizer(tokenizer) -> None:
    workload = ConversationWorkload(turns=2, system_len=10, user_len=Fixed(5), reply_len=Fixed(4))
    for r in workload.sample(4, seed=0, tokenizer=tokenizer):
        assert r.prompt_tokens == len(tokenizer.encode(r.prompt, add_special_tokens=False))


def test_the_bundled_dataset_loads() -> None:
    records = load_dataset()
    assert len(records) >= 50
    assert all(r.prompt and r.output_len > 0 for r in records)


def test_dataset_uses_every_record_before_repeating_one() -> None:
    size = len(load_dataset())
    requests = DatasetWorkload().sample(size + 5, seed=0)
    assert len({r.prompt for r in requests[:size]}) == size
    assert len(requests) == size + 5


def test_dataset_output_lengths_come_from_the_records_unless_overridden() -> None:
    by_prompt = {r.prompt: r.output_len for r in load_dataset()}
    for r in DatasetWorkload().sample(10, seed=2):
        assert r.max_tokens == by_prompt[r.prompt]
    assert {r.max_tokens for r in DatasetWorkload(output_len=Fixed(9)).sample(10, seed=2)} == {9}


def test_dataset_sampling_is_reproducible_from_the_seed() -> None:
    assert DatasetWorkload().sample(10, seed=7) == DatasetWorkload().sample(10, seed=7)
    assert DatasetWorkload().sample(10, seed=7) != DatasetWorkload().sample(10, seed=8)
