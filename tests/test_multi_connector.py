"""Specification of TandemMultiConnector, driven the way vLLM's scheduler and workers call it.

Children are fake connectors defined here and loaded back through the registry by this
module's path, so the tests exercise the same resolution an engine does.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from actors.protocol import ChildCounters, parse_stats
from connectors.multi import TandemMultiConnector, TandemMultiStats
from connectors.registry import ConnectorError

HERE = __name__
SCHEDULER, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER
KV_CACHE_CONFIG = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[])


class FakeMeta(KVConnectorMetadata):
    pass


class FakeStats(KVConnectorStats):
    def is_empty(self) -> bool:
        return not self.data


class FakeChild(KVConnectorBase_V1):
    """Scriptable child: tests set its answers and read back what it was asked."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.kv_cache_config = kv_cache_config
        self.matched: int | None = extra.get("matched", 0)
        self.load_async: bool = extra.get("load_async", False)
        self.async_save: bool = extra.get("async_save", False)
        self.fail_shutdown: bool = extra.get("fail_shutdown", False)
        self.lookups = 0
        self.allocs: list[tuple[str, int]] = []
        self.saved_layers: list[str] = []
        self.save_waits = 0
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.load_errors: set[int] = set()
        self.stats: KVConnectorStats | None = None
        self.shut_down = False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        assert vllm_config.kv_transfer_config is not None
        return vllm_config.kv_transfer_config.kv_connector_extra_config.get("layout")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.lookups += 1
        return self.matched, self.load_async and bool(self.matched)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.allocs.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return FakeMeta()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.async_save, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.saved_layers.append(layer_name)

    def wait_for_save(self) -> None:
        self.save_waits += 1

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults(finished_sending=self.sending, finished_recving=self.recving)
        self.sending, self.recving = set(), set()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats, self.stats = self.stats, None
        return stats

    def shutdown(self) -> None:
        self.shut_down = True
        if self.fail_shutdown:
            raise RuntimeError(f"{type(self).__name__} failed to shut down")


class Alpha(FakeChild):
    pass


class Beta(FakeChild):
    pass


class Gamma(FakeChild):
    pass


def child(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": name,
        "kv_connector_module_path": HERE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def make_config(children: list[dict[str, Any]], hma: bool = False) -> VllmConfig:
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="TandemMultiConnector",
            kv_connector_module_path="connectors.multi",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": children},
        )
    )
    config.scheduler_config.disable_hybrid_kv_cache_manager = not hma
    return config


def make(children: list[dict[str, Any]], role: KVConnectorRole = SCHEDULER) -> TandemMultiConnector:
    return TandemMultiConnector(make_config(children), role, KV_CACHE_CONFIG)


def kids(connector: TandemMultiConnector) -> list[FakeChild]:
    return [c for c in connector.sub_connectors if isinstance(c, FakeChild)]


def request(req_id: str = "r1") -> Any:
    return SimpleNamespace(request_id=req_id)


def blocks(*block_ids: int) -> KVCacheBlocks:
    return KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in block_ids],))


def counters(connector: TandemMultiConnector) -> dict[str, dict[str, int]]:
    """Non-zero counters per child from one stats report."""
    stats = connector.get_kv_connector_stats()
    assert stats is not None
    return {
        name: {k: v for k, v in msgspec.structs.asdict(c).items() if v}
        for name, c in parse_stats(stats.to_dict()).children.items()
    }


def fail_async_load(connector: TandemMultiConnector, req_id: str = "r1") -> None:
    """What the scheduler hands over when a worker reports a request's async load failed."""
    connector.update_connector_output(
        KVConnectorOutput(finished_recving={req_id}, failed_recving={req_id})
    )


# ---- construction ----


def test_children_are_built_through_the_registry_with_three_arguments() -> None:
    connector = make([child("Alpha", matched=8), child("Beta")], role=WORKER)
    alpha, beta = kids(connector)
    assert (type(alpha), type(beta)) == (Alpha, Beta)
    assert alpha.role is WORKER and alpha.kv_cache_config is KV_CACHE_CONFIG
    assert alpha.matched == 8  # each child sees its own kv_transfer_config


def test_child_that_cannot_be_resolved_is_named_by_position() -> None:
    with pytest.raises(ConnectorError, match=r"kv_transfer\.connectors\[1\]: .*no class 'Nope'"):
        make([child("Alpha"), child("Nope")])


