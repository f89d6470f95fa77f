"""What `tandem bench` was asked and what it found: the structs bench.json (and, under
`--client vllm`, results.json) hold, shared by the runners (benchmarks.bench,
benchmarks.vllm_bench) and the report writer (benchmarks.report)."""

from __future__ import annotations

from typing import Literal

import msgspec

from benchmarks.faults import FaultReport
from benchmarks.loadgen import RunResult
from benchmarks.nixl_micro import KVGeometry, MicroResult
from benchmarks.phases import ENGINE_TPOT_COUNTS, ENGINE_TPOT_SUMS, KV_BYTES, KV_SECONDS, Overhead, kv_rate_gib_s
from benchmarks.scenarios import Scenario


class BenchOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What `tandem bench` was asked to do; stored in bench.json."""

    scenarios: str | None = None  # None: DEFAULT_SCENARIOS, or DEFAULT_CLUSTER_SCENARIOS with `address`
    # Who sends the load: Tandem's own load generator (with the direct-path runs, the CPU and
    # KV tables, the plots) or vLLM's `vllm bench serve` (benchmarks.vllm_bench: the figures
    # an outside user of vLLM's client gets).
    client: Literal["tandem", "vllm"] = "tandem"
    # Deploy and measure every scenario this many times, in turn (every other round in
    # reverse order), each round sending the same requests to fresh deployments. This host's
    # speed drifts over minutes (the plain server's own TPOT p50 1.8-2.8 ms from one run to
    # the next), so a ratio between two scenarios measured minutes apart is as noisy; each
    # round's ratios set scenarios against a reference of the same round (vLLM's client: the
    # plain server; Tandem's: the first scenario listed), and the report gives their median.
    rounds: int = 1
    rates: tuple[float, ...] = (1.0, 2.0)  # offered requests/s, Poisson arrivals
    num_requests: int = 40  # measured requests per rate
    warmup: int = 2  # requests sent before each measured run
    input_len: int = 256  # prompt tokens (conversation: the shared system prompt's)
    output_len: int = 32  # output tokens (ignore_eos)
    # random: independent prompts; conversation: multi-turn chats resending their history
    # after one shared system prompt (the routing benchmark's workload).
    workload: Literal["random", "conversation"] = "random"
    turns: int = 6  # conversation: turns per chat
    # conversation: the history's assistant turns are synthetic text, or the server's own
    # answers, resent as the token ids it streamed (each turn then waits for the one before).
    replies: Literal["synthetic", "server"] = "synthetic"
    # conversation: every chat's first turn, then every second turn, ... ("turns"), or chats
    # opening one after another while earlier ones go on ("staggered").
    chat_order: Literal["turns", "staggered"] = "turns"
    duration_s: float = 60.0  # no measured request is sent later than this into a run
    request_timeout_s: float = 120.0
    seed: int = 0
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 50.0
    config: str | None = None  # base deployment config; scenarios replace its pools
    model: str | None = None  # overrides model.source of the config
    cpu_tier: bool = True  # False: every scenario runs with cpu_tier.enabled false
    address: str | None = None  # Ray cluster to join; None: embedded Ray on 127.0.0.1
    target_url: str | None = None  # benchmark this OpenAI server instead of deploying
    target_model: str | None = None
    tokenizer: str | None = None  # folder or hub id; default: the config's model
    out_dir: str | None = None  # default results/bench-<timestamp>
    overhead: bool = True  # also send the load straight to the engines
    nixl_micro: bool = True
    # Fault scenarios: the kill comes this many seconds into the load, which then runs until
    # `fault_tail_s` after the killed engine is healthy again, `fault_window_s` after the kill at most.
    fault_after_s: float = 10.0
    fault_window_s: float = 150.0
    fault_tail_s: float = 10.0


def round_label(name: str, round: int | None) -> str:
    """A scenario's name, with its round (from 0) when the bench ran several."""
    return name if round is None else f"{name}, round {round + 1}"


class CpuMatched(msgspec.Struct, frozen=True):
    """A plain vLLM server's run beside a ballast of the extra CPU Tandem's stack took."""

    ballast_cores: float  # Tandem's direct-path CPU outside vLLM's engine processes, minus the vLLM server's
    run: RunResult  # the direct run's prompts and schedule at its rate, over HTTP to the vLLM server


class ScenarioReport(msgspec.Struct, frozen=True):
    """What one scenario gave beyond its runs (which are saved as JSON files of their own)."""

    scenario: Scenario
    startup_s: float
    runs: list[RunResult]  # the HTTP sweep, one per rate
    direct: list[RunResult] = []  # the same sweep sent straight to the engine actors (Tandem only)
    phases_ms: dict[str, dict[str, float]] = {}  # first rate: "<name> HTTP" / "<name> direct" -> phase -> ms
    overhead: list[Overhead] = []  # HTTP vs direct, one per rate
    # The slowest KV transfer any engine saw from start-up (warm-up included) to the end of the
    # scenario; None where nothing was transferred or the server is not Tandem.
    kv_max_s: float | None = None
    cpu_matched: list[CpuMatched] = []  # vllm-server after colocated:1 only, one per rate
    round: int | None = None  # which of BenchOptions.rounds, from 0; None: the bench ran one round

    @property
    def label(self) -> str:
        """The scenario's name in tables, plots and file names, its round added when there were several."""
        return round_label(self.scenario.name, self.round)

    def kv_total(self, name: str) -> float:
        """A KV counter's growth over every run of the scenario."""
        return sum(r.summary.server_metrics.get(name, 0.0) for r in [*self.runs, *self.direct])

    def overhead_at(self, rate: float | None) -> Overhead | None:
        return next((o for o in self.overhead if o.rate == rate), None)

    @property
    def kv_gib_s(self) -> float | None:
        return kv_rate_gib_s({name: self.kv_total(name) for name in (KV_BYTES, KV_SECONDS)})


class BenchReport(msgspec.Struct, frozen=True):
    options: BenchOptions
    command: str
    scenarios: list[ScenarioReport]
    geometry: KVGeometry | None = None
    micro: list[MicroResult] = []
    elapsed_s: float = 0.0
    faults: list[FaultReport] = []  # one per fault scenario, in the order run


class ClientRun(msgspec.Struct, frozen=True):
    """One load for vLLM's client (`vllm bench serve`): a label for the table and its arguments."""

    label: str
    args: list[str]


class ClientResult(msgspec.Struct, frozen=True):
    """One load of vLLM's client against one scenario (`tandem bench --client vllm`)."""

    scenario: str
    load: str  # the ClientRun's label
    vllm: dict[str, object]  # vLLM's result file, as written
    metrics: dict[str, float]  # the server's /metrics growth over the run (a vLLM server has engine TPOT only)
    round: int = 0  # which of BenchOptions.rounds, from 0

    @property
    def engine_tpot_ms(self) -> float | None:
        """vLLM's own mean time per output token (engine-core timestamps): the client's TPOT
        less this is what relaying each token to the client costs."""
        count = sum(self.metrics.get(n, 0.0) for n in ENGINE_TPOT_COUNTS)
        return 1000 * sum(self.metrics.get(n, 0.0) for n in ENGINE_TPOT_SUMS) / count if count else None
