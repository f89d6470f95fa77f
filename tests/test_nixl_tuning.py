"""Tandem's NIXL/UCX and core-placement tuning for CPU hosts (docs/performance.md).

Pure logic first: config -> agent settings and engine environment, the core split that
leaves room for the engine's non-OpenMP threads, per-request transfer records, the slow-
transfer count and log, how much of a decode request's prompt the decode side claims from
the prefill engine. Then one real 1P1D deployment: pre-warmed before it reports ready,
every thread of every engine process on its engine's cores, Ray's own processes off the
decode engine's.
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from actors.engine import _observe_connector_stats, emulates_half_precision
from actors.protocol import EngineInfo, EngineStats
from connectors.config import PREFILLED_TOKENS
from connectors import nixl
from connectors.nixl import (
    EXTRA_CONFIG_KEY,
    TandemNixlConnector,
    TandemNixlScheduler,
    TandemNixlStats,
    TandemNixlWorker,
    settings_from_extra_config,
)
from actors.nixl_agent import agent_config_kwargs, make_nixl_agent
from orchestrator.cluster import WORKER_NICENESS
from connectors.config import GPU_NUM_THREADS, NixlConfig
from orchestrator.config import ConfigError, parse_config
from benchmarks.scenarios import vllm_server_env
from orchestrator.specs import (
    dtype_mismatch,
    dtype_warning,
    engine_env,
    engine_spec,
    float32_notice,
    kv_transfer_for,
    native_engine_args,
    niceness_warning,
)
from orchestrator.metrics import TandemMetrics
from actors import affinity
from actors.affinity import lacks_half_precision, node_cores
from orchestrator.placement import EngineSlot, binding_cores, engine_cores, omp_binding

PD = {"prefill": {}, "decode": {}}
# The process that runs a one-rank CPU engine's forward pass: vLLM's engine core itself.
COMPUTE = "VLLM::EngineCore"


def pd_connector(kv: dict[str, Any] | None) -> dict[str, Any] | None:
    """The P/D connector's config: the engine's own, or child 0 of TandemMultiConnector
    (the default since the CPU tier is on: [P/D connector, CPU tier])."""
    if kv is not None and kv["kv_connector"] == "TandemMultiConnector":
        return kv["kv_connector_extra_config"]["connectors"][0]
    return kv


# --- agent settings ---------------------------------------------------------------------


def test_agent_settings_reach_nixls_config() -> None:
    assert agent_config_kwargs(False, ["UCX"]) == {
        "enable_prog_thread": False,
        "capture_telemetry": False,
        "backends": ["UCX"],
        "sync_mode": "none",
        "num_threads": 0,
    }
    # num_threads only reaches the UCX backend.
    assert agent_config_kwargs(True, ["UCX"], num_threads=2, sync_mode="rw")["num_threads"] == 2
    assert "num_threads" not in agent_config_kwargs(True, ["UCX", "GDS"], num_threads=2)


def test_a_progress_thread_sleeps_between_polls_and_no_other_agent_is_touched() -> None:
    """Real NIXL agents: the one with a progress thread is built through a binding that sets
    its poll delay (NIXL's API would busy-poll a core), and the API's own class and binding
    are left as they were."""
    import sys
    import time

    import numpy as np
    from nixl._api import nixl_agent

    binding = sys.modules[nixl_agent.__module__].nixlBind
    before = (nixl_agent.__init__, binding.nixlAgent)
    threaded = make_nixl_agent("tandem-test-threaded", progress_thread=True)
    plain = make_nixl_agent("tandem-test-plain", progress_thread=False, sync_mode="strict")
    assert isinstance(threaded, nixl_agent) and type(plain) is nixl_agent
    assert (nixl_agent.__init__, binding.nixlAgent) == before
    # Working agents: one serves registered memory, the other learns of it.
    pool = np.zeros(1 << 16, dtype=np.uint8)
    threaded.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    assert plain.add_remote_agent(threaded.get_agent_metadata()) in ("tandem-test-threaded", b"tandem-test-threaded")
    # The progress thread sleeps: this process stays far from a busy core while idle.
    t0, c0 = time.monotonic(), time.process_time()
    time.sleep(1.0)
    share = (time.process_time() - c0) / (time.monotonic() - t0)
    assert share < 0.5, f"the process used {share:.0%} of a core while idle: a progress thread busy-polls"


def test_the_stores_progress_thread_wakes_rarely_while_idle() -> None:
    """The CPU tier store's agent polls every STORE_PROGRESS_DELAY_US unprompted (a transfer
    wakes it through UCX's event descriptor); at NIXL's 1 ms floor its thread woke ~900 times
    a second and preempted the engines' compute threads."""
    import os
    import time

    from actors.kv_store import STORE_PROGRESS_DELAY_US

    def wakeups() -> dict[str, int]:
        counts = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status") as status:
                counts[tid] = next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt"))
        return counts

    before = set(wakeups())
    store_like = make_nixl_agent("tandem-test-store", progress_thread=True, progress_delay_us=STORE_PROGRESS_DELAY_US)
    time.sleep(0.2)
    start = {tid: n for tid, n in wakeups().items() if tid not in before}
    assert start, "the agent started no thread"
    time.sleep(1.0)
    end = wakeups()
    woke = max(end[tid] - n for tid, n in start.items())
    assert woke < 5 * 1_000_000 / STORE_PROGRESS_DELAY_US, f"a progress thread woke {woke} times in 1 s while idle"
    del store_like


def test_gpu_engines_get_vllms_ucx_threads_and_cpu_engines_none_unless_configured() -> None:
    """Worker threads busy-poll during large transfers: a CPU host's cores belong to the forward
    passes, a GPU host has them to spare (reads 2-3x faster with four, docs/performance.md)."""
    assert NixlConfig().worker_threads(on_gpu=True) == GPU_NUM_THREADS == 4
    assert NixlConfig().worker_threads(on_gpu=False) == 0
    assert NixlConfig(num_threads=0).worker_threads(on_gpu=True) == 0
    assert NixlConfig(num_threads=2).worker_threads(on_gpu=False) == 2
    assert parse_config({**PD, "kv_transfer": {"nixl": {"num_threads": 0}}}).kv_transfer.nixl.num_threads == 0


def test_settings_come_from_the_extra_config_key_or_default() -> None:
    assert settings_from_extra_config(None) == NixlConfig()
    assert settings_from_extra_config({"other": 1}) == NixlConfig()
    got = settings_from_extra_config({EXTRA_CONFIG_KEY: {"num_threads": 3}})
    assert got == NixlConfig(num_threads=3)


def test_unknown_or_invalid_nixl_fields_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="kv_transfer.nixl.pthr_delay"):
        parse_config({**PD, "kv_transfer": {"nixl": {"pthr_delay": 5}}})
    with pytest.raises(ConfigError, match="num_threads"):
        parse_config({**PD, "kv_transfer": {"nixl": {"num_threads": -1}}})