def test_hybrid_kv_cache_manager_with_a_child_lacking_it_is_rejected_with_the_fix() -> None:
    with pytest.raises(ConnectorError, match="disable_hybrid_kv_cache_manager=True"):
        TandemMultiConnector(make_config([child("Alpha")], hma=True), SCHEDULER, KV_CACHE_CONFIG)


def test_children_requiring_different_layouts_are_rejected() -> None:
    config = make_config([child("Alpha", layout="HND"), child("Beta", layout="NHD")])
    with pytest.raises(ConnectorError, match="'Alpha': 'HND', 'Beta': 'NHD'"):
        TandemMultiConnector.get_required_kvcache_layout(config)


def test_the_layout_children_agree_on_is_required() -> None:
    config = make_config([child("Alpha", layout="HND"), child("Beta"), child("Gamma", layout="HND")])
    assert TandemMultiConnector.get_required_kvcache_layout(config) == "HND"


# ---- load: first match, not yet ----


def test_loads_from_the_first_child_with_matched_tokens_in_config_order() -> None:
    connector = make([child("Alpha"), child("Beta", matched=8, load_async=True), child("Gamma", matched=16)])
    assert connector.get_num_new_matched_tokens(request(), 0) == (8, True)
    connector.update_state_after_alloc(request(), blocks(1, 2), 8)
    assert [k.allocs for k in kids(connector)] == [[("r1", 0)], [("r1", 8)], [("r1", 0)]]


def test_not_yet_while_any_child_is_still_looking_up() -> None:
    connector = make([child("Alpha", matched=16), child("Beta", matched=None)])
    assert connector.get_num_new_matched_tokens(request(), 0) == (None, False)


def test_no_child_with_tokens_means_nothing_to_load() -> None:
    connector = make([child("Alpha"), child("Beta")])
    assert connector.get_num_new_matched_tokens(request(), 0) == (0, False)


# ---- save ----


def test_saves_fan_out_to_every_child() -> None:
    connector = make([child("Alpha"), child("Beta")], role=WORKER)
    connector.save_kv_layer("layer.0", None, None)  # type: ignore[arg-type]
    connector.wait_for_save()
    assert [(k.saved_layers, k.save_waits) for k in kids(connector)] == [(["layer.0"], 1)] * 2


def test_request_finishes_sending_only_when_every_async_saving_child_has() -> None:
    children = [child("Alpha", async_save=True), child("Beta", async_save=True), child("Gamma")]
    scheduler, worker = make(children), make(children, role=WORKER)
    assert scheduler.request_finished(request(), [1, 2]) == (True, None)
    worker.bind_connector_metadata(scheduler.build_connector_meta(None))  # type: ignore[arg-type]
    alpha, beta, _ = kids(worker)
    alpha.sending = {"r1"}
    assert worker.get_finished({"r1"}) == (None, None)
    beta.sending = {"r1"}
    assert worker.get_finished(set()) == ({"r1"}, None)


def test_finished_loads_and_load_error_blocks_are_aggregated() -> None:
    connector = make([child("Alpha"), child("Beta")], role=WORKER)
    alpha, beta = kids(connector)
    alpha.recving, beta.recving = {"r1"}, {"r2"}
    alpha.load_errors, beta.load_errors = {1, 2}, {2, 7}
    assert connector.get_finished(set()) == (None, {"r1", "r2"})
    assert connector.get_block_ids_with_load_errors() == {1, 2, 7}
    assert counters(connector) == {"Alpha": {"load_error_blocks": 2}, "Beta": {"load_error_blocks": 2}}


def test_shutdown_reaches_every_child_and_reraises_a_failure() -> None:
    connector = make([child("Alpha", fail_shutdown=True), child("Beta"), child("Gamma")])
    with pytest.raises(RuntimeError, match="Alpha failed to shut down"):
        connector.shutdown()
    assert [k.shut_down for k in kids(connector)] == [True, True, True]


# ---- load fallback ----


