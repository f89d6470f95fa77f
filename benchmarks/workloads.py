"""Workloads: the prompts a benchmark sends, generated locally and reproducibly.

A workload is a frozen msgspec Struct holding only its parameters, so a run's JSON records
exactly what was sent and a config file can name one (`{"type": "random", ...}`). Its
`sample(num_requests, seed, tokenizer)` returns `BenchRequest`s whose prompts are text, which
is what an OpenAI-compatible server accepts from any client.

Without a tokenizer, lengths are counted in words of everyday English (roughly one token each
for BPE tokenizers). With one, random prompts are built from the tokenizer's own vocabulary and
re-encoded until they are exactly the requested number of tokens (vLLM's RandomDataset does the
same), and every prompt's true token count is recorded. Output lengths are made exact by the
load generator sending `max_tokens` with `ignore_eos`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import msgspec
import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_DATASET = Path(__file__).parent / "data" / "prompts.jsonl"

# Decode/re-encode rounds before accepting a prompt a few tokens off its target length.
_MAX_LENGTH_FIXES = 10

_WORDS = (
    "the of and to in is for that on with as it by this be are from at or an was have not "
    "can will which their more about one all also time when there would other new some these "
    "what like people into than its only then two over most first such after use could way "
    "data system model request memory server network cache latency user question answer write "
    "explain describe summary report table list example reason result value function class "
    "method file code test error change update version release design plan team project city "
    "river mountain history music science energy water market price company customer product "
    "service policy health school student teacher language book story world country research "
    "study paper figure method experiment measure number average rate growth quickly carefully "
    "simple important different large small early recent local global public private short long"
).split()


class Fixed(msgspec.Struct, frozen=True, tag="fixed"):
    """Every request gets the same length."""

    value: int

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [self.value] * n


class Uniform(msgspec.Struct, frozen=True, tag="uniform"):
    """Lengths drawn uniformly from [low, high], both ends included."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.high + 1, size=n).tolist()


class Normal(msgspec.Struct, frozen=True, tag="normal"):
    """Lengths drawn from a normal distribution, rounded and clipped to [low, high]."""

    mean: float
    std: float
    low: int = 1
    high: int | None = None  # no upper clip when None

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        drawn = np.rint(rng.normal(self.mean, self.std, size=n))
        return np.clip(drawn, self.low, self.high).astype(int).tolist()


LengthDist = Fixed | Uniform | Normal


class BenchRequest(msgspec.Struct, frozen=True):
    """One request to send: the prompt text and how many tokens to ask for."""

    prompt: str
    max_tokens: int
    prompt_tokens: int | None = None  # true token count when built against a tokenizer
    # A turn of this chat whose history is the server's own: the load generator sends, as
    # token ids, the chat's previous turn's prompt and answer followed by `prompt`.
    chat: int | None = None


