"""Config parsing and `tandem validate`: every broken config is refused, naming the problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, TandemConfig, load_config, parse_config
from orchestrator.specs import kv_transfer_for
from orchestrator.preflight import preflight

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.*"))


def test_default_is_tiny_1p1d_on_cpu() -> None:
    cfg = TandemConfig()
    assert cfg.model.source == "builtin:tiny"
    assert cfg.disaggregated
    assert {r: p.replicas for r, p in cfg.pools.items()} == {"prefill": 1, "decode": 1}
    assert (cfg.serve.host, cfg.serve.port, cfg.serve.http) == ("127.0.0.1", 8000, "direct")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.pools


def test_yaml_toml_json_give_the_same_config(tmp_path: Path) -> None:
    data = {"model": {"source": "builtin:tiny"}, "prefill": {"replicas": 2}, "decode": {"replicas": 1}}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.yaml").write_text("model: {source: 'builtin:tiny'}\nprefill: {replicas: 2}\ndecode: {replicas: 1}\n")
    (tmp_path / "c.toml").write_text("[model]\nsource = 'builtin:tiny'\n[prefill]\nreplicas = 2\n[decode]\nreplicas = 1\n")
    json_cfg, yaml_cfg, toml_cfg = (load_config(tmp_path / f"c.{ext}") for ext in ("json", "yaml", "toml"))
    assert json_cfg == yaml_cfg == toml_cfg
    assert json_cfg.pools["prefill"].replicas == 2


def test_unknown_field_is_named_with_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"`prefill\.replica`.*replicas"):
        parse_config({"prefill": {"replica": 2}, "decode": {}})


def test_negative_replicas_rejected() -> None:
    with pytest.raises(ConfigError, match=r"`decode\.replicas`.*>= 1"):
        parse_config({"prefill": {}, "decode": {"replicas": -1}})


def test_wrong_type_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"`serve\.port`"):
        parse_config({"serve": {"port": "eighty"}})


def test_who_answers_http_is_direct_or_proxy() -> None:
    assert parse_config({"serve": {"http": "proxy"}}).serve.http == "proxy"
    with pytest.raises(ConfigError, match=r"`serve\.http`.*proxy.*direct"):
        parse_config({"serve": {"http": "nginx"}})


def test_stream_batching_is_off_at_0_and_bounded() -> None:
    assert parse_config({"serve": {"stream_batch_ms": 0, "http": "proxy"}}).stream_batch_s == 0
    assert parse_config({"serve": {"stream_batch_ms": 20}}).stream_batch_s == 0.02
    for bad in (-1, 5000):
        with pytest.raises(ConfigError, match=r"`serve\.stream_batch_ms`"):
            parse_config({"serve": {"stream_batch_ms": bad}})


def test_the_sessions_nice_value_is_a_nice_value() -> None:
    assert parse_config({}).cpu.session_nice == 10
    assert parse_config({"cpu": {"session_nice": 0}}).cpu.session_nice == 0
    for bad in (-1, 20):
        with pytest.raises(ConfigError, match=r"`cpu\.session_nice`"):
            parse_config({"cpu": {"session_nice": bad}})


def test_streamed_tokens_leave_each_step_where_a_chunk_is_cheap() -> None:
    """Unset: every engine step's tokens on GPU hosts behind a direct ingress; 50 ms chunks on
    CPU hosts (a chunk's work takes the engines' cores) and behind Serve's proxy (a Ray
    message per chunk)."""
    gpu = {"device": "cuda", "cpu_tier": {"enabled": False}}
    assert parse_config(gpu).stream_batch_s == 0
    assert parse_config(gpu | {"serve": {"http": "proxy"}}).stream_batch_s == 0.05
    assert parse_config({}).stream_batch_s == 0.05


def test_half_a_disaggregated_deployment_rejected() -> None:
    with pytest.raises(ConfigError, match="add a `decode` section"):
        parse_config({"prefill": {"replicas": 1}})


def test_colocated_excludes_pools() -> None:
    with pytest.raises(ConfigError, match="cannot be combined"):
        parse_config({"colocated": {}, "prefill": {}, "decode": {}})


def test_the_cpu_tier_is_refused_on_gpu_engines_with_the_fix() -> None:
    """The tier registers KV memory with NIXL as host memory: on a CUDA KV cache it cannot work."""
    with pytest.raises(ConfigError, match=r"`cpu_tier\.enabled` must be false with `device: cuda`.*enabled: false"):
        parse_config({"device": "cuda"})
    assert not parse_config({"device": "cuda", "cpu_tier": {"enabled": False}}).cpu_tier.enabled


def test_reserved_engine_args_point_to_the_right_field() -> None:
    with pytest.raises(ConfigError, match=r"`prefill\.engine_args\.tensor_parallel_size`.*tensor_parallel_size"):
        parse_config({"prefill": {"engine_args": {"tensor_parallel_size": 2}}, "decode": {}})


def test_pool_engine_args_override_top_level() -> None:
    cfg = parse_config({"engine_args": {"max_model_len": 512, "seed": 1}, "prefill": {"engine_args": {"seed": 7}}, "decode": {}})
    assert cfg.engine_args_for("prefill") == {"enforce_eager": True, "max_model_len": 512, "seed": 7}
    assert cfg.engine_args_for("decode")["seed"] == 1


def test_kv_roles_follow_the_pool() -> None:
    cfg = TandemConfig()
    assert kv_transfer_for(cfg, "prefill")["kv_role"] == "kv_producer"
    assert kv_transfer_for(cfg, "decode")["kv_role"] == "kv_consumer"
    # The CPU tier is on by default: colocated engines run it alone under the multi connector.
    colocated = kv_transfer_for(parse_config({"colocated": {}}), "both")
    assert colocated is not None and colocated["kv_role"] == "kv_both"
    assert [c["kv_connector"] for c in colocated["kv_connector_extra_config"]["connectors"]] == ["TandemCpuTierConnector"]
    assert kv_transfer_for(parse_config({"colocated": {}, "cpu_tier": {"enabled": False}}), "both") is None


def test_preflight_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.source.*no config.json"):
        preflight(parse_config({"model": {"source": str(tmp_path / "nowhere")}}))


def test_preflight_unknown_engine_arg() -> None:
    with pytest.raises(ConfigError, match=r"`engine_args\.max_model_length` is not a vLLM engine argument"):
        preflight(parse_config({"engine_args": {"max_model_length": 10}}))


def test_a_first_token_from_the_prefill_needs_tandems_nixl_connector() -> None:
    with pytest.raises(ConfigError, match=r"routing.first_token.*fix: set routing.first_token: decode"):
        preflight(parse_config({"kv_transfer": {"connector": "NixlConnector"}}))
    preflight(parse_config({"kv_transfer": {"connector": "NixlConnector"}, "routing": {"first_token": "decode"}}))
    preflight(parse_config({"kv_transfer": {"connector": "NixlConnector"}, "colocated": {}}))  # no prefill, no hand-off


def test_preflight_bad_connector_name() -> None:
    with pytest.raises(ConfigError, match="NoSuchConnector"):
        preflight(parse_config({"kv_transfer": {"connector": "NoSuchConnector"}}))


def _validate(capsys: pytest.CaptureFixture[str], path: Path, *flags: str) -> tuple[int, str, str]:
    """`tandem validate PATH FLAGS` in this process: (exit code, stdout, stderr). An error
    that escaped the CLI's handling would raise here instead of printing a traceback."""
    from tandem.cli import main

    code = main(["validate", str(path), *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_validate_cli_accepts_an_example_and_only_tandem_bench_imports_the_benchmark(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`tandem validate` as its own process. The bench's options come from benchmarks.bench
    (vLLM's benchmark client, matplotlib: seconds of imports); `tandem validate`, `status`
    and `serve` must not pay for them."""
    script = ("import sys; from tandem.cli import main; code = main(['validate', 'examples/1p1d-cpu.yaml']); "
              "print(code, 'benchmarks.bench' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    lines = res.stdout.splitlines()
    assert lines[0].startswith("OK examples/1p1d-cpu.yaml") and lines[-1] == "0 False", res.stdout + res.stderr[-2000:]
    from tandem.cli import main

    assert main(["bench", "--rounds", "0"]) == 2  # `tandem bench` still parses its own options
    assert "--rounds must be at least 1" in capsys.readouterr().err


def test_validate_show_fills_in_derived_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """--show prints every default, the CPU tier's pools (derived from the routing) and the
    stream batching chosen for the device included."""
    code, out, err = _validate(capsys, ROOT / "examples" / "routing-cpu.yaml", "--show")
    assert code == 0, err
    shown = json.loads(out.split("\n", 1)[1])
    assert shown["routing"]["disaggregation"] == "conditional"
    assert shown["cpu_tier"]["save_from"] == shown["cpu_tier"]["load_into"] == ["both", "decode", "prefill"]
    assert shown["serve"]["stream_batch_ms"] == 50.0  # a CPU deployment's chunks


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prefill: {replicas: 1, colour: red}\ndecode: {}\n", "prefill.colour"),
        ("prefill: {replicas: -2}\ndecode: {}\n", "prefill.replicas"),
        ("kv_transfer: {connector: NotAConnector}\n", "NotAConnector"),
        ("model: {source: /definitely/not/here}\n", "model.source"),
        ("prefill: [1, 2\n", "not valid YAML"),
        ("cpu: {bind_cores: off}\n", 'quote the value, e.g. `bind_cores: "off"`'),
    ],
    ids=["unknown-field", "negative-replicas", "bad-connector", "missing-model", "bad-yaml", "yaml-boolean"],
)
def test_validate_cli_rejects_broken_configs(capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    code, _, err = _validate(capsys, path)
    assert code == 2
    assert expected in err and err.startswith("tandem: config error: "), err


@pytest.mark.parametrize(("flags", "needle"), [
    (["--no-such-flag"], "unknown flags"),
    (["--enable-auto-tool-choice"], "requires --tool-call-parser"),
    (["--tool-call-parser"], "expected one argument"),
])
def test_preflight_names_bad_openai_front_end_flags(flags: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match="serve.openai_args") as err:
        preflight(parse_config({"serve": {"openai_args": flags}}))
    assert needle in str(err.value)


def test_preflight_accepts_vllm_front_end_flags() -> None:
    preflight(parse_config({"serve": {"openai_args": ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]}}))


@pytest.mark.parametrize("name", ["tiny", "small", "medium"])
def test_a_builtin_model_is_generated_with_its_shape_and_known_by_name(name: str, tmp_path: Path) -> None:
    """Each built-in model must build, carry its shape and dtype (the tiny one float16: vLLM's
    bfloat16 AMX attention kernel crashes on it, see orchestrator.tiny_model), and pass the
    model check by name."""
    from orchestrator.config import BUILTIN_MODELS
    from orchestrator.preflight import check_model
    from orchestrator.tiny_model import DTYPES, SHAPES, VERSIONS, prepare_builtin_model

    assert BUILTIN_MODELS == tuple(SHAPES) == tuple(DTYPES) == tuple(VERSIONS)
    folder = prepare_builtin_model(name, tmp_path)
    assert folder.name == f"{name}-llama-{VERSIONS[name]}"
    config = json.loads((folder / "config.json").read_text())
    assert {k: config[k] for k in SHAPES[name]} == SHAPES[name]
    assert config["dtype"] == DTYPES[name] and DTYPES["tiny"] == "float16"
    check_model(parse_config({"model": {"source": f"builtin:{name}"}}))
