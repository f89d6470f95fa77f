"""Specification of connectors.plugin: vLLM loads it, and it changes the worker start method
in a Tandem engine's engine core only (never in a Ray worker, never outside Tandem)."""

from __future__ import annotations

import os

import pytest
import ray

from connectors.config import ENGINE_MARK
from connectors.plugin import START_METHOD, register


def test_vllm_finds_the_plugin_and_every_engine_tandem_starts_carries_the_mark() -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    from orchestrator.config import parse_config
    from orchestrator.placement import EngineSlot
    from orchestrator.specs import engine_env

    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["tandem"] is register
    slot = EngineSlot(node_id="n", node_ip="10.0.0.7", model_path="/m", side_channel_port=5600, cpu_binding=None, cores=None)
    for cfg in (parse_config({}), parse_config({"colocated": {}})):
        assert engine_env(cfg, slot)[ENGINE_MARK] == "1"


@pytest.mark.parametrize(("mark", "expected"), [("1", "fork"), (None, "spawn")])
def test_an_engine_core_of_tandems_forks_its_workers_any_other_process_keeps_vllms_choice(
    monkeypatch: pytest.MonkeyPatch, mark: str | None, expected: str
) -> None:
    # As vLLM leaves it in an engine core spawned from a Ray actor.
    monkeypatch.setenv(START_METHOD, "spawn")
    if mark is None:
        monkeypatch.delenv(ENGINE_MARK, raising=False)
    else:
        monkeypatch.setenv(ENGINE_MARK, mark)
    assert not ray.is_initialized()
    register()
    assert os.environ[START_METHOD] == expected


@ray.remote(num_cpus=0, runtime_env={"env_vars": {ENGINE_MARK: "1", START_METHOD: "spawn"}})
def start_method_after_the_plugin() -> str | None:
    register()
    return os.environ.get(START_METHOD)


def test_a_ray_worker_keeps_spawning_even_in_a_tandem_engines_environment(ray_local: None) -> None:
    """The engine actor itself carries the mark (its engine core inherits it), but a process
    in Ray must not fork."""
    assert ray.get(start_method_after_the_plugin.remote(), timeout=120) == "spawn"
