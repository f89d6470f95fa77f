"""Checks a config against the outside world before anything starts.

`tandem validate` and every deployment run these: the model is where the config says, the
engine args are real vLLM args, and every connector (nested ones included) imports and
has the constructor vLLM requires. Each failure is a ConfigError naming the field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from orchestrator.config import BUILTIN_MODELS, BUILTIN_PREFIX, ConfigError, TandemConfig
from orchestrator.models import looks_like_path


def check_model(cfg: TandemConfig) -> None:
    source = cfg.model.source
    if source.startswith(BUILTIN_PREFIX) and source.removeprefix(BUILTIN_PREFIX) not in BUILTIN_MODELS:
        known = ", ".join(BUILTIN_PREFIX + m for m in BUILTIN_MODELS)
        raise ConfigError(f"`model.source`: unknown built-in model {source!r}; fix: use one of {known}, a local folder or a hub id")
    if looks_like_path(source):
        folder = Path(source).expanduser()
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"`model.source`: {source!r} is not a model folder (no config.json in {str(folder.resolve())!r}); "
                "fix: point it at a folder saved with save_pretrained, or use a hub id"
            )


def check_engine_args(cfg: TandemConfig) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for where, args in cfg._engine_arg_sets():
        for key in args:
            if key not in known:
                close = sorted(k for k in known if k.split("_")[0] == key.split("_")[0])[:5]
                hint = f"; did you mean one of {close}?" if close else ""
                raise ConfigError(f"`{where}.{key}` is not a vLLM engine argument{hint} fix: remove it or use an AsyncEngineArgs field name")


def check_pools(cfg: TandemConfig) -> None:
    for role, pool in cfg.pools.items():
        if cfg.device == "cuda" and pool.num_gpus < pool.tensor_parallel_size:
            raise ConfigError(
                f"`{'colocated' if role == 'both' else role}.num_gpus` is {pool.num_gpus} but tensor_parallel_size is "
                f"{pool.tensor_parallel_size}; fix: reserve one GPU per TP rank"
            )


def check_connectors(cfg: TandemConfig) -> None:
    from connectors.nixl import TandemNixlConnector
    from connectors.registry import ConnectorError, resolve_connector, validate_kv_transfer_config
    from orchestrator.specs import kv_transfer_for

    for role in cfg.pools:
        kv = kv_transfer_for(cfg, role)  # type: ignore[arg-type]
        if kv is None:
            continue
        try:
            validate_kv_transfer_config(kv, where="kv_transfer")
        except ConnectorError as err:
            raise ConfigError(str(err)) from None
    name = cfg.kv_transfer.connector
    if "prefill" in cfg.pools and cfg.routing.first_token == "prefill" and not issubclass(
        resolve_connector(name, cfg.kv_transfer.module_path), TandemNixlConnector
    ):
        # The decode request is the prompt plus the prefill's token; only Tandem's NIXL
        # scheduler pulls just the prefilled tokens (vLLM's refuses at a block boundary).
        raise ConfigError(
            f"`routing.first_token`: 'prefill' needs kv_transfer.connector TandemNixlConnector or a subclass, "
            f"which pulls just the tokens the prefill computed; {name!r} would claim the prefill's token too. "
            "fix: set routing.first_token: decode, or use TandemNixlConnector"
        )


def check_openai_args(cfg: TandemConfig) -> None:
    """The ingress's `vllm serve` front-end flags parse (a bad one would fail every replica)."""
    from orchestrator.openai_app import parse_frontend_args

    parse_frontend_args(cfg, cfg.model.source)


def preflight(cfg: TandemConfig) -> None:
    """Every check, cheapest first; raises ConfigError on the first problem."""
    check_model(cfg)
    check_pools(cfg)
    check_engine_args(cfg)
    check_openai_args(cfg)
    check_connectors(cfg)
