"""`tandem serve | validate | status | bench`."""

from __future__ import annotations

import argparse
import sys

from orchestrator.config import ConfigError, load_config, to_dict


def _serve(args: argparse.Namespace) -> int:
    from actors.logs import setup_logging
    from orchestrator.job import serve_until_stopped

    setup_logging()
    try:
        serve_until_stopped(load_config(args.config), args.address)
    except KeyboardInterrupt:  # Ctrl-C before it was ready: what had started is stopped by now
        print("tandem: start-up interrupted; everything it had started is stopped", file=sys.stderr)
        return 130
    return 0


def _validate(args: argparse.Namespace) -> int:
    from orchestrator.preflight import preflight

    cfg = load_config(args.config)
    preflight(cfg)
    pools = ", ".join(f"{role}: {p.replicas} x (tp={p.tensor_parallel_size}, cpus={p.num_cpus}, gpus={p.num_gpus})" for role, p in cfg.pools.items())
    connector = cfg.kv_transfer.connector if cfg.disaggregated else "none (colocated)"
    print(f"OK {args.config}: model {cfg.model.name!r}; pools {pools}; KV connector {connector}; "
          f"serving on {cfg.serve.host}:{cfg.serve.port}")
    if args.show:
        import json

        shown = to_dict(cfg)
        shown["cpu_tier"]["save_from"], shown["cpu_tier"]["load_into"] = (sorted(p) for p in cfg.tier_pools())
        shown["serve"]["stream_batch_ms"] = cfg.stream_batch_s * 1000  # unset: chosen by device and HTTP mode
        print(json.dumps(shown, indent=2))
    return 0


def _status(args: argparse.Namespace) -> int:
    from orchestrator.status import StatusError, fetch_status, render, to_json

    try:
        status = fetch_status(args.address, args.app)
    except StatusError as err:
        print(f"tandem: {err}", file=sys.stderr)
        return 1
    print(to_json(status) if args.json else render(status))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="deploy and serve until Ctrl-C (no CONFIG: tiny 1P1D on CPU, embedded Ray)")
    p.add_argument("config", nargs="?", help="YAML/TOML/JSON deployment config")
    p.add_argument("--address", help="join this Ray cluster instead of starting an embedded one")
    p.set_defaults(func=_serve)
    p = sub.add_parser("validate", help="check a config (fields, model, engine args, connectors) without starting anything")
    p.add_argument("config")
    p.add_argument("--show", action="store_true", help="print the config with every default filled in")
    p.set_defaults(func=_validate)
    p = sub.add_parser("status", help="each pool and replica of a running deployment: state, node, pid, load, restarts; the CPU tier's fill")
    p.add_argument("--address", default="auto", help="Ray address of the cluster (default: auto, the cluster running on this machine)")
    p.add_argument("--app", default="tandem", help="the deployment's serve.app_name (default: tandem)")
    p.add_argument("--json", action="store_true", help="print JSON: {pools: [{role, replicas: [{id, state, node, pid, outstanding, restarts, last_error, missed_checks}]}], cpu_tier}")
    p.set_defaults(func=_status)
    p = sub.add_parser("bench", help="colocated vs disaggregated (and plain vLLM) on one workload: tables, plots, overhead, KV efficiency")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        # The bench's options live beside it in benchmarks.bench, which imports vLLM and
        # matplotlib (seconds): only `tandem bench` pays for that, not `validate` or `status`.
        from benchmarks.bench import add_arguments, main as bench

        add_arguments(p)
        p.set_defaults(func=bench)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"tandem: config error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
