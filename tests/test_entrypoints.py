"""`tandem serve`, `serve run orchestrator.serve:build_app` and `ray job submit ...
orchestrator.job` as a user runs them.

Each starts its own Ray (embedded, or a `ray start --head` cluster), serves a real 1P1D
deployment, answers the official openai client, and leaves no process behind when stopped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import psutil
import pytest
import yaml

from orchestrator.placement import binding_cores
from tests.conftest import free_port

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# `serve run IMPORT_PATH` serves on Ray Serve's default port; it has no option to move it.
SERVE_RUN_PORT = 8000
READY = re.compile(r"Tandem ready: serving 'tandem-tiny' \(1 prefill \+ 1 decode\) at (http://\S+/v1)")


def write_config(tmp_path: Path, **serve: object) -> Path:
    path = tmp_path / "tandem.yaml"
    cfg = {
        "engine_args": {"max_model_len": 512},
        "serve": {"port": free_port(), **serve},
        "kv_transfer": {"side_channel_base_port": free_port(8)},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def wait_for(pattern: re.Pattern[str], read: Callable[[], str], timeout: float, what: str, fail: str | None = None) -> re.Match[str]:
    """Poll `read()` until `pattern` shows up; give up at once if `fail` shows up instead."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = read()
        if m := pattern.search(text):
            return m
        if fail and fail in text:
            raise AssertionError(f"{what} failed:\n{text[-4000:]}")
        time.sleep(2)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s; output so far:\n{read()[-4000:]}")


def ask(url: str) -> None:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model="tandem-tiny", prompt="hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    s = client.chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
    assert [c.choices[0].finish_reason for c in s if c.choices][-1] == "length"


def engine_processes(root: psutil.Process) -> list[psutil.Process]:
    """vLLM engine processes (engine actors, engine cores, workers) under `root`."""
    out = []
    for p in root.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "EngineActor" in cmd or "EngineCore" in cmd or "VLLM" in p.name():
            out.append(p)
    return out


def interrupt_leaving_nothing(proc: subprocess.Popen[bytes], what: str) -> int:
    """Ctrl-C `what` (it must have engine processes under it); its exit code, once nothing it
    started outlives a bounded wait."""
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert engine_processes(psutil.Process(proc.pid)), f"expected engine processes under {what}"
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=180)
    # Ray and vLLM processes get their signals at exit and may take a while to go on a
    # loaded host; none may outlive a bounded wait.
    _, alive = psutil.wait_procs(tree, timeout=90)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"{what} left behind: {[(p.pid, p.name()) for p in alive]}"
    return code


def test_tandem_serve_serves_and_stops_cleanly(tmp_path: Path) -> None:
    """Also: with serve.log_requests, each request's line (engines, decision, phases) reaches
    the console, and its response headers name the same engines."""
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(BIN / "tandem"), "serve", str(write_config(tmp_path, log_requests=True))],
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        url = wait_for(READY, log.read_text, 720, "the ready line").group(1)
        ask(url)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(model="tandem-tiny", prompt="hello", max_tokens=4,
                                                          extra_headers={"X-Request-Id": "logged-7"})
        assert raw.parse().usage.completion_tokens == 4
        assert (raw.headers["x-tandem-prefill-engine"], raw.headers["x-tandem-engine"]) == ("prefill-0", "decode-0")
        assert raw.headers["x-tandem-disaggregation"] == "decision=remote;reason=always"
        line = re.compile(r"tandem\.requests INFO request \S*logged-7\S*: \d+ prompt tokens \(\d+ cached\), 4 generated; "
                          r"prefilled on prefill-0, streamed from decode-0 \(remote: always\); ingress [\d.]+ ms, prefill [\d.]+ ms")
        wait_for(line, log.read_text, 60, "the request's log line")
        assert interrupt_leaving_nothing(proc, "tandem serve") == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def engine_core_started(pid: int) -> bool:
    """Whether a vLLM engine core process runs under `pid` (False once `pid` is gone)."""
    try:
        cores = [p for p in engine_processes(psutil.Process(pid)) if "EngineCore" in p.name()]
    except psutil.Error:  # `pid`, or a process listed a moment ago, has exited
        return False
    return bool(cores)


def test_ctrl_c_while_the_engines_start_stops_everything_it_had_started(tmp_path: Path) -> None:
    """Ctrl-C before `tandem serve` is ready (on a cluster a start takes minutes): one line
    says start-up was interrupted, no traceback, exit code 130, and nothing it started (Ray,
    the engine actors, vLLM's engine cores) outlives it."""
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(BIN / "tandem"), "serve", str(write_config(tmp_path))], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        # Interrupt while vLLM's engine core starts: the engines are half up, nothing is ready.
        deadline = time.time() + 600
        while not engine_core_started(proc.pid):
            assert proc.poll() is None and time.time() < deadline, f"no engine core started:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        assert interrupt_leaving_nothing(proc, "tandem serve while starting") == 130, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "tandem: start-up interrupted; everything it had started is stopped" in text
    assert "Tandem ready" not in text and "Traceback" not in text, text[-4000:]


