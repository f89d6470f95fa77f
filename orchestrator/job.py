"""Run one deployment until told to stop: the body of `tandem serve` and of Ray jobs.

    ray job submit --working-dir . -- python -m orchestrator.job --config examples/1p1d-cpu.yaml

joins the running cluster (RAY_ADDRESS, set by `ray job submit`), starts the pools and the
Serve app, prints a ready line, and on SIGINT/SIGTERM (`ray job stop`, Ctrl-C) removes the
app, stops every engine and frees every placement group before exiting.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import ray
from ray import serve

from actors.affinity import pin_process
from actors.logs import setup_logging
from orchestrator.config import TandemConfig, load_config
from orchestrator.cluster import init_ray, session_priority
from orchestrator.deploy import Deployment, keep_own_ray_off_engines
from orchestrator.preflight import preflight
from orchestrator.serve import build_ingress

logger = logging.getLogger("tandem.job")


class Running(msgspec.Struct, frozen=True):
    """A deployment that is up: where to reach it and what runs it."""

    url: str
    deployment: Deployment
    # Where the Ray this process started runs its own processes beside the engines (None: the
    # process joined a Ray started elsewhere).
    ray_cores: list[int] | None = None


@contextmanager
def running(cfg: TandemConfig, address: str | None = None, *, own_ray: bool = True) -> Iterator[Running]:
    """Deploy `cfg` and serve it; on exit remove the app, stop the engines, free the reservations.

    With own_ray=False, Ray must already be initialised (tests and benchmarks share one).
    """
    preflight(cfg)
    embedded = init_ray(cfg, address) if own_ray else False
    deployment = Deployment(cfg)
    # The lowered weight (cpu.session_nice) lasts while this process's own Ray serves.
    with session_priority(cfg.cpu.session_nice if embedded and cfg.device == "cpu" else 0):
        try:
            # With `serve.http: direct` the ingress replicas answer HTTP; Serve's proxy would
            # take their port, so Serve starts none.
            serve.start(proxy_location="Disabled" if cfg.serve.http == "direct" else "EveryNode",
                        http_options={"host": cfg.serve.host, "port": cfg.serve.port})
            deployment.start()
            handle = serve.run(build_ingress(cfg), name=cfg.serve.app_name, route_prefix=cfg.serve.route_prefix)
            ray_cores = keep_own_ray_off_engines()
            yield Running(f"{handle.url.remote().result(timeout_s=60)}/v1", deployment, ray_cores)
        finally:
            try:
                serve.delete(cfg.serve.app_name)
            except Exception as err:  # Serve may not have started; teardown goes on regardless
                logger.warning("could not delete the Serve app: %s", err)
            deployment.stop()
            if not own_ray:  # Ray lives on (tests, benchmarks): its processes go where the deployments left need them
                keep_own_ray_off_engines(leaving=cfg.serve.app_name)
            if embedded:
                serve.shutdown()
            if own_ray:
                ray.shutdown()


def serve_until_stopped(cfg: TandemConfig, address: str | None = None) -> None:
    """Start everything, announce readiness, block until SIGINT/SIGTERM, tear everything down."""
    stop, ready = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        # Before readiness, interrupt start-up (running() still tears down what started).
        if not ready.is_set():
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    t0 = time.perf_counter()
    with running(cfg, address) as up:
        ready.set()
        if up.ray_cores:  # this process only waits (and prints Ray's logs): beside Ray's own
            pin_process(os.getpid(), up.ray_cores)
        shape = " + ".join(f"{p.replicas} {role}" for role, p in cfg.pools.items())
        print(
            f"Tandem ready: serving {cfg.model.name!r} ({shape}) at {up.url} "
            f"after {time.perf_counter() - t0:.0f} s; `tandem status --address {ray.get_runtime_context().gcs_address}"
            f"{'' if cfg.serve.app_name == 'tandem' else ' --app ' + cfg.serve.app_name}` shows its pools; Ctrl-C to stop",
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        logger.info("stop requested; tearing down")
    logger.info("stopped")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.job", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML/TOML/JSON deployment config (default: the tiny 1P1D)")
    parser.add_argument("--address", help="Ray address to join (default: RAY_ADDRESS, else embedded Ray)")
    args = parser.parse_args(argv)
    setup_logging()
    serve_until_stopped(load_config(args.config), args.address)


if __name__ == "__main__":
    sys.exit(main())
