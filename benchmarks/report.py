"""Run results as files people read: JSON per run, a markdown table, PNG plots.

Plots are drawn on bare `matplotlib.figure.Figure` objects rather than through pyplot, so
writing them needs no display and changes no global backend of the calling program.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Literal

import msgspec
from matplotlib.figure import Figure

from benchmarks.loadgen import RunResult
from benchmarks.stats import DEFAULT_ATTAINMENT_TARGET, Percentiles, goodput_from_sweep

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
_EVENT_COLORS = ("C3", "C1", "C2", "C4", "C5")  # red, orange, green, ...: a fault, its detection, recovery


def save_json(result: RunResult, path: str | Path, include_requests: bool = True) -> Path:
    """Write one run as indented JSON; without requests it keeps only config and figures."""
    if not include_requests:
        result = msgspec.structs.replace(result, requests=[])
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


def write_report(
    runs: Mapping[str, Sequence[RunResult]],
    out_dir: str | Path,
    x: SweepAxis = "rate",
    per_request: Collection[str] = (),
) -> list[Path]:
    """Everything for a set of sweeps: a JSON per run, `results.md`, and the plots.

    `runs` maps a scenario's name to the runs of its sweep; the goodput plot is drawn only for
    rate sweeps whose runs had an SLO. Returns the files written.
    """
    out = Path(out_dir)
    written = []
    for scenario, sweep in runs.items():
        for k, run in enumerate(sweep):
            value = getattr(run.config, x)
            name = f"{_slug(scenario)}-{k:02d}-{x}-{'max' if value is None else f'{value:g}'}"
            written.append(save_json(run, out / f"{name}.json"))
    table = out / "results.md"
    table.write_text(markdown_table([r for sweep in runs.values() for r in sweep], per_request))
    written.append(table)
    written.append(plot_latency_vs_load(runs, out / "latency.png", x))
    if x == "rate" and any(r.summary.slo for sweep in runs.values() for r in sweep):
        written.append(plot_goodput(runs, out / "goodput.png"))
    return written
