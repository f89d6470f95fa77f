"""The built-in tiny model: a random 2-layer Llama with a byte-level BPE tokenizer.

Generated locally (no hub access), deterministically, once per cache folder; tests,
`tandem serve` and benchmarks all reuse it. Outputs are gibberish but deterministic under
greedy decoding, which is what equality tests need.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

VERSION = "v1"
MAX_POSITION_EMBEDDINGS = 1024

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = (
    "the a an of to in on for with from by at as is was are were be been serve model token "
    "prefill decode cache block engine ray node cluster request stream prompt answer quick brown "
    "fox jumps over lazy dog data disaggregate transfer memory layer head batch queue router "
    "python system user assistant hello world one two three four five six seven eight nine ten"
).split()


def cache_dir() -> Path:
    """Where prepared models live: $TANDEM_CACHE, else ~/.cache/tandem."""
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def _corpus(num_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(num_lines)]


def _build(dest: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, seed=0), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True)


def prepare_tiny_model(root: Path | None = None) -> Path:
    """Return the tiny model's folder, generating it first if this cache has none.

    Safe to call from several processes at once: one builds under a file lock into a
    temporary folder that is renamed into place, the others wait and reuse it.
    """
    root = root or cache_dir()
    dest = root / f"tiny-llama-{VERSION}"
    if (dest / "config.json").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".tiny-llama-{VERSION}.lock")):
        if (dest / "config.json").is_file():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
        try:
            _build(tmp)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
