"""Tandem's OpenAI API against a plain `vllm serve` of the same model, request by request.

One corpus (tests/openai_corpus.py: every feature of vLLM's server, streaming and not, and
bad input) goes to both: Tandem's default 1P1D and a plain vLLM server with the same engine
arguments and front-end flags (a tool parser, so `tool_choice: auto` is served). Greedy and
seeded outputs, logprobs, status codes and error shapes must match; ids, timestamps and how a
stream is cut into events may differ.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.scenarios import vllm_server
from orchestrator.config import parse_config
from orchestrator.job import Running, running
from tests.conftest import free_port, together
from tests.openai_corpus import CASES, MODEL, Case, observe

pytestmark = pytest.mark.engines

SETTINGS = {
    # Without whitespace in grammars the tiny random model finishes JSON within a few tokens
    # (it otherwise pads with whitespace up to max_tokens).
    "engine_args": {"max_model_len": 1024,
                    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}},
    # vLLM's pythonic tool parser needs no special tokens, so the tiny model can run it.
    "serve": {"openai_args": ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]},
}


@pytest.fixture(scope="module")
def servers(ray_local: None, tiny_model: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Running, str]]:
    """Tandem's default 1P1D and a plain vLLM server of the same settings, started side by side."""
    cfg = parse_config(SETTINGS | {"serve": SETTINGS["serve"] | {"port": free_port()},
                                   "kv_transfer": {"side_channel_base_port": free_port(8)}})
    plain = parse_config(SETTINGS | {"colocated": {}, "serve": SETTINGS["serve"] | {"port": free_port()}})
    log = Path(tmp_path_factory.mktemp("vllm")) / "vllm-server.log"
    before = _sockets_in_temp_dir()
    with together(running(cfg, own_ray=False), vllm_server(plain, log)) as (up, (url, _pid)):
        yield up, url
    left = _sockets_in_temp_dir() - before  # Tandem's engines keep theirs in directories of their own
    assert not left, f"the plain vLLM server left its ipc sockets in the temp dir: {sorted(left)[:3]}"


@pytest.fixture(scope="module")
def tandem(servers: tuple[Running, str]) -> Running:
    return servers[0]


@pytest.fixture(scope="module")
def plain_vllm(servers: tuple[Running, str]) -> str:
    return servers[1]


def _sockets_in_temp_dir() -> set[Path]:
    return {p for p in Path(tempfile.gettempdir()).iterdir() if p.is_socket()}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as client:
        yield client


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_tandem_answers_as_vllm_does(case: Case, tandem: Running, plain_vllm: str, http: httpx.Client) -> None:
    want = observe(http, plain_vllm, case)
    got = observe(http, tandem.url.removesuffix("/v1"), case)
    assert got == want, f"{case.name}:\nvLLM:   {json.dumps(want)[:1500]}\nTandem: {json.dumps(got)[:1500]}"


def test_the_corpus_exercises_each_feature(tandem: Running, http: httpx.Client) -> None:
    """Guard against a corpus that matches only because both servers refuse everything."""
    ok = [c.name for c in CASES if observe(http, tandem.url.removesuffix("/v1"), c)["status"] == 200]
    for feature in ("completion, logprobs", "completion, n=3", "json_schema", "structured regex", "tools, required",
                    "tools, auto", "responses (stream)", "tokenize", "detokenize", "completion, echo"):
        assert feature in ok, f"{feature} was not served"


def test_a_body_over_the_cap_is_refused_before_it_is_read(tandem: Running, http: httpx.Client) -> None:
    big = b'{"model": "tandem-tiny", "prompt": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    r = http.post(tandem.url + "/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "serve.max_request_bytes" in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"model": "tandem-tiny", "prompt": "'
        for _ in range(80):
            yield b"x" * 65536
        yield b'"}'

    r = http.post(tandem.url + "/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    ok = http.post(tandem.url + "/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200


def test_official_client_uses_tools_and_structured_output(tandem: Running) -> None:
    client = openai.OpenAI(base_url=tandem.url, api_key="unused", max_retries=0, timeout=120)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=[weather],
                                       tool_choice="required", max_tokens=100, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a number"}], max_tokens=30,
                                       temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content)["n"], int)
    tokens = httpx.post(tandem.url.removesuffix("/v1") + "/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=60).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
