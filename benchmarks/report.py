"""What `tandem bench` leaves behind, and the tables and plots it is made of: a JSON per run,
results.md, summary.md, bench.json and PNG plots.

summary.md is what people read (and what the command prints): the results table, where TTFT
goes, what the HTTP path adds over calling the engines directly, KV transfer efficiency
against raw NIXL, Tandem's colocated engine against a plain vLLM server when both ran, the
routing policies side by side, and the fault scenarios' detection, recovery, lost requests
and TTFT around the kill. Under `--client vllm` the same module writes vLLM's figures, each
scenario against the plain vLLM server, and where the client's TTFT went.

Plots are drawn on bare `matplotlib.figure.Figure` objects rather than through pyplot, so
writing them needs no display and changes no global backend of the calling program.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Literal

import msgspec
from matplotlib.figure import Figure

from benchmarks.faults import FAULT_COUNTERS, GOAL_DETECT_S, GOAL_LOST, GOAL_RECOVER_S, FaultReport, WindowName
from benchmarks.loadgen import RunResult
from benchmarks.nixl_micro import markdown as micro_markdown
from benchmarks.phases import (
    CACHE_HIT_TOKENS,
    COMPUTED_TOKENS,
    HEADLINE_METRICS,
    KV_BYTES,
    KV_SECONDS,
    KV_SLOW,
    KV_TRANSFERS,
    LOCAL_PREFILLS,
    PER_REQUEST_METRICS,
    TIER_TOKENS,
    decode_share_from_metrics,
    engine_first_token_ms,
    engine_tpot_ms,
    requests_with_first_token,
    router_phases_from_metrics,
    tpot_phases,
    ttft_phases,
)
from benchmarks.protocol import BenchReport, ClientResult, ScenarioReport, round_label
from benchmarks.scenarios import Scenario
from benchmarks.server_cpu import ServerCpu
from benchmarks.stats import (
    DEFAULT_ATTAINMENT_TARGET,
    Percentiles,
    RequestResult,
    RunSummary,
    goodput_from_sweep,
    percentile,
    percentiles_ms,
    ratio_interval,
    summarize,
)

SweepAxis = Literal["rate", "concurrency"]

_X_LABELS = {
    "rate": "Offered load (requests/s)",
    "concurrency": "Concurrency (requests in flight)",
}
_LATENCIES = (  # summary field, panel title
    ("ttft_ms", "Time to first token"),
    ("tpot_ms", "Time per output token"),
    ("itl_ms", "Inter-token latency"),
    ("e2e_ms", "End-to-end latency"),
)
_PERCENTILE_STYLES = (("p50", "-", "o"), ("p90", "-.", "^"), ("p99", "--", "s"))
# Where a prompt's tokens came from, as the vLLM-client table names them.
TOKEN_SOURCES = {"engine-cache hits": CACHE_HIT_TOKENS, "CPU-tier loads": TIER_TOKENS, "computed": COMPUTED_TOKENS}
# The scenario every other one is set against in the vLLM-client table, when it ran.
VLLM_REFERENCE = "vllm-server"
# The peer system Tandem's disaggregated scenarios are set against, when it ran.
PEER_REFERENCE = "ray-serve-llm"
_EVENT_COLORS = ("C3", "C1", "C2", "C4", "C5")  # red, orange, green, ...: a fault, its detection, recovery


def save_json(result: RunResult, path: str | Path) -> Path:
    """Write one run, every request included, as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=2))
    return path


def load_json(path: str | Path) -> RunResult:
    """Read a run written by `save_json`."""
    return msgspec.json.decode(Path(path).read_bytes(), type=RunResult)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _fmt_metric(value: float | None) -> str:
    """Counts as integers, amounts (bytes or seconds per request) with three decimals."""
    return _fmt(value, 0 if value is not None and float(value).is_integer() else 3)


def _pair(p: Percentiles) -> str:
    return f"{_fmt(p.p50)} / {_fmt(p.p99)}"


def markdown_table(results: Sequence[RunResult], per_request: Collection[str] = ()) -> str:
    """One row per run; latencies as p50 / p99 in ms; how busy the load generator's host was
    and how much of its CPU time the hypervisor took (a slow period of a shared VM, not of the
    server, shows there).

    Every server metric recorded by any run gets a column with its growth over the run, divided
    by the completed requests for names in `per_request` (bytes or seconds per request, say)
    and left as a total otherwise (fallbacks, recomputes).
    """
    metrics = sorted({name for r in results for name in r.summary.server_metrics})
    header = [
        "Scenario", "Rate (req/s)", "Concurrency", "OK / failed", "Throughput (req/s)",
        "Output (tok/s)", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "ITL p50 / p99 (ms)",
        "E2E p50 / p99 (ms)", "SLO attainment", "Goodput (req/s)", "Host CPU busy / stolen",
    ]
    header += [f"{name} / request" if name in per_request else name for name in metrics]
    rows = []
    for r in results:
        s, c = r.summary, r.config
        attainment = None if s.slo_attainment is None else 100 * s.slo_attainment
        row = [
            c.label or "—",
            _fmt(c.rate, 2),
            str(c.concurrency) if c.concurrency else "—",
            f"{s.num_completed} / {s.num_failed}",
            _fmt(s.request_throughput, 2),
            _fmt(s.output_throughput),
            _pair(s.ttft_ms),
            _pair(s.tpot_ms),
            _pair(s.itl_ms),
            _pair(s.e2e_ms),
            "—" if attainment is None else f"{attainment:.1f}%",
            _fmt(s.goodput, 2),
            "—" if r.host_cpu is None else f"{100 * r.host_cpu.busy:.0f}% / {100 * r.host_cpu.steal:.1f}%",
        ]
        for name in metrics:
            value = s.server_metrics.get(name)
            if value is not None and name in per_request:
                value = value / s.num_completed if s.num_completed else None
            row.append(_fmt_metric(value))
        rows.append(row)
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def _sweep(runs: Sequence[RunResult], x: SweepAxis) -> list[tuple[float, RunResult]]:
    """The runs that have a value on the swept axis, in increasing order of it."""
    points = [(getattr(r.config, x), r) for r in runs]
    return sorted(((v, r) for v, r in points if v is not None), key=lambda p: p[0])


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def plot_latency_vs_load(
    runs: Mapping[str, Sequence[RunResult]], path: str | Path, x: SweepAxis = "rate"
) -> Path:
    """TTFT, TPOT, ITL and end-to-end latency (p50, p90, p99) against load, per scenario.

    `runs` maps a scenario's name to the runs of its sweep. The TTFT and TPOT panels show the
    SLO as a grey line when the runs had one.
    """
    fig = Figure(figsize=(12, 8.5), layout="constrained")
    axes = fig.subplots(2, 2).flatten()
    slo = next((r.summary.slo for rs in runs.values() for r in rs if r.summary.slo), None)
    for ax, (field, title) in zip(axes, _LATENCIES):
        for color, (scenario, sweep) in enumerate(runs.items()):
            points = _sweep(sweep, x)
            xs = [v for v, _ in points]
            for pct, style, marker in _PERCENTILE_STYLES:
                ys = [getattr(getattr(r.summary, field), pct) for _, r in points]
                label = f"{scenario} {pct}"
                ax.plot(xs, ys, linestyle=style, marker=marker, color=f"C{color}", label=label)
        slo_ms = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}.get(field) if slo else None
        if slo_ms is not None:
            ax.axhline(slo_ms, color="grey", linewidth=1, label="SLO")
        ax.set_title(title)
        ax.set_xlabel(_X_LABELS[x])
        ax.set_ylabel("Latency (ms)")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4))
    fig.suptitle("Latency percentiles vs load")
    return _save(fig, path)


