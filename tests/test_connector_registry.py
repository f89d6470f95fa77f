"""Specification of connectors.registry: lazy name resolution and fail-fast config checks."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

from connectors.registry import (
    ConnectorError,
    register_connector,
    register_in_vllm,
    registered_names,
    resolve_connector,
    supports_hma_config,
    validate_kv_transfer_config,
)

HERE = __name__  # fakes below are loaded back through the registry by this module path


class GoodConnector(KVConnectorBase_V1):
    """Minimal valid out-of-tree connector with the required 3-argument constructor."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...
    def wait_for_save(self) -> None: ...

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class LegacyConnector(GoodConnector):
    """Pre-0.12 connector: no kv_cache_config argument."""

    def __init__(self, vllm_config: Any, role: Any) -> None:  # type: ignore[override]
        super().__init__(vllm_config, role, None)


class ExampleConnector(GoodConnector):
    """Shares its name with a connector registered in vLLM."""


class NotAConnector:
    """Has the right constructor but is no KVConnectorBase_V1."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None: ...


def entry(name: str, module_path: str | None = HERE, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"kv_connector": name, "kv_role": "kv_both", **extra}
    if module_path is not None:
        cfg["kv_connector_module_path"] = module_path
    return cfg


def multi(name: str, children: Any, module_path: str | None = None) -> dict[str, Any]:
    return entry(name, module_path, kv_connector_extra_config={"connectors": children})


# ---- resolve_connector ----


def test_tandem_multi_connector_is_preregistered() -> None:
    from connectors.multi import TandemMultiConnector

    assert resolve_connector("TandemMultiConnector") is TandemMultiConnector


def test_vllm_builtin_names_resolve_through_vllm() -> None:
    assert resolve_connector("NixlConnector") is NixlConnector
    assert resolve_connector("MultiConnector") is MultiConnector
    assert {"NixlConnector", "MultiConnector", "OffloadingConnector"} <= set(registered_names())


def test_explicit_module_path_wins_over_registered_name() -> None:
    assert resolve_connector("ExampleConnector", HERE) is ExampleConnector
    assert resolve_connector("ExampleConnector") is not ExampleConnector


def test_duplicate_registration_is_refused() -> None:
    register_connector("DuplicateOnce", HERE, "GoodConnector")
    with pytest.raises(ConnectorError, match="'DuplicateOnce' is already registered by Tandem"):
        register_connector("DuplicateOnce", HERE, "GoodConnector")


def test_registering_a_vllm_name_is_refused() -> None:
    with pytest.raises(ConnectorError, match="'NixlConnector' is already registered by vLLM"):
        register_connector("NixlConnector", HERE, "GoodConnector")


def test_registered_name_resolves_lazily_to_its_class() -> None:
    register_connector("LazyGood", HERE, "GoodConnector")
    assert resolve_connector("LazyGood") is GoodConnector


def test_empty_module_path_is_an_error() -> None:
    with pytest.raises(ConnectorError, match="'NixlConnector'.*empty string.*remove it"):
        resolve_connector("NixlConnector", "")


def test_empty_name_is_an_error() -> None:
    with pytest.raises(ConnectorError, match="kv_connector is empty"):
        resolve_connector("")


def test_unknown_name_without_module_path_is_an_error() -> None:
    with pytest.raises(ConnectorError, match="'NoSuchConnector' is not registered.*module_path"):
        resolve_connector("NoSuchConnector")


def test_missing_module_is_an_error_naming_connector_and_module() -> None:
    with pytest.raises(
        ConnectorError, match="'GoodConnector': module 'no_such_pkg.conn' not found; fix"
    ):
        resolve_connector("GoodConnector", "no_such_pkg.conn")


def test_missing_class_is_an_error_naming_module() -> None:
    with pytest.raises(ConnectorError, match=f"'Missing': module '{HERE}' has no class 'Missing'"):
        resolve_connector("Missing", HERE)


def test_class_that_is_not_a_kv_connector_is_an_error() -> None:
    with pytest.raises(ConnectorError, match="'NotAConnector'.*not a subclass of.*KVConnectorBase_V1"):
        resolve_connector("NotAConnector", HERE)


def test_legacy_two_argument_constructor_is_an_error() -> None:
    with pytest.raises(ConnectorError, match="'LegacyConnector'.*legacy 2-argument.*kv_cache_config"):
        resolve_connector("LegacyConnector", HERE)


# ---- validate_kv_transfer_config ----


def test_valid_single_connector_config_passes() -> None:
    validate_kv_transfer_config(entry("GoodConnector"))
    validate_kv_transfer_config(entry("NixlConnector", None))


def test_valid_nested_multi_config_passes() -> None:
    inner = multi("MultiConnector", [entry("GoodConnector"), entry("NixlConnector", None)])
    validate_kv_transfer_config(multi("TandemMultiConnector", [inner, entry("GoodConnector")]))


def test_error_in_child_names_its_position() -> None:
    cfg = multi("TandemMultiConnector", [entry("GoodConnector"), entry("LegacyConnector")])
    with pytest.raises(ConnectorError, match=r"^kv_transfer\.connectors\[1\]: .*legacy"):
        validate_kv_transfer_config(cfg)


def test_error_in_nested_multi_child_names_full_path() -> None:
    inner = multi("MultiConnector", [entry("GoodConnector"), entry("Missing")])
    cfg = multi("TandemMultiConnector", [entry("GoodConnector"), inner])
    with pytest.raises(ConnectorError, match=r"^engine\.connectors\[1\]\.connectors\[1\]: "):
        validate_kv_transfer_config(cfg, where="engine")


@pytest.mark.parametrize("name", ["TandemMultiConnector", "MultiConnector"])
@pytest.mark.parametrize("children", [None, []])
def test_multi_connector_without_children_is_an_error(name: str, children: Any) -> None:
    with pytest.raises(ConnectorError, match=r'non-empty list kv_connector_extra_config\["connectors"\]'):
        validate_kv_transfer_config(multi(name, children))


def test_child_that_is_not_a_mapping_is_an_error() -> None:
    with pytest.raises(ConnectorError, match=r"connectors\[0\]: expected a mapping"):
        validate_kv_transfer_config(multi("TandemMultiConnector", ["NixlConnector"]))


def test_missing_kv_connector_key_is_an_error() -> None:
    with pytest.raises(ConnectorError, match="kv_transfer: kv_connector is missing"):
        validate_kv_transfer_config({"kv_role": "kv_both"})


def test_unknown_key_is_an_error_listing_valid_keys() -> None:
    with pytest.raises(ConnectorError, match=r"unknown key\(s\) \['kv_conector'\].*accepts"):
        validate_kv_transfer_config({"kv_connector": "NixlConnector", "kv_conector": "x"})


# ---- vLLM integration ----


def test_vllm_factory_loads_tandem_multi_connector_by_module_path() -> None:
    from connectors.multi import TandemMultiConnector

    ktc = KVTransferConfig(
        kv_connector="TandemMultiConnector",
        kv_connector_module_path="connectors.multi",
        kv_role="kv_both",
    )
    assert KVConnectorFactory.get_connector_class(ktc) is TandemMultiConnector


def test_register_in_vllm_makes_tandem_names_loadable_by_name() -> None:
    from connectors.multi import TandemMultiConnector

    register_in_vllm()
    register_in_vllm()  # idempotent
    assert KVConnectorFactory.get_connector_class_by_name("TandemMultiConnector") is (
        TandemMultiConnector
    )


def test_hma_support_requires_every_child_to_support_it() -> None:
    assert supports_hma_config(entry("NixlConnector", None))
    assert not supports_hma_config(entry("GoodConnector"))
    both = [entry("NixlConnector", None), entry("OffloadingConnector", None)]
    assert supports_hma_config(multi("TandemMultiConnector", both))
    assert not supports_hma_config(
        multi("TandemMultiConnector", [entry("NixlConnector", None), entry("GoodConnector")])
    )


def test_module_whose_dependency_is_missing_names_the_dependency(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "needs_missing_dep.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConnectorError, match="'needs_missing_dep' imports 'no_such_dependency', which is not installed"
    ):
        resolve_connector("Conn", "needs_missing_dep")