@pytest.fixture
def ray_head() -> Iterator[tuple[str, str, dict[str, str]]]:
    """A `ray start --head --block` cluster on loopback, every port chosen free (other Ray
    instances on the machine hold the defaults); yields (job address, ":<GCS port>", env).
    (Ray rewrites a loopback node IP to the machine's own, so processes are matched by port.)

    Token auth is off for this loopback-only test cluster, explicitly, so the test does not
    depend on whether ~/.ray/auth_token exists.
    """
    dash, gcs = free_port(), free_port()
    # The venv's bin first on PATH, as for a user who activated it: jobs run `python`.
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    # No drain at the end: Serve's controller and proxy, which the job leaves to the cluster,
    # would hold the head's SIGTERM for Ray's 30-s drain of a node being preempted.
    env = {**os.environ, "PATH": path, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    ports = {
        "--port": gcs, "--dashboard-port": dash, "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(), "--metrics-export-port": free_port(),
        "--runtime-env-agent-port": free_port(), "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
    }
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "4", "--node-ip-address", "127.0.0.1",
           "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--disable-usage-stats"]
    cmd += [str(a) for kv in ports.items() for a in kv]
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    job_env = {**env, "RAY_ADDRESS": f"http://127.0.0.1:{dash}"}
    try:
        yield job_env["RAY_ADDRESS"], f":{gcs}", job_env
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass  # a loaded host; whatever is left of the head goes below
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_ray_job_submit_serves_and_stops_cleanly(ray_head: tuple[str, str, dict[str, str]], tmp_path: Path) -> None:
    _, gcs, env = ray_head
    config = write_config(tmp_path)
    submit_cmd = [str(BIN / "ray"), "job", "submit", "--no-wait", "--working-dir", str(ROOT), "--",
                  "python", "-m", "orchestrator.job", "--config", str(config)]

    def try_submit() -> str:
        # The head's job agent takes a few seconds to come up after `ray start`.
        res = subprocess.run(submit_cmd, env=env, capture_output=True, text=True, timeout=300)
        return res.stdout + res.stderr

    job_id = wait_for(re.compile(r"Job '([^']+)' submitted"), try_submit, 300, "job submission").group(1)

    def logs() -> str:
        return subprocess.run([str(BIN / "ray"), "job", "logs", job_id], env=env, capture_output=True, text=True, timeout=60).stdout

    def logs_and_status() -> str:
        status = subprocess.run([str(BIN / "ray"), "job", "status", job_id], env=env, capture_output=True, text=True, timeout=60)
        return logs() + status.stdout

    # Fail fast only when the job itself failed (Ray's own actors log retried tracebacks).
    url = wait_for(READY, logs_and_status, 720, "the job's ready line", fail="FAILED").group(1)
    ask(url)
    raylet = next(p for p in psutil.process_iter(["name", "cmdline"]) if p.info["name"] == "raylet" and gcs in " ".join(p.info["cmdline"] or []))
    assert engine_processes(raylet)
    subprocess.run([str(BIN / "ray"), "job", "stop", job_id], env=env, capture_output=True, timeout=300, check=True)
    wait_for(re.compile("stopped|STOPPED"), logs_and_status, 180, "the job stopping")
    deadline = time.time() + 120
    while engine_processes(raylet):
        assert time.time() < deadline, f"engines left behind: {[p.pid for p in engine_processes(raylet)]}"
        time.sleep(2)


SERVE_RUN_READY = re.compile(r"Application '[^']+' is ready at (http://[^/\s]+)")


def threads_cores(root: int, title: str) -> list[set[int]]:
    """The allowed cores of every thread of the processes under `root` whose title starts
    with `title` (another test's Ray may still be exiting beside it)."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith(title):
                found += [os.sched_getaffinity(t.id) for t in p.threads()]
        except (psutil.Error, ProcessLookupError):
            continue
    return found


def test_serve_run_build_app_serves_with_rays_processes_off_the_decode_engine(tmp_path: Path) -> None:
    """`serve run orchestrator.serve:build_app config=PATH`, as the README gives it: serves the
    default 1P1D on serve run's own port; Ray's own processes run off the decode engine's
    cores, Serve's proxy and the ingress too, though they start after build_app returned (they
    inherit the confined raylet's mask); Ctrl-C leaves nothing behind."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", SERVE_RUN_PORT)) == 0:
            # Not a skip: a run that could not check this must not pass as one that did.
            pytest.fail(f"port {SERVE_RUN_PORT}, where serve run always serves, is in use on this host; "
                        "stop what listens there (another `serve run` or `tandem serve`) and run the test again")
    log = tmp_path / "serve-run.log"
    cmd = [str(BIN / "serve"), "run", "--app-dir", str(ROOT), "orchestrator.serve:build_app", f"config={write_config(tmp_path)}"]
    with log.open("w") as out:
        # As from a terminal: a runner that ignores SIGINT (a background job) would pass that on,
        # and Python leaves an ignored SIGINT ignored, so serve run would never see the Ctrl-C.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env={**os.environ, "RAY_ADDRESS": ""},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        base = wait_for(SERVE_RUN_READY, log.read_text, 720, "serve run's ready line", fail="Traceback").group(1)
        ask(f"{base}/v1")
        # Serve's and Tandem's actors, on one set of cores narrower than the node's, apart
        # from the decode engine's compute core.
        found = {title: threads_cores(proc.pid, title) for title in ("ray::ServeController", "ray::ProxyActor", "ray::ServeReplica", "ray::PoolManager")}
        assert all(found.values()), f"a process is missing: {found}"
        (cores,) = {frozenset(c) for threads in found.values() for c in threads}
        shown = subprocess.run([str(BIN / "tandem"), "status", "--json"], capture_output=True, text=True,
                               timeout=120, check=True, env={**os.environ, "RAY_ADDRESS": ""}).stdout
        decode = next(r for pool in json.loads(shown)["pools"] if pool["role"] == "decode" for r in pool["replicas"])
        node = os.sched_getaffinity(0)
        assert cores < node and cores.isdisjoint(binding_cores(decode["cpu_binding"] or "")), (cores, node, decode)
        interrupt_leaving_nothing(proc, "serve run")
    finally:
        if proc.poll() is None:
            proc.kill()