class Workload(Protocol):
    """Anything that can produce a reproducible list of requests."""

    def sample(
        self, num_requests: int, seed: int, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> list[BenchRequest]: ...


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A Hugging Face tokenizer from a local folder, or a hub id (fetched once, as vLLM fetches the model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _clean_token_ids(tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """Ids of the vocabulary's ordinary tokens: not special, decoding alone to printable text.

    Byte-level tokens that are fragments of a UTF-8 character decode to U+FFFD, which
    re-encodes as several tokens and can stop a prompt from ever reaching its exact length.
    Sorted, so a seed picks the same ids whatever the order of the vocab's dict.
    """
    special = set(tokenizer.all_special_ids)
    ids = sorted(i for i in tokenizer.get_vocab().values() if i not in special)
    pieces = tokenizer.batch_decode([[i] for i in ids])
    clean = [i for i, p in zip(ids, pieces) if p and p.isprintable() and "\ufffd" not in p]
    if not clean:
        raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
    return np.array(clean)


class _TextMaker:
    """Makes text of a given length in tokens (with a tokenizer) or words (without)."""

    def __init__(self, rng: np.random.Generator, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self._rng = rng
        self._tokenizer = tokenizer
        if tokenizer is not None:
            self._allowed = _clean_token_ids(tokenizer)

    def text(self, length: int) -> str:
        if self._tokenizer is None:
            return " ".join(self._rng.choice(_WORDS, size=length).tolist())
        return self._exact_tokens(length)

    def count(self, text: str) -> int | None:
        """The text's token count, or None without a tokenizer to count with."""
        if self._tokenizer is None:
            return None
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def _exact_tokens(self, length: int) -> str:
        # Random ids rarely survive decode -> encode unchanged (merges across boundaries),
        # so re-encode and pad or trim until the round trip has the target length. vLLM's
        # `gen_prompt_decode_to_target_len` does this but pads with any vocabulary id, special
        # and byte-fragment ones included, and then misses the length (tried: the tiny model's
        # prompts missed their lengths in test_bench_workloads); here padding is clean ids only.
        tok = self._tokenizer
        ids = self._rng.choice(self._allowed, size=length).tolist()
        for _ in range(_MAX_LENGTH_FIXES):
            text = tok.decode(ids)
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == length:
                return text
            if len(ids) > length:
                ids = ids[:length]
            else:
                ids += self._rng.choice(self._allowed, size=length - len(ids)).tolist()
        return tok.decode(ids)


class RandomWorkload(msgspec.Struct, frozen=True, tag="random"):
    """Independent random prompts with input and output lengths from distributions."""

    input_len: LengthDist
    output_len: LengthDist

    def sample(
        self, num_requests: int, seed: int, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        maker = _TextMaker(rng, tokenizer)
        inputs = self.input_len.sample(rng, num_requests)
        outputs = self.output_len.sample(rng, num_requests)
        requests = []
        for n_in, n_out in zip(inputs, outputs):
            prompt = maker.text(n_in)
            requests.append(BenchRequest(prompt, n_out, maker.count(prompt)))
        return requests


class ConversationWorkload(msgspec.Struct, frozen=True, tag="conversation"):
    """Multi-turn chats sharing one system prompt, each turn resending the whole history.

    Every prompt starts with the same system prompt (a prefix shared across conversations),
    and turn k of a conversation extends turn k-1's prompt (a prefix shared within one).
    With `replies="synthetic"` the assistant replies in the history are synthetic text of
    the sampled reply length, not the server's answers, so the requests are whole before the
    run. With `replies="server"` each turn holds only its new text (`BenchRequest.chat` set):
    the load generator sends the chat's previous prompt and the server's answer to it as
    token ids, then this turn's, as a client that keeps the tokens it got does (an agent on
    vLLM's `return_token_ids`), so the answer's KV on the decode engine is the history's.
    Requests are
    ordered turn by turn (every conversation's first turn, then every second turn, ...), so a
    turn's prefix has been computed by the time it is sent; within a turn the conversations
    come in a new random order each time, as chats do not move in lockstep (in a fixed order,
    round robin over an even number of replicas would send each chat to the same one). With
    `order="staggered"` chat c's turn t comes at step 2t + c instead (ties in a random
    order): chats open one after another while the earlier ones go on, as on a service,
    where a router sees first turns among later ones, not all of them before any second.
    """

    turns: int
    system_len: int
    user_len: LengthDist
    reply_len: LengthDist  # max_tokens of each turn, and the length of its synthetic reply
    replies: Literal["synthetic", "server"] = "synthetic"
    order: Literal["turns", "staggered"] = "turns"

    def sample(
        self, num_requests: int, seed: int, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        maker = _TextMaker(rng, tokenizer)
        num_conversations = math.ceil(num_requests / self.turns)
        system = f"System: {maker.text(self.system_len)}\n"
        histories = [system] * num_conversations
        by_turn: list[list[BenchRequest]] = []
        for _ in range(self.turns):
            users = self.user_len.sample(rng, num_conversations)
            replies = self.reply_len.sample(rng, num_conversations)
            turn = []
            for c, (n_user, n_reply) in enumerate(zip(users, replies)):
                prompt = f"{histories[c]}User: {maker.text(n_user)}\nAssistant:"
                if self.replies == "server":
                    turn.append(BenchRequest(prompt, n_reply, chat=c))
                    histories[c] = "\n"  # what follows the answer, before the next user message
                    continue
                turn.append(BenchRequest(prompt, n_reply, maker.count(prompt)))
                histories[c] = f"{prompt} {maker.text(n_reply)}\n"
            by_turn.append(turn)
        if self.order == "staggered":
            steps = [(2 * t + c, tie, r) for t, turn in enumerate(by_turn)
                     for c, (r, tie) in enumerate(zip(turn, rng.random(len(turn))))]
            return [r for *_, r in sorted(steps, key=lambda s: s[:2])][:num_requests]
        return [turn[i] for turn in by_turn for i in rng.permutation(len(turn))][:num_requests]


class DatasetWorkload(msgspec.Struct, frozen=True, tag="dataset"):
    """Prompts from a JSON-lines file of {"prompt", "output_len"} records.

    The default file, bundled with Tandem, holds everyday assistant requests (coding, writing,
    summarizing, reasoning) with plausible answer lengths. Records are shuffled by the seed and
    reused in a new order once all have been taken.
    """

    path: str = str(DEFAULT_DATASET)
    output_len: LengthDist | None = None  # overrides the records' output_len when set

    def sample(
        self, num_requests: int, seed: int, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> list[BenchRequest]:
        records = load_dataset(self.path)
        rng = np.random.default_rng(seed)
        maker = _TextMaker(rng, tokenizer)
        order: list[int] = []
        while len(order) < num_requests:
            order += rng.permutation(len(records)).tolist()
        picked = [records[i] for i in order[:num_requests]]
        if self.output_len is None:
            outputs = [r.output_len for r in picked]
        else:
            outputs = self.output_len.sample(rng, num_requests)
        return [
            BenchRequest(r.prompt, n_out, maker.count(r.prompt))
            for r, n_out in zip(picked, outputs)
        ]


class DatasetRecord(msgspec.Struct, frozen=True):
    """One line of a prompt dataset file."""

    prompt: str
    output_len: int


def load_dataset(path: str | Path = DEFAULT_DATASET) -> list[DatasetRecord]:
    """All records of a JSON-lines prompt file."""
    decoder = msgspec.json.Decoder(DatasetRecord)
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = [decoder.decode(line) for line in lines if line.strip()]
    if not records:
        raise ValueError(f"no prompts in {path}")
    return records


WorkloadSpec = RandomWorkload | ConversationWorkload | DatasetWorkload