def test_failed_async_load_falls_back_to_the_next_child_with_tokens() -> None:
    connector = make([child("Alpha", matched=16, load_async=True), child("Beta", matched=16)])
    alpha, beta = kids(connector)
    assert connector.get_num_new_matched_tokens(request(), 0) == (16, True)
    connector.update_state_after_alloc(request(), blocks(1, 2, 3, 4), 16)
    fail_async_load(connector)
    # vLLM re-admits the request with num_computed_tokens == 0 and asks again.
    assert connector.get_num_new_matched_tokens(request(), 0) == (16, False)
    connector.update_state_after_alloc(request(), blocks(5, 6, 7, 8), 16)
    assert (alpha.lookups, beta.lookups) == (1, 2)
    assert (alpha.allocs[-1], beta.allocs[-1]) == (("r1", 0), ("r1", 16))
    assert counters(connector) == {
        "Alpha": {"hits": 1, "tokens_loaded": 16, "load_failures": 1, "fallbacks": 1},
        "Beta": {"hits": 1, "tokens_loaded": 16},
    }


def test_invalid_blocks_are_traced_to_the_request_and_child_that_loaded_them() -> None:
    connector = make([child("Alpha", matched=16), child("Beta", matched=16)])
    connector.get_num_new_matched_tokens(request(), 0)
    connector.update_state_after_alloc(request(), blocks(1, 2, 3, 4), 16)
    connector.update_connector_output(KVConnectorOutput(invalid_block_ids={3}))
    assert connector.get_num_new_matched_tokens(request(), 0) == (16, False)
    assert [k.lookups for k in kids(connector)] == [1, 2]


def test_invalid_blocks_of_other_requests_do_not_cause_a_fallback() -> None:
    connector = make([child("Alpha", matched=16), child("Beta", matched=16)])
    connector.get_num_new_matched_tokens(request(), 0)
    connector.update_state_after_alloc(request(), blocks(1, 2), 16)
    connector.update_connector_output(KVConnectorOutput(invalid_block_ids={9}))
    connector.get_num_new_matched_tokens(request(), 0)
    assert [k.lookups for k in kids(connector)] == [2, 2]
    assert counters(connector) == {"Alpha": {"hits": 1, "tokens_loaded": 16}}


def test_failed_load_with_no_other_child_falls_back_to_recompute() -> None:
    connector = make([child("Alpha", matched=16, load_async=True), child("Beta")])
    connector.get_num_new_matched_tokens(request(), 0)
    connector.update_state_after_alloc(request(), blocks(1, 2), 16)
    fail_async_load(connector)
    assert connector.get_num_new_matched_tokens(request(), 0) == (0, False)
    connector.update_state_after_alloc(request(), blocks(3, 4), 0)
    assert [k.allocs[-1] for k in kids(connector)] == [("r1", 0), ("r1", 0)]
    assert counters(connector) == {
        "Alpha": {"hits": 1, "tokens_loaded": 16, "load_failures": 1, "recomputes": 1},
    }


def test_a_second_failure_skips_both_failed_children() -> None:
    connector = make([child(n, matched=16, load_async=True) for n in ("Alpha", "Beta", "Gamma")])
    for expected in ("Alpha", "Beta"):
        connector.get_num_new_matched_tokens(request(), 0)
        connector.update_state_after_alloc(request(), blocks(1, 2), 16)
        fail_async_load(connector)
    assert connector.get_num_new_matched_tokens(request(), 0) == (16, True)
    assert [k.lookups for k in kids(connector)] == [1, 2, 3]


def test_fallback_state_is_dropped_when_the_request_finishes() -> None:
    connector = make([child("Alpha", matched=16, load_async=True), child("Beta")])
    connector.get_num_new_matched_tokens(request(), 0)
    connector.update_state_after_alloc(request(), blocks(1, 2), 16)
    fail_async_load(connector)
    connector.request_finished(request(), [1, 2])
    assert connector.get_num_new_matched_tokens(request(), 0) == (16, True)


def test_failures_of_requests_it_did_not_route_are_ignored() -> None:
    connector = make([child("Alpha", matched=16), child("Beta")])
    connector.update_connector_output(KVConnectorOutput(failed_recving={"other"}))
    assert connector.get_kv_connector_stats() is None


def test_repeated_lookups_before_admission_count_one_hit() -> None:
    connector = make([child("Alpha", matched=16)])
    for _ in range(3):  # the scheduler may ask several times before it admits
        connector.get_num_new_matched_tokens(request(), 0)
    connector.update_state_after_alloc(request(), blocks(1), 16)
    connector.update_state_after_alloc(request(), blocks(1, 2), 0)  # async load's 2nd call
    assert counters(connector) == {"Alpha": {"hits": 1, "tokens_loaded": 16}}