def plot_goodput(
    runs: Mapping[str, Sequence[RunResult]],
    path: str | Path,
    target: float = DEFAULT_ATTAINMENT_TARGET,
) -> Path:
    """SLO attainment and goodput against offered rate, per scenario.

    The left panel marks the attainment target and, per scenario, the DistServe goodput: the
    highest swept rate whose attainment reaches it. The right panel shows the requests per
    second that met both SLOs next to all completed requests per second.
    """
    fig = Figure(figsize=(12, 5), layout="constrained")
    left, right = fig.subplots(1, 2)
    for color, (scenario, sweep) in enumerate(runs.items()):
        points = [(v, r) for v, r in _sweep(sweep, "rate") if r.summary.slo_attainment is not None]
        rates = [v for v, _ in points]
        attainment = [100 * r.summary.slo_attainment for _, r in points]
        best = goodput_from_sweep(list(zip(rates, [a / 100 for a in attainment])), target)
        suffix = f" (goodput {best:g} req/s)" if best is not None else " (target never met)"
        left.plot(rates, attainment, marker="o", color=f"C{color}", label=scenario + suffix)
        if best is not None:
            left.axvline(best, color=f"C{color}", linestyle=":", linewidth=1)
        goodput = [r.summary.goodput for _, r in points]
        completed = [r.summary.request_throughput for _, r in points]
        right.plot(rates, goodput, marker="o", color=f"C{color}", label=f"{scenario}: met SLOs")
        right.plot(
            rates, completed, linestyle="--", color=f"C{color}", label=f"{scenario}: all completed"
        )
    left.axhline(100 * target, color="grey", linewidth=1, label=f"target {100 * target:g}%")
    left.set_ylim(0, 105)
    slo = next((r.summary.slo for rs in runs.values() for r in rs if r.summary.slo), None)
    left.set_title(
        f"SLO attainment (TTFT ≤ {slo.ttft_ms:g} ms and TPOT ≤ {slo.tpot_ms:g} ms)"
        if slo
        else "SLO attainment"
    )
    left.set_ylabel("Requests meeting both SLOs (%)")
    right.set_title("Goodput (requests/s meeting both SLOs)")
    right.set_ylabel("Throughput (requests/s)")
    for ax in (left, right):
        ax.set_xlabel(_X_LABELS["rate"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("SLO attainment and goodput vs load")
    return _save(fig, path)


def plot_phase_breakdown(
    phases: Mapping[str, Mapping[str, float]],
    path: str | Path,
    title: str = "Where a request's time goes",
) -> Path:
    """Stacked bars of per-phase time, one bar per scenario; input in seconds, shown in ms.

    `phases` maps a scenario to {phase: seconds} (e.g. queue, prefill, KV transfer, decode),
    each in the order its phases happen; a phase only some scenarios have is stacked right
    after the phase that precedes it there.
    """
    names = list(phases)
    order: list[str] = []
    for parts in phases.values():
        previous = None
        for phase in parts:
            if phase not in order:
                order.insert(order.index(previous) + 1 if previous else 0, phase)
            previous = phase
    fig = Figure(figsize=(max(6.0, 1.6 * len(names) + 3), 5), layout="constrained")
    ax = fig.subplots()
    bottoms = [0.0] * len(names)
    for color, phase in enumerate(order):
        heights = [1000 * phases[n].get(phase, 0.0) for n in names]
        ax.bar(names, heights, bottom=bottoms, color=f"C{color}", label=phase)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, total in enumerate(bottoms):
        ax.annotate(f"{total:,.1f} ms", (i, total), ha="center", va="bottom", fontsize="small")
    ax.margins(y=0.1)
    ax.set_ylabel("Time per request (ms)")
    ax.set_xlabel("Scenario")
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()  # reversed: top of the stack first
    ax.legend(
        handles[::-1], labels[::-1], title="Phase", loc="upper left", bbox_to_anchor=(1.01, 1)
    )
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)



def plot_ttft_timeline(
    run: RunResult,
    events: Mapping[str, float | None],
    path: str | Path,
    title: str,
) -> Path:
    """Each request's TTFT against when it was sent, failed requests marked along the time
    axis, and a vertical line per event (seconds from the run's start; None: it did not
    happen). The TTFT axis is logarithmic: a fault's outliers and steady serving both show."""
    fig = Figure(figsize=(12, 5), layout="constrained")
    ax = fig.subplots()
    ok = [(r.start, 1000 * r.ttft) for r in run.requests if r.ok and r.ttft is not None]
    failed = [r.start for r in run.requests if not r.ok]
    ax.scatter([x for x, _ in ok], [y for _, y in ok], s=12, color="C0", label=f"TTFT ({len(ok)} requests)")
    if failed:
        ax.scatter(failed, [0.02] * len(failed), marker="x", color="black", transform=ax.get_xaxis_transform(), label=f"failed ({len(failed)})")
    for k, (name, t) in enumerate(events.items()):
        if t is not None:
            ax.axvline(t, color=_EVENT_COLORS[k % len(_EVENT_COLORS)], linestyle="--", linewidth=1.2, label=f"{name} ({t:.2f} s)")
    if ok:
        ax.set_yscale("log")
    ax.set_xlabel("Sent at (s from the load's start)")
    ax.set_ylabel("Time to first token (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small", loc="upper left")
    return _save(fig, path)

def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-") or "run"


# ---- tandem bench's summary ----

# Tandem's colocated engine and a plain vLLM server should agree within this (issue 4).
AGREEMENT = 0.20


def _headline(run: RunResult) -> RunResult:
    """The run with only the server metrics the results table shows."""
    metrics = {k: v for k, v in run.summary.server_metrics.items() if k in HEADLINE_METRICS}
    return msgspec.structs.replace(run, summary=msgspec.structs.replace(run.summary, server_metrics=metrics))


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _signed_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f}"


