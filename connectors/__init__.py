"""Everything that plugs into vLLM's KV-connector API; the registry is the public surface."""

from connectors.registry import (
    ConnectorError,
    register_connector,
    resolve_connector,
    validate_kv_transfer_config,
)

__all__ = [
    "ConnectorError",
    "register_connector",
    "resolve_connector",
    "validate_kv_transfer_config",
]