# ---- per-child stats ----


def test_bytes_and_tokens_reported_by_children_are_counted_per_child() -> None:
    connector = make([child("Alpha"), child("Beta")], role=WORKER)
    alpha, beta = kids(connector)
    alpha.stats = FakeStats(data={"bytes_loaded": 100, "bytes_saved": 50, "tokens_saved": 32})
    nixl = NixlKVConnectorStats()
    for num_bytes in (10, 20):
        nixl.record_transfer(
            SimpleNamespace(xferDuration=1, postDuration=1, totalBytes=num_bytes, descCount=1)
        )
    beta.stats = nixl
    assert counters(connector) == {
        "Alpha": {"bytes_loaded": 100, "bytes_saved": 50, "tokens_saved": 32},
        "Beta": {"bytes_loaded": 30},
    }


def test_nixl_child_transfers_reach_engine_stats_like_nixl_alone() -> None:
    from actors.engine import _observe_connector_stats
    from actors.protocol import EngineStats

    def nixl_stats(*durations: float) -> NixlKVConnectorStats:
        nixl = NixlKVConnectorStats()
        for d in durations:
            nixl.record_transfer(
                SimpleNamespace(xferDuration=d * 1e6, postDuration=1, totalBytes=1000, descCount=1)
            )
        return nixl

    # Two workers' reports, aggregated and serialised the way vLLM does it.
    connector = make([child("Alpha"), child("Beta")], role=WORKER)
    nixl, _ = kids(connector)
    nixl.stats = nixl_stats(0.004, 2.5)
    first = connector.get_kv_connector_stats()
    nixl.stats = nixl_stats(0.02)
    second = connector.get_kv_connector_stats()
    assert first is not None and second is not None and not first.is_empty()
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(first.aggregate(second).to_dict()))
    assert connector.get_kv_connector_stats() is None

    alone, under_multi = EngineStats(engine_id="a", role="decode"), EngineStats(engine_id="b", role="decode")
    _observe_connector_stats(alone, nixl_stats(0.004, 2.5, 0.02).to_dict(), slow_s=1.0)
    _observe_connector_stats(under_multi, TandemMultiConnector.build_kv_connector_stats(wire).to_dict(), slow_s=1.0)
    assert under_multi.transfers == alone.transfers
    t = under_multi.transfers
    assert (t.num_transfers, t.bytes, t.num_slow, t.max_seconds) == (3, 3000, 1, 2.5)
    assert sum(t.bucket_counts) == 3
    assert under_multi.connector_counters["Alpha"]["bytes_loaded"] == 3000


def test_stats_are_reset_after_each_report() -> None:
    connector = make([child("Alpha", matched=16)])
    connector.get_num_new_matched_tokens(request(), 0)
    connector.update_state_after_alloc(request(), blocks(1), 16)
    assert connector.get_kv_connector_stats() is not None
    assert connector.get_kv_connector_stats() is None


def test_repeated_child_names_are_told_apart_by_position() -> None:
    connector = make([child("Alpha"), child("Alpha", matched=8)])
    connector.get_num_new_matched_tokens(request(), 0)
    connector.update_state_after_alloc(request(), blocks(1), 8)
    assert counters(connector) == {"Alpha#1": {"hits": 1, "tokens_loaded": 8}}


def test_stats_survive_serialisation_and_aggregate_like_vllm_does() -> None:
    connector = make([child("Alpha", matched=16), child("Beta")])
    for req_id in ("r1", "r2"):
        connector.get_num_new_matched_tokens(request(req_id), 0)
        connector.update_state_after_alloc(request(req_id), blocks(1), 16)
    scheduler_stats = connector.get_kv_connector_stats()
    worker_stats = TandemMultiStats(data={"children": {"Beta": {"bytes_saved": 64}}})
    # Scheduler: worker stats aggregated with scheduler stats, then sent as a dict.
    wire = msgspec.msgpack.encode(worker_stats.aggregate(scheduler_stats).to_dict())  # type: ignore[arg-type]
    assert msgspec.msgpack.decode(wire) == {
        "children": {
            "Alpha": msgspec.structs.asdict(ChildCounters(hits=2, tokens_loaded=32)),
            "Beta": msgspec.structs.asdict(ChildCounters(bytes_saved=64)),
        },
        "transfers": {},
    }
    # Stat logger: rebuilt through the connector class vLLM resolves from the config.
    logging = KVConnectorLogging(make_config([child("Alpha")]).kv_transfer_config)
    logging.observe(msgspec.msgpack.decode(wire))
    logging.observe(msgspec.msgpack.decode(wire))
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == [
        "KV Transfer metrics: Alpha.hits=4, Alpha.tokens_loaded=64, Beta.bytes_saved=128"
    ]



