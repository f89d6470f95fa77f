"""Lazy registry of KV connectors and fail-fast validation of kv_transfer configs.

A connector is named in config; its module is imported only when the name is resolved, so
listing or validating names never pulls in a connector's heavy dependencies until needed.
Tandem's own names live here; vLLM's built-in names (NixlConnector, MultiConnector,
OffloadingConnector, ...) are delegated to ``KVConnectorFactory`` so the two lists can never
drift apart. ``validate_kv_transfer_config`` runs on the driver, before any engine starts,
so a typo in a nested connector fails in milliseconds instead of inside an engine process.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.utils.func_utils import supports_kw

from connectors.config import TANDEM_CONNECTORS

_BASE_PATH = "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1"
# Keys vLLM's KVTransferConfig accepts; anything else fails when an engine builds it.
_KV_TRANSFER_KEYS = frozenset(f.name for f in dataclasses.fields(KVTransferConfig))


class ConnectorError(ValueError):
    """A connector name, module or config that no engine could load."""


class ConnectorSpec(msgspec.Struct, frozen=True):
    """Where a registered connector lives; imported only on resolution."""

    module_path: str  # dotted module that defines the class, e.g. "connectors.multi"
    class_name: str  # class inside that module


class _Registry:
    """Tandem's name -> ConnectorSpec table; vLLM's own names are looked up in vLLM."""

    def __init__(self) -> None:
        self._specs: dict[str, ConnectorSpec] = {}

    def register(self, name: str, module_path: str, class_name: str) -> None:
        if not name or not module_path or not class_name:
            raise ConnectorError(
                f"register_connector({name!r}, {module_path!r}, {class_name!r}): name, "
                "module path and class name must all be non-empty"
            )
        if name in self._specs or name in _vllm_names():
            owner = "Tandem" if name in self._specs else "vLLM"
            raise ConnectorError(
                f"connector {name!r} is already registered by {owner}; pick another name "
                "or load yours with kv_connector_module_path"
            )
        self._specs[name] = ConnectorSpec(module_path, class_name)

    def get(self, name: str) -> ConnectorSpec | None:
        return self._specs.get(name)

    def items(self) -> list[tuple[str, ConnectorSpec]]:
        return list(self._specs.items())


_REGISTRY = _Registry()


def _vllm_names() -> frozenset[str]:
    # vLLM keeps its lazy loaders in a class attribute; reading the keys imports nothing.
    return frozenset(KVConnectorFactory._registry)


def register_connector(name: str, module_path: str, class_name: str) -> None:
    """Register ``name`` -> ``module_path.class_name`` lazily; a taken name raises."""
    _REGISTRY.register(name, module_path, class_name)


def registered_names() -> list[str]:
    """Every name ``resolve_connector`` accepts without a module path, sorted."""
    return sorted({name for name, _ in _REGISTRY.items()} | _vllm_names())


def resolve_connector(name: str, module_path: str | None = None) -> type[KVConnectorBase_V1]:
    """Import and check the connector class that an engine would load for this config.

    An explicit ``module_path`` wins over a registered name (as in vLLM's factory), and
    then ``name`` is the class name inside it. Raises ConnectorError when the name is
    unknown, the module or class is missing, the class is not a KVConnectorBase_V1, or its
    constructor lacks vLLM's required third argument ``kv_cache_config``.
    """
    if not name:
        raise ConnectorError(
            "kv_connector is empty; set it to a registered connector "
            f"({', '.join(registered_names())}) or to a class name together with "
            "kv_connector_module_path"
        )
    if module_path is not None:
        if not module_path:
            raise ConnectorError(
                f"connector {name!r}: kv_connector_module_path is an empty string; remove "
                f"it to use the registered {name!r} or set it to the module defining {name}"
            )
        cls = _import_class(name, module_path, name)
        where = module_path
    elif (spec := _REGISTRY.get(name)) is not None:
        cls = _import_class(name, spec.module_path, spec.class_name)
        where = spec.module_path
    elif name in _vllm_names():
        where = "vLLM's built-in connectors"
        try:
            cls = KVConnectorFactory.get_connector_class_by_name(name)
        except ImportError as e:
            raise ConnectorError(
                f"connector {name!r} ({where}) failed to import: {e}; install the "
                "optional dependency it needs or choose another connector"
            ) from e
    else:
        raise ConnectorError(
            f"connector {name!r} is not registered (known: {', '.join(registered_names())}); "
            "fix the name, or set kv_connector_module_path to the module that defines it"
        )
    _check_class(name, where, cls)
    return cls


def _import_class(name: str, module_path: str, class_name: str) -> Any:
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_path == e.name or module_path.startswith(e.name + ".")):
            raise ConnectorError(
                f"connector {name!r}: module {module_path!r} not found; fix "
                "kv_connector_module_path or install the package that provides it"
            ) from e
        raise ConnectorError(
            f"connector {name!r}: module {module_path!r} imports {e.name!r}, which is not "
            "installed; install it on every node that runs an engine"
        ) from e
    except Exception as e:
        raise ConnectorError(
            f"connector {name!r}: importing module {module_path!r} raised "
            f"{type(e).__name__}: {e}; fix that module"
        ) from e
    try:
        return getattr(module, class_name)
    except AttributeError as e:
        raise ConnectorError(
            f"connector {name!r}: module {module_path!r} has no class {class_name!r}; "
            "fix the class name or the module path"
        ) from e


def _check_class(name: str, where: str, cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ConnectorError(
            f"connector {name!r} from {where}: {cls!r} is not a subclass of {_BASE_PATH}; "
            "vLLM can only load V1 KV connectors, so subclass it"
        )
    if not supports_kw(cls, "kv_cache_config"):
        raise ConnectorError(
            f"connector {name!r} from {where}: {cls.__name__}.__init__ uses the legacy "
            "2-argument signature; vLLM 0.32 requires __init__(self, vllm_config, role, "
            "kv_cache_config) passed on to super().__init__()"
        )


def is_multi_connector(cls: type[KVConnectorBase_V1]) -> bool:
    """Whether ``cls`` wraps child connectors listed in extra_config["connectors"]."""
    return issubclass(cls, MultiConnector)


def validate_kv_transfer_config(cfg: Mapping[str, Any], where: str = "kv_transfer") -> None:
    """Check a kv_transfer_config-like mapping the way an engine would load it, recursively.

    ``cfg`` has vLLM's keys (``kv_connector``, ``kv_connector_module_path``,
    ``kv_connector_extra_config``, ...). For a multi connector (vLLM's or Tandem's), every
    entry of ``kv_connector_extra_config["connectors"]`` is checked too; errors name the
    nested position, e.g. ``kv_transfer.connectors[1]``. Raises ConnectorError.
    """
    _check_keys(cfg, where)
    name = cfg.get("kv_connector")
    if not isinstance(name, str) or not name:
        raise ConnectorError(f"{where}: kv_connector is missing or empty; name a connector")
    module_path = cfg.get("kv_connector_module_path")
    if module_path is not None and not isinstance(module_path, str):
        raise ConnectorError(f"{where}: kv_connector_module_path must be a string")
    try:
        cls = resolve_connector(name, module_path)
    except ConnectorError as e:
        raise ConnectorError(f"{where}: {e}") from e
    if is_multi_connector(cls):
        for i, child in enumerate(child_configs(cfg, where)):
            validate_kv_transfer_config(child, f"{where}.connectors[{i}]")


def child_configs(cfg: Mapping[str, Any], where: str = "kv_transfer") -> list[Mapping[str, Any]]:
    """The child configs of a multi connector's config; a missing or empty list raises."""
    extra = cfg.get("kv_connector_extra_config") or {}
    if not isinstance(extra, Mapping):
        raise ConnectorError(f"{where}: kv_connector_extra_config must be a mapping")
    children = extra.get("connectors")
    if (
        not isinstance(children, Sequence)
        or isinstance(children, str)
        or not children
    ):
        raise ConnectorError(
            f"{where}: {cfg.get('kv_connector')} needs a non-empty list "
            'kv_connector_extra_config["connectors"] of child kv_transfer configs'
        )
    for i, child in enumerate(children):
        if not isinstance(child, Mapping):
            raise ConnectorError(
                f"{where}.connectors[{i}]: expected a mapping with kv_connector, got "
                f"{type(child).__name__}"
            )
    return list(children)