# --- what the deployer hands each engine ------------------------------------------------


def test_tandem_nixl_connector_is_loaded_by_module_path_with_its_settings() -> None:
    cfg = parse_config({**PD, "kv_transfer": {"connector": "TandemNixlConnector", "nixl": {"num_threads": 1}}})
    kv = pd_connector(kv_transfer_for(cfg, "decode"))
    assert kv is not None
    assert kv["kv_connector_module_path"] == "connectors.nixl"
    assert kv["kv_role"] == "kv_consumer"
    assert kv["kv_connector_extra_config"][EXTRA_CONFIG_KEY] == msgspec.to_builtins(NixlConfig(num_threads=1))


def test_settings_given_in_extra_config_win_over_kv_transfer_nixl() -> None:
    cfg = parse_config({
        **PD,
        "kv_transfer": {"connector": "TandemNixlConnector", "extra_config": {EXTRA_CONFIG_KEY: {"num_threads": 2}}},
    })
    kv = pd_connector(kv_transfer_for(cfg, "prefill"))
    assert kv is not None and kv["kv_connector_extra_config"][EXTRA_CONFIG_KEY] == {"num_threads": 2}


def test_vllms_nixl_connector_gets_no_tandem_settings() -> None:
    cfg = parse_config({**PD, "kv_transfer": {"connector": "NixlConnector"}})
    kv = pd_connector(kv_transfer_for(cfg, "prefill"))
    assert kv is not None
    assert EXTRA_CONFIG_KEY not in kv["kv_connector_extra_config"]
    assert "kv_connector_module_path" not in kv


def _slot(**kw: Any) -> EngineSlot:
    return EngineSlot(**{"node_id": "n", "node_ip": "127.0.0.1", "model_path": "/m", "side_channel_port": 5600,
                         "cpu_binding": "0", "cores": [0], **kw})