def phase_table(scenarios: Sequence[ScenarioReport]) -> str:
    """Phases as rows, one column per scenario and path, plus their sum."""
    return phases_markdown({name: phases for s in scenarios for name, phases in s.phases_ms.items()})


def phases_markdown(columns: Mapping[str, Mapping[str, float]], total: str = "= mean TTFT", digits: int = 1) -> str:
    """Phases (ms, `digits` decimals) as rows, one column each, then their sum labelled
    `total`; empty without columns."""
    if not columns:
        return ""

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:,.{digits}f}"

    names = list(dict.fromkeys(p for phases in columns.values() for p in phases))
    lines = ["| Phase (mean ms) | " + " | ".join(columns) + " |", "| --- |" + " ---: |" * len(columns)]
    for phase in names:
        lines.append(f"| {phase} | " + " | ".join(ms(c.get(phase)) for c in columns.values()) + " |")
    lines.append(f"| **{total}** | " + " | ".join(ms(sum(c.values())) for c in columns.values()) + " |")
    return "\n".join(lines) + "\n"


def overhead_table(scenarios: Sequence[ScenarioReport]) -> str:
    """HTTP path vs direct path per scenario and rate: TTFT, TPOT, end-to-end, and the difference."""
    rows = [(s, o) for s in scenarios for o in s.overhead]
    if not rows:
        return ""
    lines = [
        "| Scenario | Rate (req/s) | TTFT mean HTTP / direct (ms) | added | TTFT p50 HTTP / direct | added | TPOT p50 HTTP / direct | added | E2E p50 HTTP / direct | added |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, o in rows:
        cells = [s.label, f"{o.rate:g}"]
        for f in ("ttft_mean_ms", "ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms"):
            cells += [f"{_ms(getattr(o.http, f))} / {_ms(getattr(o.direct, f))}", _ms(o.added_ms(f))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Split by phase (mean ms per request):", "", "| Scenario | Rate (req/s) | Phase | HTTP | direct | added by HTTP path |",
              "| --- | ---: | --- | ---: | ---: | ---: |"]
    for s, o in rows:
        lines += [f"| {s.label} | {o.rate:g} | {phase} | {_ms(h)} | {_ms(d)} | {_ms(a)} |" for phase, h, d, a in o.phase_rows()]
    return "\n".join(lines) + "\n"


def transfer_table(report: BenchReport) -> str:
    """Raw NIXL READs of the model's block shapes, then what each disaggregated scenario achieved."""
    out = micro_markdown(report.micro) if report.micro else ""
    raw = next((m for m in report.micro if m.label.endswith("prompt")), None)
    lines = [
        "| Scenario | KV transfers | Bytes / transfer | ms / transfer | GiB/s | of raw NIXL (same size) | slowest (ms, from start-up) | slower than kv_transfer.slow_transfer_s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in report.scenarios:
        n = s.kv_total(KV_TRANSFERS)
        if not n:
            continue
        rate = s.kv_gib_s
        share = f"{100 * rate / raw.gib_per_s:.1f}%" if rate and raw and raw.gib_per_s else "—"
        slowest = _ms(None if s.kv_max_s is None else 1000 * s.kv_max_s)
        lines.append(
            f"| {s.label} | {n:.0f} | {s.kv_total(KV_BYTES) / n:,.0f} | {1000 * s.kv_total(KV_SECONDS) / n:.2f} | "
            f"{_ms(rate) if rate is None else f'{rate:.3f}'} | {share} | {slowest} | {s.kv_total(KV_SLOW):.0f} |"
        )
    if len(lines) > 2:
        out += "\nTandem serving (decode engines' NIXL timing, from /metrics):\n\n" + "\n".join(lines) + "\n"
    return out


def _cpu(cpu: ServerCpu | None) -> str:
    return "—" if cpu is None else f"{cpu.engine:.2f} / {cpu.other:.2f}"


def _stolen(run: RunResult | None) -> str:
    return "—" if run is None or run.host_cpu is None else f"{100 * run.host_cpu.steal:.1f}%"


def vllm_comparison(scenarios: Sequence[ScenarioReport]) -> str:
    """Tandem colocated:1 against a plain vLLM server, rate by rate (empty unless both ran).

    Where the direct-to-engine runs were made (every rate, unless --no-overhead), the difference
    is split into what Tandem's HTTP path adds (HTTP minus direct) and what is left on the engine side
    (direct minus vLLM), so a gap beyond 20% comes with its measured cause. The CPU-matched
    column is the vLLM server beside a ballast of the extra CPU Tandem's stack took: where the
    engine side is within 20% of it, that CPU explains the engine side. Two rows per rate
    compare vLLM's own time to first token and TPOT, timed by the engine core, in both servers;
    the last two show the CPU each server's processes used and the host's stolen time.
    """
    by_round: dict[int | None, dict[str, ScenarioReport]] = {}
    for s in scenarios:
        by_round.setdefault(s.round, {})[s.scenario.name] = s
    pairs = [(r["colocated:1"], r["vllm-server"]) for r in by_round.values() if "colocated:1" in r and "vllm-server" in r]
    if not pairs:
        return ""
    lines = [
        "| Rate (req/s) | Metric (p50, ms) | vLLM server | Tandem colocated:1 | Tandem − vLLM | Tandem direct to the engine actor | of which HTTP path "
        "| of which engine side | vLLM server beside Tandem's extra CPU | Verdict |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for tandem, plain in pairs:
        lines += _vllm_rows(tandem, plain)
    return "\n".join(lines) + "\n"


def _vllm_rows(tandem: ScenarioReport, plain: ScenarioReport) -> list[str]:
    """vllm_comparison's rows for one round's pair, rate by rate."""
    lines = []
    for t, v in zip(tandem.runs, plain.runs):
        rate = t.config.rate
        at = round_label(f"{rate:g}", tandem.round)
        o = tandem.overhead_at(rate)
        d = next((r for r in tandem.direct if r.config.rate == rate), None)
        m = next((c for c in plain.cpu_matched if c.run.config.rate == rate), None)
        for label, field, direct_field in (("TTFT", "ttft_ms", "ttft_p50_ms"), ("TPOT", "tpot_ms", "tpot_p50_ms")):
            a, b = getattr(v.summary, field).p50, getattr(t.summary, field).p50
            if a is None or b is None:
                continue
            diff = b - a
            direct = getattr(o.direct, direct_field) if o is not None else None
            matched = getattr(m.run.summary, field).p50 if m is not None else None
            http_part = None if direct is None else b - direct
            engine_part = None if direct is None else direct - a
            if abs(diff) <= AGREEMENT * a:
                verdict = f"within {100 * AGREEMENT:.0f}%"
            elif engine_part is not None and abs(engine_part) <= AGREEMENT * a:
                verdict = f"{100 * diff / a:+.0f}%; without Tandem's HTTP path within {100 * AGREEMENT:.0f}% ({100 * engine_part / a:+.0f}%)"
            elif engine_part is not None and matched is not None and abs(direct - matched) <= AGREEMENT * a:
                verdict = (f"{100 * diff / a:+.0f}%: HTTP path {http_part:+.1f} ms, engine side {100 * engine_part / a:+.0f}%, as much as Tandem's extra "
                           f"{m.ballast_cores:.2f} core costs vLLM's own server ({100 * (matched - a) / a:+.0f}%; Tandem direct within {100 * AGREEMENT:.0f}% of it)")
            elif engine_part is not None:
                verdict = f"{100 * diff / a:+.0f}%: HTTP path {http_part:+.1f} ms, engine side {100 * engine_part / a:+.0f}%"
                if matched is not None:
                    verdict += f"; Tandem's extra {m.ballast_cores:.2f} core costs vLLM's own server {100 * (matched - a) / a:+.0f}%"
            else:
                verdict = f"{100 * diff / a:+.0f}% (no direct run at this rate)"
            lines.append(
                f"| {at} | {label} | {a:.1f} | {b:.1f} | {diff:+.1f} | {_ms(direct)} | "
                f"{_signed_ms(http_part)} | {_signed_ms(engine_part)} | {_ms(matched)} | {verdict} |"
            )
        for label, engine_ms in (
            ("engine time to first token (mean; vLLM's engine-core timing: queue + prefill)", engine_first_token_ms),
            ("engine TPOT (mean; vLLM's engine-core timing, no relay)", engine_tpot_ms),
        ):
            a, b = engine_ms(v.summary.server_metrics), engine_ms(t.summary.server_metrics)
            if a is None or b is None:
                continue
            direct = engine_ms(d.summary.server_metrics) if d is not None else None
            matched = engine_ms(m.run.summary.server_metrics) if m is not None else None
            lines.append(
                f"| {at} | {label} | {a:.1f} | {b:.1f} | {b - a:+.1f} | "
                f"{_ms(direct)} | | | {_ms(matched)} | {100 * (b - a) / a:+.0f}% in the engine itself |"
            )
        if t.server_cpu is not None and v.server_cpu is not None:
            note = "ballast: Tandem direct's rest − vLLM server's rest" if m is not None else "no CPU-matched run"
            lines.append(
                f"| {at} | CPU of the server's processes, cores: vLLM engine / rest | {_cpu(v.server_cpu)} | {_cpu(t.server_cpu)} | "
                f"{t.server_cpu.other - v.server_cpu.other:+.2f} rest | {_cpu(d.server_cpu if d else None)} | | | "
                f"{_cpu(m.run.server_cpu if m else None)} | {note} |"
            )
        if t.host_cpu is not None and v.host_cpu is not None:
            lines.append(
                f"| {at} | host CPU time stolen by the hypervisor | {_stolen(v)} | {_stolen(t)} | | {_stolen(d)} | | | {_stolen(m.run if m else None)} | "
                "time stolen slows a run's server, whichever it is |"
            )
    return lines


_WINDOWS: tuple[tuple[WindowName, str], ...] = (
    ("before", "answered before the kill"), ("during", "during the fault (answered after the kill, sent before recovery)"), ("after", "sent after recovery"))


def _seconds_against(value: float | None, goal: float) -> str:
    return "not seen ✗" if value is None else f"{value:.2f} {'✓' if value < goal else '✗'}"


def _fmt_counter(value: float | None) -> str:
    return "— (not on /metrics)" if value is None else f"{value:.0f}"


def routing_table(scenarios: Sequence[ScenarioReport]) -> str:
    """Routing policies side by side (first rate of each scenario run with a policy): latency,
    goodput, and where prompt tokens came from (engine prefix caches, the CPU tier)."""
    rows = []
    for s in scenarios:
        if s.scenario.policy is None or not s.runs:
            continue
        run = s.runs[0].summary
        m, prompt = run.server_metrics, run.total_input_tokens or 0

        def share(name: str) -> str:
            return f"{100 * m[name] / prompt:.0f}%" if prompt and name in m else "n/a"

        rows.append(f"| {s.label} | {_ms(run.ttft_ms.p50)} | {_ms(run.ttft_ms.p99)} | {_ms(run.tpot_ms.p50)} "
                    f"| {share(CACHE_HIT_TOKENS)} | {share(TIER_TOKENS)} | {share(COMPUTED_TOKENS)} "
                    f"| {int(m.get(LOCAL_PREFILLS, 0))} | {run.goodput or 0:.2f} | {run.num_completed}/{run.num_requests} |")
    if not rows:
        return ""
    head = ("| scenario | TTFT p50 | TTFT p99 | TPOT p50 | prefix-cache hits | CPU-tier hits | computed "
            "| local prefills | goodput (req/s) | completed |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    return (head + "\n".join(rows) + "\n\nToken shares are of the prompt tokens clients sent (an engine's hit on a "
            "remote prefill and the decode engine's own hit may both count).\n")


def pooled_summary(runs: Sequence[RunResult]) -> RunSummary:
    """One summary over the measured requests of several runs (rounds of one scenario at one
    rate): percentiles of all their requests together, durations summed."""
    requests = [q for run in runs for q in run.requests]
    return summarize(requests, sum(run.summary.duration_s for run in runs), runs[0].summary.slo)


def _interval_cell(rounds: Sequence[tuple[Sequence[float | None], Sequence[float | None]]]) -> str:
    """`ratio_interval`'s 95% intervals of TTFT p50 / mean / p99, A's over B's, for each
    round's requests given by position, those that completed on both sides; "—" when a round
    has none or the sides sent different numbers (they were not one request list)."""
    paired = []
    for a, b in rounds:
        pairs = [(x, y) for x, y in zip(a, b) if x and y]
        if len(a) != len(b) or not pairs:
            return "—"
        paired.append(([x for x, _ in pairs], [y for _, y in pairs]))
    if not paired:
        return "—"
    return " / ".join(f"{low:.2f}-{high:.2f}x" for low, high in ratio_interval(paired).values())


def _ttfts_by_index(run: RunResult, count: int) -> list[float | None]:
    """The run's TTFTs by request index (None: failed, or not in this run)."""
    ttfts: list[float | None] = [None] * count
    for q in run.requests:
        if q.ok and 0 <= q.index < count:
            ttfts[q.index] = q.ttft
    return ttfts


def _rounds_head(rounds: Sequence[int]) -> list[str]:
    return ["| scenario | rate (req/s) | pooled TTFT p50 / mean / p99 (ms) | pooled TPOT p50 (ms) | "
            + " | ".join(f"round {r + 1}: p50 / mean" for r in rounds)
            + " | median of rounds: p50 / mean | pooled: p50 / mean / p99 | 95% interval of pooled |",
            "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in rounds) + " | ---: | ---: | ---: |"]


def _rounds_row(name: str, reference: str, grid: Mapping[tuple[str, int | None], ScenarioReport],
                pooled_by: Mapping[tuple[str, int], RunSummary], rounds: Sequence[int], k: int) -> str:
    """`name`'s row at its k-th rate: its pooled figures (`pooled_by`, by scenario and rate),
    its TTFT p50 and mean over `reference`'s round by round and their median, the pooled
    ratios and their interval."""
    ref_pooled, pooled = pooled_by[reference, k], pooled_by[name, k]
    mine = [(r, grid[name, r].runs[k]) for r in rounds if (name, r) in grid]
    ratios: dict[int, tuple[float, float]] = {}
    paired: list[tuple[list[float | None], list[float | None]]] = []
    for r, run in mine:
        ref = grid.get((reference, r))
        if ref is not None:
            count = max((q.index + 1 for q in (*run.requests, *ref.runs[k].requests)), default=0)
            paired.append((_ttfts_by_index(run, count), _ttfts_by_index(ref.runs[k], count)))
        a, b = run.summary.ttft_ms, ref.runs[k].summary.ttft_ms if ref else Percentiles()
        if a.p50 and a.mean and b.p50 and b.mean:
            ratios[r] = (a.p50 / b.p50, a.mean / b.mean)
    cells = [f"{ratios[r][0]:.2f}x / {ratios[r][1]:.2f}x" if r in ratios else "—" for r in rounds]
    median = (f"{statistics.median(x[0] for x in ratios.values()):.2f}x / {statistics.median(x[1] for x in ratios.values()):.2f}x"
              if ratios else "—")
    t, ref_t = pooled.ttft_ms, ref_pooled.ttft_ms
    whole = " / ".join(f"{x / y:.2f}x" if x and y else "—" for x, y in ((t.p50, ref_t.p50), (t.mean, ref_t.mean), (t.p99, ref_t.p99)))
    return (f"| {name} | {mine[0][1].config.rate:g} | {_ms(t.p50)} / {_ms(t.mean)} / {_ms(t.p99)} | {_ms(pooled.tpot_ms.p50)} | "
            + " | ".join(cells) + f" | {median} | {whole} | {'' if name == reference else _interval_cell(paired)} |")


def _always_twin(scenario: Scenario, among: Sequence[Scenario]) -> Scenario | None:
    """The scenario in `among` that runs `scenario`'s pools and policy disaggregating every
    request, when `scenario` is a `+conditional` one: issue 17's "never worse than always"."""
    if not scenario.conditional:
        return None
    twin = msgspec.structs.replace(scenario, conditional=False)
    return next((s for s in among if msgspec.structs.replace(s, name=scenario.name) == twin), None)


def rounds_table(scenarios: Sequence[ScenarioReport]) -> str:
    """With several rounds: every scenario's TTFT p50 and mean over the first scenario's in the
    same round, round by round, the median of those ratios, and the figures of every round's
    requests pooled (with their ratio to the first scenario's pooled and its 95% interval,
    `_interval_cell`: the same requests paired round by round); then each `+conditional`
    scenario against its always twin, where that twin is not the first. Empty with one round.
    A ratio within a round sets two deployments minutes apart; their median over rounds run
    in alternating order is what a host drifting over the whole bench does not move."""
    rounds = sorted({s.round for s in scenarios if s.round is not None})
    if len(rounds) < 2:
        return ""
    listed = list({s.scenario.name: s.scenario for s in scenarios}.values())
    grid = {(s.scenario.name, s.round): s for s in scenarios}
    reference = listed[0].name
    num_rates = min(len(s.runs) for s in scenarios)
    pooled = {(s.name, k): pooled_summary([grid[s.name, r].runs[k] for r in rounds if (s.name, r) in grid])
              for s in listed for k in range(num_rates)}
    lines = _rounds_head(rounds) + [_rounds_row(s.name, reference, grid, pooled, rounds, k)
                                    for k in range(num_rates) for s in listed]
    text = "\n".join(lines) + f"\n\nRatios are to {reference} (the first scenario listed) in the same round; every round sends the same requests to fresh deployments.\n"
    twins = [(s, t) for s in listed if (t := _always_twin(s, listed)) is not None and t.name != reference]
    if twins:
        rows = [row for s, t in twins for k in range(num_rates)
                for row in (_rounds_row(t.name, t.name, grid, pooled, rounds, k), _rounds_row(s.name, t.name, grid, pooled, rounds, k))]
        text += "\nEach conditional scenario against its twin that disaggregates every request, in the same round:\n\n" + "\n".join(_rounds_head(rounds) + rows) + "\n"
    return text


def route_label(r: RequestResult) -> str | None:
    """Where a request ran, from its response headers: "prefill-1 → decode-0" for a remote
    prefill, "decode-0 (local)" for one the decode engine computed, else the engine."""
    if r.engine is None and r.prefill_engine is None:
        return None
    if r.prefill_engine is not None:
        return f"{r.prefill_engine} → {r.engine or 'none'}"
    local = r.disaggregation is not None and r.disaggregation.startswith("decision=local")
    return f"{r.engine} (local)" if local else r.engine


def route_table(scenarios: Sequence[ScenarioReport]) -> str:
    """Each scenario's measured requests at its first rate (its rounds pooled), split by the
    engines that served them (`route_label`): how many, and their TTFT and TPOT. It tells a
    slow replica or a slow path from a slow policy. Empty unless some scenario used more than
    one route."""
    pooled: dict[str, list[RequestResult]] = {}
    for s in scenarios:
        if s.runs:
            pooled.setdefault(s.scenario.name, []).extend(q for q in s.runs[0].requests if q.ok)
    rows = []
    for name, requests in pooled.items():
        routes: dict[str, list[RequestResult]] = {}
        for q in requests:
            if (label := route_label(q)) is not None:
                routes.setdefault(label, []).append(q)
        if len(routes) < 2:
            continue
        for label, qs in sorted(routes.items()):
            ttft = percentiles_ms([q.ttft for q in qs if q.ttft is not None])
            tpot = percentiles_ms([q.tpot for q in qs if q.tpot is not None])
            rows.append(f"| {name} | {label} | {len(qs)} | {_ms(ttft.p50)} / {_ms(ttft.mean)} / {_ms(ttft.p99)} | {_ms(tpot.p50)} |")
    if not rows:
        return ""
    head = "| scenario | route | requests | TTFT p50 / mean / p99 (ms) | TPOT p50 (ms) |\n| --- | --- | ---: | ---: | ---: |\n"
    return head + "\n".join(rows) + "\n\nRoutes as the responses' x-tandem-* headers name them; rounds pooled.\n"


def fault_table(faults: Sequence[FaultReport]) -> str:
    """One column per fault scenario, each figure beside its goal (✓ met, ✗ missed); then the
    errors of the requests lost."""
    if not faults:
        return ""
    rows: list[tuple[str, str, list[str]]] = [
        ("engine killed (SIGKILL)", "", [f"{f.victim}, pid {f.pid}, {f.kill_s:.1f} s into the load" for f in faults]),
        ("time to detect (s): kill to out of routing", f"< {GOAL_DETECT_S:g}", [_seconds_against(f.detect_s, GOAL_DETECT_S) for f in faults]),
        ("time to recover (s): kill to healthy again, restart counted", f"< {GOAL_RECOVER_S:g}", [_seconds_against(f.recover_s, GOAL_RECOVER_S) for f in faults]),
        ("requests lost", str(GOAL_LOST), [f"{f.num_lost} of {f.run.summary.num_requests} {'✓' if f.num_lost <= GOAL_LOST else '✗'}" for f in faults]),
    ]
    for name, words in _WINDOWS:
        cells = []
        for f in faults:
            w = f.window(name)
            failed = f", {w.num_failed} failed" if w.num_failed else ""
            cells.append(f"{_ms(w.ttft_ms.p50)} / {_ms(w.ttft_ms.p99)} (n={w.num_requests}{failed})")
        rows.append((f"TTFT p50 / p99 (ms), requests {words}", "", cells))
    rows += [(f"{name} over the run", "", [_fmt_counter(f.counter(name)) for f in faults]) for name in FAULT_COUNTERS]
    rows.append(("victim's state (s from the kill)", "", [", ".join(f"{s.state}{f' (pid {s.pid})' if s.pid else ''} {s.t - f.kill_s:+.2f}" for s in f.timeline) for f in faults]))
    rows.append(("status answers / longest gap between two (s)", "", [f"{f.num_samples} / {f.max_gap_s:.2f}" for f in faults]))
    lines = ["| | Goal | " + " | ".join(f.scenario.name for f in faults) + " |", "| --- | --- |" + " --- |" * len(faults)]
    lines += [f"| {label} | {goal} | " + " | ".join(cells) + " |" for label, goal, cells in rows]
    lost = [f"- {f.scenario.name}: {n} × `{error}`" for f in faults for error, n in f.run.summary.errors.items()]
    if lost:
        lines += ["", "Requests lost, by error:", "", *lost]
    plots = ", ".join(f"[{_slug(f.scenario.name)}.png]({_slug(f.scenario.name)}.png)" for f in faults)
    return "\n".join(lines) + f"\n\nEach request's TTFT against its send time, with the kill, detection and recovery: {plots}.\n"


def summary_markdown(report: BenchReport) -> str:
    o = report.options
    runs = [r for s in report.scenarios for r in s.runs]
    env = next((r.environment for r in [*runs, *(f.run for f in report.faults)]), None)
    parts = [
        "# Tandem bench\n",
        f"Command: `{report.command}`  ",
        (f"Workload: random prompts of {o.input_len} tokens, {o.output_len} output tokens (ignore_eos), Poisson arrivals at "
         if o.workload == "random" else
         f"Workload: {o.turns}-turn chats after one shared {o.input_len}-token system prompt, each turn resending the history "
         f"with a 32-96-token user message, {o.output_len} output tokens (ignore_eos), Poisson arrivals at ")
        + f"{', '.join(f'{r:g}' for r in o.rates)} req/s, {o.num_requests} measured requests per rate after {o.warmup} warm-up, seed {o.seed}; "
        f"SLO TTFT ≤ {o.slo_ttft_ms:g} ms and TPOT ≤ {o.slo_tpot_ms:g} ms.  ",
    ]
    if env:
        parts.append(f"Machine: {env.cpu_count} CPUs, {env.platform}, Python {env.python}; {', '.join(f'{k} {v}' for k, v in env.versions.items())}.  ")
    parts.append(f"Whole run: {report.elapsed_s / 60:.1f} min; start-up per scenario: "
                 + ", ".join(f"{s.label} {s.startup_s:.0f} s" for s in report.scenarios)
                 + "".join(f", {f.scenario.name} {f.startup_s:.0f} s" for f in report.faults) + ".\n")
    if runs:
        parts += ["## Serving over HTTP (latencies p50 / p99)\n", markdown_table([_headline(r) for r in runs], PER_REQUEST_METRICS)]
    sections = (
        (f"## Where TTFT goes (rate {o.rates[0]:g} req/s; HTTP = through Tandem's endpoint, direct = router in the bench process)\n", phase_table(report.scenarios)),
        ("## Orchestration overhead: Tandem's HTTP path over calling the engine actors directly\n", overhead_table(report.scenarios)),
        ("## KV transfer efficiency\n", transfer_table(report)),
        ("## Tandem colocated vs a plain vLLM server\n", vllm_comparison(report.scenarios)),
        (_fault_heading(report), fault_table(report.faults)),
        (f"## Routing policies (rate {o.rates[0]:g} req/s)\n", routing_table(report.scenarios)),
        (f"## {o.rounds} rounds, each scenario against the first of its round\n", rounds_table(report.scenarios)),
        (f"## By route (rate {o.rates[0]:g} req/s): which engines served each request\n", route_table(report.scenarios)),
    )
    parts += [part for heading, table in sections if table for part in (heading, table)]
    return "\n".join(parts)


def _fault_heading(report: BenchReport) -> str:
    o = report.options
    return (f"## Faults: one engine SIGKILLed {o.fault_after_s:g} s into a load at {o.rates[-1]:g} req/s (until {o.fault_tail_s:g} s "
            f"after recovery, {o.fault_window_s:g} s after the kill at most)\n")


def write_bench_report(report: BenchReport, out: Path) -> Path:
    """Write every file; returns the path of summary.md."""
    out.mkdir(parents=True, exist_ok=True)
    sweeps = {s.label: s.runs for s in report.scenarios}
    for s in report.scenarios:
        for k, run in enumerate(s.runs):
            save_json(run, out / f"{_slug(s.label)}-{k:02d}-rate-{run.config.rate:g}.json")
        for k, run in enumerate(s.direct):
            save_json(run, out / f"{_slug(s.label)}-direct-{k:02d}-rate-{run.config.rate:g}.json")
        for k, matched in enumerate(s.cpu_matched):
            save_json(matched.run, out / f"{_slug(s.label)}-cpu-matched-{k:02d}-rate-{matched.run.config.rate:g}.json")
    if sweeps:
        (out / "results.md").write_text(markdown_table([_headline(r) for rs in sweeps.values() for r in rs], PER_REQUEST_METRICS))
        plot_latency_vs_load(sweeps, out / "latency.png")
        plot_goodput(sweeps, out / "goodput.png")
    for f in report.faults:
        name = _slug(f.scenario.name)
        (out / f"{name}.json").write_bytes(msgspec.json.format(msgspec.json.encode(f), indent=2))
        events = {"SIGKILL": f.kill_s, "out of routing": f.detected_at, "healthy again": f.recovered_at}
        plot_ttft_timeline(f.run, events, out / f"{name}.png", f"{f.scenario.name}: {f.victim} SIGKILLed under load at {f.run.config.rate:g} req/s")
    phases = {name: {p: max(0.0, ms) / 1000 for p, ms in v.items()} for s in report.scenarios for name, v in s.phases_ms.items()}
    if phases:
        plot_phase_breakdown(phases, out / "phases.png", title="Where time to first token goes (mean per request)")
    (out / "bench.json").write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2))
    summary = out / "summary.md"
    summary.write_text(summary_markdown(report))
    return summary


def _rounds(results: Sequence[ClientResult]) -> int:
    return max((r.round for r in results), default=0) + 1


def _load_label(r: ClientResult, rounds: int) -> str:
    return r.load if rounds == 1 else f"{r.load}, round {r.round + 1}"


def vllm_client_table(results: list[ClientResult]) -> str:
    """vLLM's figures, each set against the plain vLLM server's under the same load (and round)
    when it ran, and where the prompt tokens came from (an engine-cache hit is counted on the
    prefill engine and again on the decode engine, so the shares can pass 100%)."""
    rounds = _rounds(results)
    reference = {(r.round, r.load): r.vllm for r in results if r.scenario == VLLM_REFERENCE}
    rows = ["| scenario | load | completed / failed | TTFT p50 / p99 (ms) | TPOT p50 (ms) | ITL p50 (ms) "
            "| TPOT mean: client / engine (ms) "
            f"| TTFT / TPOT p50 vs {VLLM_REFERENCE} | prompt tokens: " + " / ".join(TOKEN_SOURCES) + " | local prefills |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        v, ref = r.vllm, reference.get((r.round, r.load))
        ratio = (f"{v['median_ttft_ms'] / ref['median_ttft_ms']:.2f}x / {v['median_tpot_ms'] / ref['median_tpot_ms']:.2f}x"  # type: ignore[operator]
                 if ref is not None and r.scenario != VLLM_REFERENCE else "")
        total = float(v.get("total_input_tokens") or 1)  # type: ignore[arg-type]
        shares = " / ".join(f"{r.metrics.get(n, 0.0) / total:.0%}" for n in TOKEN_SOURCES.values()) if COMPUTED_TOKENS in r.metrics else ""
        engine = r.engine_tpot_ms
        tpot = f"{v['mean_tpot_ms']:.1f} / {engine:.1f}" if engine is not None else f"{v['mean_tpot_ms']:.1f} / —"
        local = f"{r.metrics[LOCAL_PREFILLS]:.0f}" if LOCAL_PREFILLS in r.metrics else ""
        rows.append(f"| {r.scenario} | {_load_label(r, rounds)} | {v['completed']} / {v.get('failed', 0)} | {v['median_ttft_ms']:,.1f} / "
                    f"{v['p99_ttft_ms']:,.1f} | {v['median_tpot_ms']:.1f} | {v['median_itl_ms']:.1f} | {tpot} | {ratio} | {shares} | {local} |")
    return "\n".join(rows)


def reference_scenario(results: Sequence[ClientResult]) -> str | None:
    """The scenario the others are set against round by round: the plain vLLM server when it
    ran, else the first one listed (round 1 runs them in the order given), as Tandem's own
    load generator does; None without results."""
    names = [r.scenario for r in results]
    return VLLM_REFERENCE if VLLM_REFERENCE in names else (names[0] if names else None)


def round_ratios(results: list[ClientResult]) -> str:
    """Each scenario's TTFT and TPOT p50 over the reference's (`reference_scenario`) under the
    same load in the same round, round by round, and the median of each; empty with one
    round. The goals that set Tandem against a plain server are read here."""
    rounds = _rounds(results)
    name = reference_scenario(results)
    reference = {(r.round, r.load): r.vllm for r in results if r.scenario == name}
    if rounds == 1 or not reference:
        return ""
    cells: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for r in results:
        ref = reference.get((r.round, r.load))
        if r.scenario == name or ref is None:
            continue
        ttft, tpot = (float(r.vllm[k]) / float(ref[k]) for k in ("median_ttft_ms", "median_tpot_ms"))  # type: ignore[arg-type]
        cells.setdefault((r.scenario, r.load), {})[r.round] = (ttft, tpot)
    rows = [f"| scenario | load | {' | '.join(f'round {i + 1}' for i in range(rounds))} | median |",
            f"| --- | --- | {' | '.join('---:' for _ in range(rounds + 1))} |"]
    for (scenario, load), by_round in cells.items():
        ratios = [by_round.get(i) for i in range(rounds)]
        median = tuple(statistics.median(x[k] for x in ratios if x is not None) for k in (0, 1))
        row = " | ".join(f"{x[0]:.2f}x / {x[1]:.2f}x" if x is not None else "" for x in [*ratios, median])
        rows.append(f"| {scenario} | {load} | {row} |")
    return "\n".join(rows)


def pooled_ttft(results: list[ClientResult]) -> str:
    """Every round's TTFTs pooled per scenario and load (p50, mean, p99) and set against the
    reference's (`reference_scenario`): percentiles of pooled requests, which a median of
    per-round ratios cannot give for a tail of one or two requests a round, with the 95%
    interval of those ratios (`_interval_cell`: vLLM's client sends the same prompts in the same
    order to every scenario of a round, so its TTFTs pair by position). Needs vLLM's
    per-request figures (`--save-detailed`); empty with one round or without them."""
    if _rounds(results) == 1:
        return ""
    by_round: dict[tuple[str, str, int], list[float]] = {}
    for r in results:
        ttfts = r.vllm.get("ttfts")
        if not isinstance(ttfts, list):
            return ""
        # vLLM records a failed request's TTFT as 0: those are counted as failed, not fast.
        by_round[r.scenario, r.load, r.round] = [float(t) for t in ttfts]
    groups: dict[tuple[str, str], list[float]] = {}
    for (scenario, load, _), ttfts in by_round.items():
        groups.setdefault((scenario, load), []).extend(1000.0 * t for t in ttfts if t)
    figures = {key: (percentile(ms, 50), statistics.fmean(ms), percentile(ms, 99)) for key, ms in groups.items() if ms}
    name = reference_scenario(results)
    rows = [f"| scenario | load | requests | TTFT p50 / mean / p99 (ms) | over {name}'s | 95% interval |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for (scenario, load), fig in figures.items():
        ref = figures.get((name, load)) if scenario != name else None
        over = " / ".join(f"{a / b:.2f}x" for a, b in zip(fig, ref)) if ref else ""
        pairs = [(ttfts, by_round[name, load, i]) for (mine, at, i), ttfts in by_round.items()
                 if (mine, at) == (scenario, load) and (name, load, i) in by_round]
        interval = _interval_cell(pairs) if ref else ""
        rows.append(f"| {scenario} | {load} | {len(groups[(scenario, load)])} | "
                    + " / ".join(f"{x:,.1f}" for x in fig) + f" | {over} | {interval} |")
    return "\n".join(rows)


def pooled(results: list[ClientResult]) -> list[ClientResult]:
    """One result per scenario and load, its rounds pooled: the /metrics growth summed, the
    requests and output tokens summed, the mean TTFT and TPOT weighted by requests (what
    the budgets read). Percentiles do not pool; the tables above keep every round."""
    groups: dict[tuple[str, str], list[ClientResult]] = {}
    for r in results:
        groups.setdefault((r.scenario, r.load), []).append(r)
    merged = []
    for (scenario, load), rs in groups.items():
        if len(rs) == 1:
            merged.append(rs[0])
            continue
        completed = [float(r.vllm.get("completed") or 0) for r in rs]  # type: ignore[arg-type]
        vllm: dict[str, object] = {"completed": sum(completed),
                                   "total_output_tokens": sum(float(r.vllm.get("total_output_tokens") or 0) for r in rs)}  # type: ignore[arg-type]
        for key in ("mean_ttft_ms", "mean_tpot_ms"):
            measured = [(n, float(r.vllm[key])) for n, r in zip(completed, rs) if n and key in r.vllm]  # type: ignore[arg-type]
            if measured:
                vllm[key] = sum(n * x for n, x in measured) / sum(n for n, _ in measured)
        metrics: dict[str, float] = {}
        for r in rs:
            for name, value in r.metrics.items():
                metrics[name] = metrics.get(name, 0.0) + value
        merged.append(ClientResult(scenario, load, vllm, metrics))
    return merged


def vllm_client_budget(results: list[ClientResult], scenarios: list[Scenario]) -> str:
    """Where the mean TTFT vLLM's client saw went, per Tandem scenario and load
    (`benchmarks.phases.ttft_phases`: the router's phases and the engine cores' timestamps
    from /metrics), rounds pooled; empty without Tandem scenarios."""
    by_name = {s.name: s for s in scenarios}
    columns: dict[str, dict[str, float]] = {}  # ms
    for r in pooled(results):
        scenario, served = by_name.get(r.scenario), requests_with_first_token(r.metrics)
        if scenario is None or not scenario.is_tandem or not served:
            continue
        mean_ttft_s = float(r.vllm["mean_ttft_ms"]) / 1000  # type: ignore[arg-type]
        phases = ttft_phases(router_phases_from_metrics(r.metrics), r.metrics, scenario.kind == "disaggregated",
                             mean_ttft_s, served, decode_share_from_metrics(r.metrics))
        columns[f"{r.scenario}, {r.load}"] = {p: 1000 * seconds for p, seconds in phases.items()}
    return phases_markdown(columns, "= client's mean TTFT")


def vllm_client_tpot_budget(results: list[ClientResult]) -> str:
    """Where the mean TPOT vLLM's client saw went, per scenario and load, the plain vLLM
    server's included (`benchmarks.phases.tpot_phases`: the router's second-token phase and
    the engines' own TPOT from /metrics), rounds pooled; empty when no server exposed its
    engine TPOT."""
    columns: dict[str, dict[str, float]] = {}  # ms
    for r in pooled(results):
        completed = float(r.vllm.get("completed") or 0)  # type: ignore[arg-type]
        if not completed:
            continue
        tokens = float(r.vllm["total_output_tokens"]) / completed  # type: ignore[arg-type]
        phases = tpot_phases(router_phases_from_metrics(r.metrics), r.metrics, float(r.vllm["mean_tpot_ms"]) / 1000, tokens)  # type: ignore[arg-type]
        if phases:
            columns[f"{r.scenario}, {r.load}"] = {p: 1000 * seconds for p, seconds in phases.items()}
    return phases_markdown(columns, "= client's mean TPOT", digits=2)


def peer_comparison(results: list[ClientResult]) -> str:
    """Ray Serve LLM's figures over each other scenario's under the same load (how many times
    slower it was), for the scenarios that are neither it nor the plain vLLM server; empty
    when it did not run. Each is set against Ray Serve LLM's run of the same round."""
    rounds = _rounds(results)
    peer = {(r.round, r.load): r.vllm for r in results if r.scenario == PEER_REFERENCE}
    lines = []
    for r in results:
        ref = peer.get((r.round, r.load))
        if ref is None or r.scenario in (PEER_REFERENCE, VLLM_REFERENCE):
            continue
        ratios = [float(ref[k]) / float(r.vllm[k]) for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")]  # type: ignore[arg-type]
        lines.append(f"| {r.scenario} | {_load_label(r, rounds)} | " + " | ".join(f"{x:.1f}x" for x in ratios) + " |")
    if not lines:
        return ""
    return "\n".join([f"| scenario | load | {PEER_REFERENCE}'s TTFT p50 over this | TTFT p99 | TPOT p50 |",
                      "| --- | --- | ---: | ---: | ---: |", *lines])


def write_vllm_client_report(results: list[ClientResult], out: Path, command: str, scenarios: list[Scenario]) -> str:
    """summary.md (the command, the table, the TTFT and TPOT budgets) and results.json in `out`; returns
    the tables."""
    text = vllm_client_table(results)
    if ratios := round_ratios(results):
        name = reference_scenario(results)
        text += (f"\n\nTTFT / TPOT p50 over {name}'s, round by round (each round's own "
                 f"{name} run), and the median:\n\n" + ratios)
    if pooled_table := pooled_ttft(results):
        text += "\n\nEvery round's requests pooled:\n\n" + pooled_table
    if budget := vllm_client_budget(results, scenarios):
        text += "\n\nWhere the mean TTFT went (`benchmarks.phases`):\n\n" + budget.rstrip("\n")
    if budget := vllm_client_tpot_budget(results):
        text += "\n\nWhere the mean TPOT went, per interval between two tokens (`benchmarks.phases`):\n\n" + budget.rstrip("\n")
    if peer := peer_comparison(results):
        text += "\n\nAgainst Ray Serve LLM's 1P1D (`benchmarks.ray_serve_llm`), same run:\n\n" + peer
    (out / "summary.md").write_text(f"`{command}`\n\n{text}\n")
    (out / "results.json").write_bytes(msgspec.json.encode(results))
    return text