def _check_keys(cfg: Mapping[str, Any], where: str) -> None:
    if not isinstance(cfg, Mapping):
        raise ConnectorError(f"{where}: expected a mapping, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - _KV_TRANSFER_KEYS)
    if unknown:
        raise ConnectorError(
            f"{where}: unknown key(s) {unknown}; vLLM's KVTransferConfig accepts "
            f"{sorted(_KV_TRANSFER_KEYS)}"
        )


def supports_hma_config(cfg: Mapping[str, Any]) -> bool:
    """Whether an engine may keep vLLM's hybrid KV cache manager with this connector config.

    vLLM answers this itself only for its own "MultiConnector" name; for Tandem's multi
    connector the caller must set ``disable_hybrid_kv_cache_manager`` from this answer.
    """
    cls = resolve_connector(cfg["kv_connector"], cfg.get("kv_connector_module_path"))
    if is_multi_connector(cls):
        return all(supports_hma_config(child) for child in child_configs(cfg))
    return supports_hma(cls)


def register_in_vllm() -> None:
    """Make Tandem's registered names loadable by vLLM's factory in this process.

    Engines normally load Tandem's connectors through kv_connector_module_path; this is
    needed where vLLM resolves a *name* without a module path, e.g. a child of vLLM's own
    MultiConnector or its HMA check. Idempotent.
    """
    known = _vllm_names()
    for name, spec in _REGISTRY.items():
        if name not in known:
            KVConnectorFactory.register_connector(name, spec.module_path, spec.class_name)


for _name, _module in TANDEM_CONNECTORS.items():
    register_connector(_name, _module, _name)