def test_ucx_env_reaches_disaggregated_engines_only() -> None:
    nixl = {"ucx_env": {"UCX_TLS": "sm,self"}}
    pd = parse_config({**PD, "kv_transfer": {"nixl": nixl}})
    colocated = parse_config({"colocated": {}, "kv_transfer": {"nixl": nixl}})
    assert engine_env(pd, _slot())["UCX_TLS"] == "sm,self"
    assert "UCX_TLS" not in engine_env(colocated, _slot())
    assert engine_env(pd, _slot())["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def test_disaggregated_gpu_engines_read_other_gpus_blocks_over_cuda_ipc_unless_told_otherwise() -> None:
    """UCX allows cuda_ipc reads only where it sees NVLinks; without them a NIXL READ of GPU
    memory falls back to TCP (docs/performance.md), so GPU engines turn them on, and an
    operator's own ucx_env still decides."""
    gpu = {"device": "cuda", "cpu_tier": {"enabled": False}}
    pd = parse_config({**PD, **gpu})
    assert engine_env(pd, _slot(cpu_binding=None))["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    told = parse_config({**PD, **gpu, "kv_transfer": {"nixl": {"ucx_env": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}}}})
    assert engine_env(told, _slot(cpu_binding=None))["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "n"
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in engine_env(parse_config(PD), _slot())
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in engine_env(parse_config({"colocated": {}, **gpu}), _slot(cpu_binding=None))


def test_only_a_builtin_model_keeps_engines_off_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated tiny model is on disk; a hub id must stay downloadable (no forced offline)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    builtin = parse_config(PD)
    hub = parse_config({**PD, "model": {"source": "Qwen/Qwen2.5-0.5B-Instruct"}})
    assert engine_env(builtin, _slot())["HF_HUB_OFFLINE"] == "1"
    assert vllm_server_env(builtin)["HF_HUB_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in engine_env(hub, _slot())
    assert "HF_HUB_OFFLINE" not in vllm_server_env(hub)


# --- cores -----------------------------------------------------------------------------


def test_the_deployments_session_yields_to_other_sessions_and_gets_its_priority_back() -> None:
    """Where the kernel groups a session's processes (autogroup), `tandem serve` lowers its
    session's weight and restores it on the way out; elsewhere it changes nothing. Run in a
    session of its own, so that this test's session keeps its priority whatever happens."""
    import subprocess
    import sys

    script = (
        "import os\n"
        "from orchestrator.cluster import lower_session_priority, session_priority\n"
        "read = lambda: open('/proc/self/autogroup').read().split()[-1] if os.path.exists('/proc/self/autogroup') else '0'\n"
        "before = read()\n"
        "with session_priority(7):\n"
        "    during = read(); again = lower_session_priority(3)  # already lower: left as it is\n"
        "print(before, during, again, read())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, start_new_session=True)
    assert out.returncode == 0, out.stderr
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroup = f.read().strip() == "1"
    except FileNotFoundError:  # a kernel built without autogroup
        autogroup = False
    assert out.stdout.split() == (["0", "7", "None", "0"] if autogroup else ["0", "0", "None", "0"])


def test_the_plain_vllm_server_gets_the_openmp_cores_of_a_colocated_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's vLLM server must compute on as many cores as the Tandem engine it is
    compared with: all but the last, which is left to the scheduler."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    one = parse_config({"colocated": {}})
    two = parse_config({"colocated": {"tensor_parallel_size": 2}})
    assert vllm_server_env(one)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2"
    assert vllm_server_env(two)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    off = parse_config({"colocated": {}, "cpu": {"bind_cores": "off"}})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_server_env(off)


def test_two_engines_on_two_cores_get_one_core_each() -> None:
    assert [engine_cores([0, 1], 2, i) for i in range(2)] == [[0], [1]]
    assert [omp_binding(engine_cores([0, 1], 2, i), 1) for i in range(2)] == ["0", "1"]


def test_an_engine_with_several_cores_leaves_its_last_core_out_of_openmp() -> None:
    assert omp_binding([0, 1], 1) == "0"
    assert [omp_binding(engine_cores(list(range(8)), 2, i), 1) for i in range(2)] == ["0,1,2", "4,5,6"]


def test_no_core_is_held_back_when_tp_ranks_need_them_all() -> None:
    assert omp_binding([0], 1) == "0"
    assert omp_binding([0, 1], 2) == "0|1"
    assert omp_binding([0, 1, 2], 2) == "0|1"


def test_more_engines_than_cores_share_round_robin() -> None:
    assert [engine_cores([0, 1], 3, i) for i in range(3)] == [[0], [1], [0]]


# --- per-request transfer records and the slow-transfer check -----------------------------


def _telemetry(seconds: float, nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(xferDuration=seconds * 1e6, postDuration=10.0, totalBytes=nbytes, descCount=4)


def test_a_one_rank_cpu_engine_computes_in_its_engine_core_and_tp_keeps_vllms_workers(tiny_model: Any) -> None:
    """vLLM's CPU platform rewrites the one-process executor's name into "mp"; asked for by
    class it stays, for one rank only. An executor the user chose is left alone."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from actors.engine import one_process_engine_config
    from actors.executor import RunDirExecutor

    def backend(**kw: Any) -> Any:
        return one_process_engine_config(AsyncEngineArgs(model=str(tiny_model), **kw)).parallel_config.distributed_executor_backend

    assert backend() is RunDirExecutor
    assert backend(tensor_parallel_size=2) == "mp"
    assert backend(distributed_executor_backend="mp") == "mp"


def test_a_one_rank_engines_rendezvous_file_is_made_in_its_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's file store of the engine core's process group goes where the engine actor
    points VLLM_RPC_BASE_PATH (its run dir), not the host's temp dir."""
    from actors.executor import RunDirExecutor

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    executor = object.__new__(RunDirExecutor)  # only the rendezvous, no engine
    executor.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device="cpu"))
    method, rank, local_rank = executor._distributed_args()
    assert method.startswith(f"file://{tmp_path}/vllm_dist_") and (rank, local_rank) == (0, 0)


def test_the_engine_core_is_started_under_vllms_openmp_binding_of_rank_0(
        tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment vLLM's executor gives a worker is there while the engine core starts,
    and gone after it; an engine with vLLM's workers leaves it to vLLM."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from actors.engine import omp_environment, one_process_engine_config

    binding = ("GOMP_CPU_AFFINITY", "OMP_PLACES")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    # vLLM's CPU platform preloads torch's libgomp (then binds with GOMP_CPU_AFFINITY), else OMP_PLACES.
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    for name in binding:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    one = one_process_engine_config(AsyncEngineArgs(model=str(tiny_model)))
    with omp_environment(one):
        inside = {k: os.environ.get(k) for k in (*binding, "OMP_NUM_THREADS")}
    assert inside in ({"GOMP_CPU_AFFINITY": "1", "OMP_PLACES": None, "OMP_NUM_THREADS": "1"},
                      {"GOMP_CPU_AFFINITY": None, "OMP_PLACES": "{1}", "OMP_NUM_THREADS": "1"})
    assert not any(name in os.environ for name in binding) and os.environ["OMP_NUM_THREADS"] == "8"
    workers = one_process_engine_config(AsyncEngineArgs(model=str(tiny_model), distributed_executor_backend="mp"))
    with omp_environment(workers):
        assert not any(name in os.environ for name in binding) and os.environ["OMP_NUM_THREADS"] == "8"


def test_stats_keep_request_ids_aligned_with_transfers() -> None:
    stats = TandemNixlStats()
    stats.polling_request = "r1"
    stats.record_transfer(_telemetry(0.01, 100))
    stats.record_transfer(None)  # no telemetry: nothing recorded
    plain = TandemNixlStats()
    plain.data.pop("request_ids")
    plain.record_transfer(_telemetry(0.02, 200))
    plain.data.pop("request_ids")
    stats.aggregate(plain)
    assert stats.data["request_ids"] == ["r1", ""]
    assert stats.data["bytes_transferred"] == [100, 200]


class _FakeAgent:
    """Answers check_xfer_state from a table: handle -> "DONE" | "PROC"."""

    def __init__(self, states: dict[int, str], telemetry: dict[int, SimpleNamespace]) -> None:
        self.states, self.telemetry, self.released = states, telemetry, []

    def check_xfer_state(self, handle: int) -> str:
        return self.states[handle]

    def get_xfer_telemetry(self, handle: int) -> SimpleNamespace:
        return self.telemetry[handle]

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)


def test_worker_records_each_finished_transfer_under_its_request() -> None:
    worker = TandemNixlWorker.__new__(TandemNixlWorker)  # only the polling path is exercised
    worker.nixl_wrapper = _FakeAgent({1: "DONE", 2: "PROC", 3: "DONE"}, {1: _telemetry(0.1, 10), 3: _telemetry(0.3, 30)})
    worker.xfer_stats = TandemNixlStats()
    transfers = {"a": [1], "b": [2, 3]}
    done, failed = worker._pop_done_transfers(transfers)
    assert (done, failed) == ({"a"}, set())
    assert transfers == {"b": [2]}
    assert worker.xfer_stats.data["request_ids"] == ["a", "b"]
    assert worker.xfer_stats.data["bytes_transferred"] == [10, 30]
    assert worker.xfer_stats.polling_request is None


class _PostingWorker:
    """Records the metadata of each start_load_kv, as vLLM's pull worker posts its READs."""

    def __init__(self) -> None:
        self.posted: list[object] = []

    def start_load_kv(self, metadata: object) -> None:
        self.posted.append(metadata)


def _model_runner_step(connector: TandemNixlConnector, metadata: object, events: list[str], worker: _PostingWorker) -> None:
    """What vLLM's model runner does with a connector in one step: bind, forward, then start
    the (async) loads (kv_connector_model_runner_mixin)."""
    connector.bind_connector_metadata(metadata)
    events.append(f"forward, {len(worker.posted)} posted")
    connector.start_load_kv(forward_context=None)


@pytest.mark.parametrize("cpu", [True, False])
def test_a_cpu_engine_posts_each_steps_reads_once_before_the_forward(cpu: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl, "current_platform", SimpleNamespace(is_cpu=lambda: cpu))
    connector = TandemNixlConnector.__new__(TandemNixlConnector)  # the worker role's step path only
    connector.connector_worker = worker = _PostingWorker()
    monkeypatch.setattr(nixl.NixlConnector, "start_load_kv", lambda self, fc, **kw: worker.start_load_kv(self._connector_metadata))
    events: list[str] = []
    for step in ("step-1", "step-2"):
        _model_runner_step(connector, step, events, worker)
    assert worker.posted == ["step-1", "step-2"]  # each step's metadata posted exactly once
    # On a CPU the READs are out before the forward; on a GPU after it, as vLLM orders them.
    assert events == (["forward, 1 posted", "forward, 2 posted"] if cpu else ["forward, 0 posted", "forward, 1 posted"])


def _decode_side_scheduler(lookahead: int = 0) -> TandemNixlScheduler:
    """The decode side's claim is all that is exercised: vLLM's backoff inputs, no engine."""
    scheduler = TandemNixlScheduler.__new__(TandemNixlScheduler)
    scheduler._has_mamba = scheduler._bounded_replay = False
    scheduler.vllm_config = SimpleNamespace(num_prefill_lookahead_tokens=lookahead)
    return scheduler


@pytest.mark.parametrize("prompt_len", [257, 401])  # a block boundary (16-token blocks) and not
def test_a_decode_request_past_the_prefilled_prompt_claims_only_the_prefilled_tokens(prompt_len: int) -> None:
    """The prefill's sampled token went to the client; the decode request is the prompt plus
    that token. Claiming the whole of it would pull into one block more than the prefill
    sent at a block boundary (vLLM refuses that); the extra token is computed locally."""
    scheduler = _decode_side_scheduler()
    params = {"do_remote_prefill": True, PREFILLED_TOKENS: prompt_len - 1}
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(prompt_len)), kv_transfer_params=params)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (prompt_len - 1, True)
    assert scheduler.get_num_new_matched_tokens(request, 32) == (prompt_len - 33, True)  # a local prefix hit
    assert scheduler.get_num_new_matched_tokens(request, prompt_len - 1) == (0, False)  # nothing left to pull
    # vLLM's own protocol (no prefilled count): the whole prompt, as vLLM's scheduler claims it.
    del params[PREFILLED_TOKENS]
    assert scheduler.get_num_new_matched_tokens(request, 0) == (prompt_len, True)
    # A model whose decoder recomputes trailing tokens (vLLM's backoff) claims that many fewer.
    params[PREFILLED_TOKENS] = prompt_len - 1
    assert _decode_side_scheduler(lookahead=3).get_num_new_matched_tokens(request, 0) == (prompt_len - 3, True)


def test_a_slow_transfer_is_counted_and_logged_with_engine_request_bytes_and_time(caplog: pytest.LogCaptureFixture) -> None:
    stats = EngineStats(engine_id="decode-0", role="decode")
    payload = {"transfer_duration": [0.02, 1.5], "bytes_transferred": [4096, 65536], "request_ids": ["fast", "req-7"]}
    with caplog.at_level(logging.WARNING, logger="tandem.engine"):
        _observe_connector_stats(stats, payload, slow_s=1.0)
    assert stats.transfers.num_transfers == 2
    assert stats.transfers.num_slow == 1
    [record] = caplog.records
    assert all(part in record.getMessage() for part in ("decode-0", "req-7", "65536 bytes", "1.500 s"))


def test_slow_transfers_inside_a_multi_connector_payload_are_counted() -> None:
    stats = EngineStats(engine_id="decode-0", role="decode")
    payload = {"children": {}, "transfers": {"TandemNixlConnector": {"transfer_duration": [3.0], "bytes_transferred": [1]}}}
    _observe_connector_stats(stats, payload, slow_s=2.0)
    assert stats.transfers.num_slow == 1 and stats.transfers.bytes == 1


def test_metrics_page_shows_the_slow_transfer_count() -> None:
    stats = EngineStats(engine_id="decode-0", role="decode")
    stats.transfers.num_slow = 3
    page = TandemMetrics("t").render([stats], {}).decode()
    assert 'tandem_kv_transfer_slow_total{app="t",engine="decode-0",pool="decode"} 3.0' in page


def _info(engine_id: str, niceness: int) -> EngineInfo:
    return EngineInfo(engine_id, "decode", "i0", "node", "10.0.0.1", 1, [], 1024, 128, None, None, niceness)


def test_engines_serving_half_precision_on_cpus_without_avx512_get_a_warning_with_the_fix(monkeypatch) -> None:
    fast = msgspec.structs.replace(_info("prefill-0", 0), dtype="bfloat16")
    slow = msgspec.structs.replace(_info("decode-0", 0), dtype="bfloat16", emulated_dtype=True)
    assert dtype_warning([fast]) is None
    warning = dtype_warning([fast, slow])
    assert warning is not None and "['decode-0'] serve bfloat16" in warning and "engine_args: {dtype: float32}" in warning
    # What decides it: the x86 CPU's AVX-512 flags, which this host's torch reads alike.
    if platform.machine() == "x86_64" and "ATEN_CPU_CAPABILITY" not in os.environ:
        assert lacks_half_precision() == (not torch.backends.cpu.get_cpu_capability().startswith("AVX512"))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(affinity, "cpu_flags", lambda: {"avx2", "fma"})
    assert emulates_half_precision(torch.bfloat16) and emulates_half_precision(torch.float16)
    assert not emulates_half_precision(torch.float32)
    monkeypatch.setattr(affinity, "cpu_flags", lambda: {"avx2", "avx512_bf16", *affinity.AVX512_FLAGS})
    assert not emulates_half_precision(torch.bfloat16)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(affinity, "cpu_flags", set)
    assert not emulates_half_precision(torch.bfloat16)  # only x86 is judged


def test_a_replica_joining_on_a_host_that_emulates_its_dtype_is_warned_of(caplog) -> None:
    """A scale-up may place a replica on a node of another kind than the first replicas'
    (which chose the deployment's dtype): the pool manager warns of that replica when it joins."""
    from orchestrator.pools import _warn_of_hosts

    native = msgspec.structs.replace(_info("decode-1", 0), dtype="bfloat16")
    emulated = msgspec.structs.replace(_info("decode-2", 0), dtype="bfloat16", emulated_dtype=True)
    with caplog.at_level(logging.WARNING, logger="tandem.pools"):
        _warn_of_hosts([native])
        assert not caplog.records
        _warn_of_hosts([emulated])
    assert [r.getMessage() for r in caplog.records] == [dtype_warning([emulated])]


def test_cpu_engines_without_avx512_serve_float32_unless_the_config_names_a_dtype(monkeypatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(affinity, "cpu_flags", lambda: {"avx2", "fma"})
    assert lacks_half_precision()
    monkeypatch.setattr(affinity, "cpu_flags", lambda: {"avx2", *affinity.AVX512_FLAGS})
    assert not lacks_half_precision()
    assert native_engine_args({"max_model_len": 512}, True) == {"max_model_len": 512, "dtype": "float32"}
    assert native_engine_args({"dtype": "auto"}, True) == {"dtype": "float32"}
    named = {"dtype": "bfloat16"}
    assert native_engine_args(named, True) is named  # served as named (dtype_warning says what it costs)
    unnamed: dict[str, Any] = {"max_model_len": 512}
    assert native_engine_args(unnamed, False) is unnamed
    # Every pool's engines get it, so their KV bytes match.
    cfg = parse_config({**PD, "engine_args": {"max_model_len": 512}, "decode": {"engine_args": {"max_num_seqs": 8}}})
    slot = EngineSlot("n", "10.0.0.1", "/m", 5600, None)
    for role in ("prefill", "decode"):
        assert engine_spec(cfg, role, f"{role}-0", slot, None, lacks_half_precision=True).engine_args["dtype"] == "float32"
        assert "dtype" not in engine_spec(cfg, role, f"{role}-0", slot, None).engine_args
    notice = float32_notice(["node-b"])
    assert "['node-b']" in notice and "engine_args.dtype" in notice


def test_an_engine_serving_another_dtype_than_its_kv_peers_cannot_join() -> None:
    ours = [msgspec.structs.replace(_info(e, 0), dtype="bfloat16") for e in ("prefill-0", "decode-0")]
    assert dtype_mismatch(ours[0], ours[1:]) is None
    odd = msgspec.structs.replace(_info("prefill-1", 0), dtype="float32")
    why = dtype_mismatch(odd, ours)
    assert why is not None and "float32" in why and "prefill-0 serves bfloat16" in why and "engine_args.dtype" in why


def test_engines_below_tandems_priority_get_a_warning_with_the_fix() -> None:
    assert niceness_warning([_info("prefill-0", 0), _info("decode-0", 0)]) is None
    warning = niceness_warning([_info("prefill-0", 15), _info("decode-0", 0)])
    assert warning is not None
    assert "['prefill-0']" in warning and "niceness 15" in warning and "RAY_worker_niceness=0" in warning


# --- real engines ----------------------------------------------------------------------


@pytest.mark.engines
@pytest.mark.parametrize("tier, why", [
    (False, r"engine (prefill|decode)-0 did not start: it serves float(16|32) and engine (decode|prefill)-0 serves "
            r"float(32|16).*name one `engine_args.dtype`"),
    # The tier's index refuses the second engine's blocks inside vLLM's engine core, whose
    # cause the engine actor reads from the log it shares with the core (actors.logs).
    (True, r"engine (prefill|decode)-0 did not start: its engine failed to start: RuntimeError: vLLM's engine core did "
           r"not start: connectors.index_client.IndexRefused: an engine's KV block is \d+ bytes but the tier holds "
           r"\d+-byte blocks"),
])
def test_pools_naming_two_dtypes_do_not_deploy_and_leave_no_engine_behind(
        ray_local: None, tiny_model: Any, tier: bool, why: str) -> None:
    """KV moves between a prefill and a decode engine only in one dtype: the second engine up
    does not join, and the deployment fails naming the cause and the fix."""
    import ray

    from orchestrator.deploy import DeployError, Deployment
    from tests.conftest import free_port

    cfg = parse_config({"prefill": {"engine_args": {"dtype": "float32"}}, "decode": {"engine_args": {"dtype": "float16"}},
                        "model": {"source": str(tiny_model)}, "cpu_tier": {"enabled": tier},
                        "serve": {"app_name": "dtypes", "port": free_port(), "token_path_base_port": free_port(8)},
                        "kv_transfer": {"side_channel_base_port": free_port(8)}})
    with pytest.raises(DeployError, match=why):
        Deployment(cfg).start(timeout_s=300)
    assert [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("dtypes:")] == []


@pytest.mark.engines
def test_a_1p1d_deployment_is_prewarmed_and_placed_and_keeps_rays_processes_off_the_decode_engine(
        ray_local: None, tiny_model: Any) -> None:
    """One real 1P1D deployment served with the defaults (one start-up, checked two ways).

    Pre-warmed and placed: by the time it reports ready, every P->D handshake has been made
    and a real KV block has moved over NIXL, before any user request; every thread of every
    engine process runs where placement put it (see `check_prewarmed_and_placed`).

    Ray's own processes: while it serves, every thread of the embedded Ray's own processes
    (its daemons, Serve's controller, the ingress, the pool manager, the CPU tier) runs on
    cores no decode step computes on: the cores no engine computes on, else the prefill
    engine's (placement.control_cores; on a 2-core host, the prefill engine's core). The
    engines keep their own placement, an unbound engine started meanwhile still gets the
    whole node (it starts in a worker of the narrowed raylet), a decode engine SIGKILLed and
    restarted while Ray's processes are confined again and again comes back on its own
    placement, and once the deployment is torn down Ray's processes get the node's cores back.

    The idle-CPU target (< 0.1 core for an idle 1P1D) is a performance figure, so it lives in
    `benchmarks/idle_cpu.py` (see docs/performance.md), not in a test.
    """
    import openai
    import ray

    from orchestrator.deploy import Deployment, keep_own_ray_off_engines
    from orchestrator.job import running
    from tests.conftest import free_port

    node = set(node_cores())
    cfg = parse_config({**PD, "model": {"source": str(tiny_model)},
                        "serve": {"port": free_port(), "token_path_base_port": free_port(8)},
                        "kv_transfer": {"side_channel_base_port": free_port(8)}})
    with running(cfg, own_ray=False) as up:
        decode = next(e for e in up.deployment.engines if e.role == "decode")
        moved = ray.get(decode.handle.get_stats.remote()).transfers  # before any request
        infos = {e.engine_id: ray.get(e.handle.info.remote()) for e in up.deployment.engines}
        # The tiny model is float16, served so where this host's CPU computes it natively, else
        # in float32 (the config names no dtype).
        assert {(i.dtype, i.emulated_dtype) for i in infos.values()} == {
            ("float32", False) if lacks_half_precision() else ("float16", False)}
        omp = {eid: binding_cores(info.cpu_binding or "") for eid, info in infos.items()}
        refs = {e.engine_id: e for e in up.deployment.engines}  # what the routers are given
        confined = ray_threads()
        before = {eid: engine_threads(info.pid) for eid, info in infos.items()}
        out = openai.OpenAI(base_url=up.url, api_key="unused", max_retries=0, timeout=60).completions.create(
            model=cfg.model.name, prompt="the cores of a small host", max_tokens=4, temperature=0)
        unbound = Deployment(parse_config({"colocated": {}, "model": {"source": str(tiny_model)},
                                           "cpu": {"bind_cores": "off"}, "serve": {"app_name": "unbound"}}))
        (engine,) = unbound.start()
        try:
            unbound_threads = engine_threads(ray.get(engine.handle.info.remote()).pid)
        finally:
            unbound.stop()
        # A decode engine restarting while Ray's processes are confined (its new process
        # listed nowhere yet) keeps its own placement: confine every half second until it is back.
        os.kill(infos["decode-0"].pid, signal.SIGKILL)
        deadline = time.monotonic() + 240
        while (back := restarted(up.deployment, "decode-0")) is None:
            assert time.monotonic() < deadline, f"decode-0 not back: {up.deployment.status()}"
            assert keep_own_ray_off_engines() is not None
            time.sleep(0.5)
        restarted_threads = engine_threads(back.pid)
        confined_after_restart = ray_threads()
    after = ray_threads()
    check_prewarmed_and_placed(moved, infos, before)
    # The routers know each engine's host, compute cores and process cores, to weigh the
    # queues and the decodes that share them.
    assert {eid: (r.node_ip, set(r.compute_cores), set(r.process_cores)) for eid, r in refs.items()} == {
        eid: (info.node_ip, omp[eid], set(info.cores or [])) for eid, info in infos.items()}
    assert not refs["prefill-0"].shares_cores(refs["decode-0"])
    if len(node) == 2:  # the decode engine's processes run on the prefill engine's core
        assert refs["prefill-0"].steps_beside(refs["decode-0"])
    assert out.choices[0].text and out.usage.completion_tokens == 4
    expected = (node - omp["prefill-0"] - omp["decode-0"]) or (node - omp["decode-0"])
    if len(node) == 2:
        assert expected == omp["prefill-0"], "on 2 cores: the prefill engine's core"
    assert len({name for name, _ in confined}) >= 5, f"Ray's daemons and Tandem's actors: {confined}"
    for name, affinity in confined + confined_after_restart:
        assert affinity == expected, f"{name} runs on cores {affinity}, not {expected}"
    for eid, info in infos.items():
        assert not misplaced(before[eid], set(info.cores or []), omp[eid]), f"{eid} keeps its own placement"
    assert {frozenset(affinity) for name, affinity, _ in unbound_threads if name != COMPUTE} == {frozenset(node)}
    assert (back.cores, back.cpu_binding) == (infos["decode-0"].cores, infos["decode-0"].cpu_binding), "the same placement"
    assert not misplaced(restarted_threads, set(back.cores or []), omp["decode-0"]), f"restarted decode-0: {restarted_threads}"
    assert after and all(affinity == node for _, affinity in after), f"not back on {node}: {[t for t in after if t[1] != node]}"


def check_prewarmed_and_placed(moved: Any, infos: dict[str, EngineInfo],
                               threads: dict[str, list[tuple[str, set[int], int]]]) -> None:
    """`moved`, the decode engine's transfers when the deployment reported ready: the pre-warm
    request's pull alone. `threads` of each engine: the actor's and vLLM's engine core's, no
    worker process (the engine core runs the forward pass itself, actors/engine.py); the
    engine core's on the engine's compute cores only (vLLM's NIXL worker moves its compute
    thread to the host's last core, which is another engine's, and TandemNixlConnector moves
    it back), the actor's on the engine's other cores; all at Tandem's worker niceness, not
    Ray's default 15 (orchestrator/cluster.py says why)."""
    assert moved.num_transfers == 1, "exactly the pre-warm request's pull"
    assert moved.bytes > 0 and moved.num_failed == 0
    compute = {eid: binding_cores(info.cpu_binding or "") for eid, info in infos.items()}
    assert compute["prefill-0"] and compute["decode-0"] and compute["prefill-0"].isdisjoint(compute["decode-0"])
    if len(os.sched_getaffinity(0)) // 2 == 1:
        # One core each: the decode engine's other threads run on the prefill engine's core,
        # its forward pass alone on its own (placement.process_cores).
        assert infos["decode-0"].cores == infos["prefill-0"].cores == sorted(compute["prefill-0"])
    else:
        assert compute["decode-0"] < set(infos["decode-0"].cores or []), "a core left out of OpenMP"
    for eid, info in infos.items():
        names = {name for name, _, _ in threads[eid]}
        assert COMPUTE in names and not any(n.startswith("VLLM::Worker") for n in names), f"{eid}: one engine process, {names}"
        assert info.niceness == WORKER_NICENESS, "the embedded Ray starts its workers at Tandem's niceness"
        for name, affinity, nice in threads[eid]:
            others = set(info.cores or [])
            # An engine core beside its actor's threads may also have threads started before
            # OpenMP bound it; one whose actor runs elsewhere stays on its own cores.
            allowed = compute[eid] if name == COMPUTE and not compute[eid] <= others else others
            assert affinity <= allowed, f"{eid}: a thread of {name} runs on cores {affinity}, not within {allowed}"
            assert nice == WORKER_NICENESS, f"{eid}: a thread of {name} runs at niceness {nice}"


def misplaced(threads: list[tuple[str, set[int], int]], cores: set[int], omp: set[int]) -> list[tuple[str, set[int]]]:
    """The threads of an engine off its placement: its engine core's on its OpenMP cores when
    those lie outside its actor's `cores` (OpenMP binds them all), the rest on `cores`."""
    return [(name, affinity) for name, affinity, _ in threads
            if not affinity <= (omp if name == COMPUTE and not omp <= cores else cores)]


def restarted(deployment: Any, replica_id: str) -> Any:
    """`replica_id`'s status once it serves again after a restart, else None."""
    status = deployment.status()
    replica = next(r for pool in status.pools for r in pool.replicas if r.id == replica_id)
    return replica if replica.restarts and replica.state == "healthy" and replica.pid is not None else None


def ray_threads() -> list[tuple[str, set[int]]]:
    """(process name, allowed cores) of every thread of the embedded Ray's processes but the
    engines' trees (those still exiting after a teardown among them)."""
    import psutil

    from orchestrator.cluster import own_ray_processes, serves_actor
    from orchestrator.deploy import ENGINE_CLASS

    found, todo = [], own_ray_processes()
    while todo:
        proc = todo.pop()
        try:
            # An engine's worker exiting after a teardown may have lost its title (an empty
            # command line) before its threads end: not a process Ray's mask is put back on.
            if serves_actor(proc, [ENGINE_CLASS]) or not proc.cmdline():
                continue
            name, threads = proc.name(), proc.threads()
            todo.extend(proc.children())
        except psutil.Error:  # a helper process that ended meanwhile
            continue
        for thread in threads:
            try:
                found.append((name, os.sched_getaffinity(thread.id)))
            except ProcessLookupError:  # the thread ended meanwhile
                pass
    return found


def engine_threads(pid: int) -> list[tuple[str, set[int], int]]:
    """(process name, allowed cores, niceness) of every thread of `pid` and its descendants."""
    import psutil

    root = psutil.Process(pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name, threads = proc.name(), proc.threads()
        except psutil.NoSuchProcess:  # a helper process that ended meanwhile
            continue
        for thread in threads:
            try:
                found.append((name, os.sched_getaffinity(thread.id), os.getpriority(os.PRIO_PROCESS, thread.id)))
            except ProcessLookupError:  # the thread ended meanwhile
                pass
    return found
