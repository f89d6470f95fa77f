"""Turning `model.source` into something vLLM and the tokenizer can open, on any node."""

from __future__ import annotations

from pathlib import Path

from orchestrator.config import BUILTIN_PREFIX


def looks_like_path(source: str) -> bool:
    """A source naming a local folder (as opposed to a hub id like org/name)."""
    return source.startswith(("/", "./", "../", "~")) or Path(source).expanduser().is_dir()


def hub_env(source: str) -> dict[str, str]:
    """Environment for processes opening `source`: a builtin model is already on disk, so
    Hugging Face libraries must not try the hub (hosts without internet would wait on it);
    any other source may need a download, so nothing is forced."""
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"} if source.startswith("builtin:") else {}


def resolve_local(source: str) -> str:
    """The local folder (or hub id) for `source` on this machine, preparing a built-in model once."""
    if source.startswith(BUILTIN_PREFIX):
        from orchestrator.tiny_model import prepare_builtin_model

        return str(prepare_builtin_model(source.removeprefix(BUILTIN_PREFIX)))
    if looks_like_path(source):
        return str(Path(source).expanduser().resolve())
    return source
