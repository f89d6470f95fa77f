"""The built-in models: random Llamas with a byte-level BPE tokenizer, generated locally.

`builtin:tiny` (2 layers, hidden 128) is what tests, `tandem serve` and most benchmarks run:
its steps cost almost nothing, so it measures the serving path. `builtin:small` (6 layers,
hidden 384, 2k context) makes a prefill cost real time on a CPU, which routing benchmarks
need: there a prefix-cache hit must save something. `builtin:medium` (8 layers, hidden 512)
makes that cost grow mostly with the tokens computed rather than with a step's fixed part, as
a served model's prefill does on a GPU (the long-chat routing benchmark). All are generated
deterministically (no hub access) once per cache folder. Outputs are gibberish but
deterministic under greedy decoding, which is what equality tests need.

The tiny model is float16, the others bfloat16. vLLM 0.32's CPU attention takes its AMX
kernel for bfloat16 on hosts with AMX, and on such a host (a Xeon with AMX tiles, 2026-12-01)
that kernel died of SIGILL on its first `tilezero` for the tiny model and for every shape
tried up to hidden 256, from any engine: vLLM offline, colocated, 1P1D. At hidden 384-512
(small, medium) it runs. float16 takes vLLM's vector kernel on every x86 host, with the same
two bytes per KV element, so every figure in KV bytes stays as it was.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

MAX_POSITION_EMBEDDINGS = 1024

# Each built-in model's folder is named with its version: a change of shape or dtype gets a
# new version, so a cache made by an older Tandem is never taken for the new model.
VERSIONS: dict[str, str] = {"tiny": "v2", "small": "v1", "medium": "v1"}
# The dtype its weights are saved in, which vLLM serves it in (module docstring).
DTYPES: dict[str, str] = {"tiny": "float16", "small": "bfloat16", "medium": "bfloat16"}

# Llama shapes of the built-in models, by the name after "builtin:".
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": MAX_POSITION_EMBEDDINGS},
    "small": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
              "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 2048},
    "medium": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
               "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 2048},
}

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


def _build(dest: Path, shape: dict[str, int], dtype: str) -> None:
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
        **shape,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype=dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(dest, safe_serialization=True)


def prepare_tiny_model(root: Path | None = None) -> Path:
    return prepare_builtin_model("tiny", root)


def prepare_builtin_model(name: str, root: Path | None = None) -> Path:
    """Return built-in model `name`'s folder, generating it first if this cache has none.

    Safe to call from several processes at once: one builds under a file lock into a
    temporary folder that is renamed into place, the others wait and reuse it.
    """
    shape = SHAPES[name]
    root = root or cache_dir()
    version = VERSIONS[name]
    dest = root / f"{name}-llama-{version}"
    if (dest / "config.json").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{name}-llama-{version}.lock")):
        if (dest / "config.json").is_file():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            _build(tmp, shape, DTYPES[name])
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