# ---- with vLLM's real scheduler: the re-query that turns into a fallback ----

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_config(tiny_model: Path) -> ModelConfig:
    return ModelConfig(model=str(tiny_model), dtype="float32", skip_tokenizer_init=True)


def make_scheduler(model_config: ModelConfig, children: list[dict[str, Any]]) -> Scheduler:
    """A real vLLM Scheduler (no model runner) whose connector is TandemMultiConnector."""
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=256,
            max_model_len=256,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TandemMultiConnector",
            kv_connector_module_path="connectors.multi",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"connectors": children},
        ),
    )
    config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


def admit_48_token_prompt(scheduler: Scheduler) -> Request:
    """Add a 3-block prompt; the first schedule() starts Alpha's async load of 32 tokens."""
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, 2)
    req = Request(
        request_id="r1",
        prompt_token_ids=list(range(100, 148)),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    scheduler.add_request(req)
    return req


def report(scheduler: Scheduler, output: Any, connector_output: KVConnectorOutput) -> None:
    """A model runner step that only carries the connector's transfer results."""
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=[],
            req_id_to_index={},
            sampled_token_ids=[],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=connector_output,
        ),
    )


def test_vllm_scheduler_requeries_after_a_failed_async_load_and_loads_from_the_next_child(
    model_config: ModelConfig,
) -> None:
    scheduler = make_scheduler(
        model_config, [child("Alpha", matched=32, load_async=True), child("Beta", matched=32)]
    )
    req = admit_48_token_prompt(scheduler)
    first = scheduler.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    report(scheduler, first, KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"}))
    second = scheduler.schedule()
    alpha, beta = kids(scheduler.connector)  # type: ignore[arg-type]
    assert (alpha.lookups, beta.lookups) == (1, 2)
    assert beta.allocs[-1] == ("r1", 32)
    assert second.num_scheduled_tokens == {"r1": 48 - 32}  # Beta's 32 tokens are loaded


def test_vllm_scheduler_recomputes_when_no_other_child_has_the_tokens(
    model_config: ModelConfig,
) -> None:
    scheduler = make_scheduler(model_config, [child("Alpha", matched=32, load_async=True), child("Beta")])
    admit_48_token_prompt(scheduler)
    first = scheduler.schedule()
    # Every block of the load failed: nothing valid is left, so vLLM re-queries.
    (block_ids,) = scheduler.kv_cache_manager.get_block_ids("r1")
    report(scheduler, first, KVConnectorOutput(finished_recving={"r1"}, invalid_block_ids=set(block_ids)))
    second = scheduler.schedule()
    assert [k.lookups for k in kids(scheduler.connector)] == [1, 2]  # type: ignore[arg-type]
    assert second.num_scheduled_tokens == {"r1": 48}


def test_vllm_scheduler_recomputes_the_tail_of_a_partly_failed_load_without_asking_again(
    model_config: ModelConfig,
) -> None:
    scheduler = make_scheduler(
        model_config, [child("Alpha", matched=32, load_async=True), child("Beta", matched=32)]
    )
    admit_48_token_prompt(scheduler)
    first = scheduler.schedule()
    (block_ids,) = scheduler.kv_cache_manager.get_block_ids("r1")
    report(scheduler, first, KVConnectorOutput(finished_recving={"r1"}, invalid_block_ids={block_ids[1]}))
    second = scheduler.schedule()
    assert [k.lookups for k in kids(scheduler.connector)] == [1, 1]  # type: ignore[arg-type]
    assert second.num_scheduled_tokens == {"r1": 48 - BLOCK_SIZE}  # first block stays valid
