"""One corpus of OpenAI requests, sent to two servers and compared (tests/test_openai_parity.py).

Every case is a raw HTTP request (method, path, body, headers), so malformed input is sent
as it is. What is compared is what a client sees, minus what differs by construction: ids,
timestamps, and how a stream is cut into events (Tandem sends tokens in batches). Streams are
compared by their joined text, tool calls, finish reasons, usage and errors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "tandem-tiny"
# Fields whose values differ between any two servers (or two calls to one).
VOLATILE = {"id", "created", "created_at", "system_fingerprint", "call_id", "item_id", "response_id"}
# Request ids inside error messages.
UUID = re.compile(r"[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}|[0-9a-f]{32}")
# The wall-clock stamp xgrammar puts in its errors ("[18:33:46] <path>:83: Regex parsing error").
CLOCK = re.compile(r"\[\d\d:\d\d:\d\d\]")


def normalize_error(err: Any) -> Any:
    """An error object without what differs between two servers: ids, and the request ids and
    clock stamps inside its message."""
    if not isinstance(err, dict):
        return err
    return {**normalize(err), "message": CLOCK.sub("[<time>]", UUID.sub("<id>", str(err.get("message"))))}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any = None  # JSON-encoded unless bytes
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


def _chat(content: str = "tell me about ray", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 12, **kw}


def _cmpl(prompt: Any = "the quick brown fox", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 12, **kw}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _both_ways(name: str, path: str, body: dict[str, Any]) -> list[Case]:
    return [Case(name, path, body), Case(f"{name} (stream)", path, body | {"stream": True, "stream_options": {"include_usage": True}})]


CASES: list[Case] = [
    Case("models", "/v1/models", method="GET"),
    *_both_ways("completion", "/v1/completions", _cmpl(ignore_eos=True)),
    *_both_ways("chat", "/v1/chat/completions", _chat(ignore_eos=True)),
    *_both_ways("chat, system prompt", "/v1/chat/completions",
                {**_chat(), "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}),
    *_both_ways("completion, logprobs", "/v1/completions", _cmpl(logprobs=3, max_tokens=6)),
    *_both_ways("chat, logprobs", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=2, max_tokens=6)),
    *_both_ways("completion, echo", "/v1/completions", _cmpl(echo=True, max_tokens=4)),
    Case("completion, echo with logprobs", "/v1/completions", _cmpl(echo=True, logprobs=2, max_tokens=4)),
    Case("completion, prompt_logprobs", "/v1/completions", _cmpl(prompt_logprobs=2, max_tokens=3)),
    # n > 1 needs sampling (vLLM refuses it for greedy requests); a seed makes it repeatable.
    *_both_ways("completion, n=3", "/v1/completions", _cmpl(n=3, temperature=0.8, seed=7, max_tokens=5)),
    Case("chat, n=2", "/v1/chat/completions", _chat(n=2, temperature=0.8, seed=7, max_tokens=5)),
    Case("completion, best_of", "/v1/completions", _cmpl(n=1, best_of=2, temperature=0.8, seed=7, max_tokens=5)),
    Case("completion, n=2 greedy", "/v1/completions", _cmpl(n=2)),
    *_both_ways("completion, logit_bias", "/v1/completions", _cmpl(logit_bias={"100": 100}, max_tokens=5)),
    Case("completion, seed", "/v1/completions", _cmpl(temperature=1.0, seed=1234, max_tokens=8)),
    *_both_ways("completion, stop string", "/v1/completions", _cmpl(stop=["e"], max_tokens=30)),
    Case("completion, stop token", "/v1/completions", _cmpl(stop_token_ids=[100], max_tokens=30)),
    Case("completion, token ids", "/v1/completions", _cmpl(prompt=[10, 20, 30, 40, 50], return_token_ids=True)),
    Case("completion, min_tokens", "/v1/completions", _cmpl(min_tokens=5, max_tokens=8)),
    *_both_ways("json_object", "/v1/chat/completions", _chat(response_format={"type": "json_object"}, max_tokens=24)),
    *_both_ways("json_schema", "/v1/chat/completions",
                _chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, max_tokens=40)),
    Case("structured choice", "/v1/chat/completions", _chat(structured_outputs={"choice": ["yes", "no", "maybe"]})),
    Case("structured regex", "/v1/completions", _cmpl(structured_outputs={"regex": "[0-9]{3}-[a-z]{2}"}, max_tokens=10)),
    Case("structured grammar", "/v1/completions",
         _cmpl(structured_outputs={"grammar": 'root ::= "ray" | "serve" | "vllm"'}, max_tokens=6)),
    *_both_ways("tools, required", "/v1/chat/completions",
                _chat("weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=40)),
    Case("tools, named", "/v1/chat/completions",
         _chat("weather in Paris?", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40)),
    Case("tools, auto", "/v1/chat/completions", _chat("weather in Paris?", tools=[WEATHER], tool_choice="auto")),
    Case("tools, none", "/v1/chat/completions", _chat("weather in Paris?", tools=[WEATHER], tool_choice="none")),
    Case("chat template kwargs", "/v1/chat/completions", _chat(chat_template_kwargs={"add_generation_prompt": False})),
    Case("chat, continue final message", "/v1/chat/completions",
         {**_chat(), "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
          "add_generation_prompt": False, "continue_final_message": True}),
    *_both_ways("responses", "/v1/responses", {"model": MODEL, "input": "tell me about ray", "temperature": 0, "max_output_tokens": 12}),
    Case("tokenize", "/tokenize", {"model": MODEL, "prompt": "the quick brown fox"}),
    Case("tokenize chat", "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    Case("detokenize", "/detokenize", {"model": MODEL, "tokens": [10, 20, 30, 40]}),
    # Bad input: the same status and error type.
    Case("not JSON", "/v1/completions", b"{not json"),
    Case("empty body", "/v1/completions", b""),
    Case("no prompt", "/v1/completions", {"model": MODEL}),
    Case("no messages", "/v1/chat/completions", {"model": MODEL}),
    Case("empty messages", "/v1/chat/completions", {"model": MODEL, "messages": []}),
    Case("max_tokens 0", "/v1/completions", _cmpl(max_tokens=0)),
    Case("max_tokens negative", "/v1/completions", _cmpl(max_tokens=-5)),
    Case("max_tokens a string", "/v1/completions", _cmpl(max_tokens="ten")),
    Case("temperature a string", "/v1/completions", _cmpl(temperature="hot")),
    Case("prompt a number", "/v1/completions", _cmpl(prompt=42)),
    Case("prompt mixed", "/v1/completions", _cmpl(prompt=[1, "x"])),
    *_both_ways("token out of vocabulary", "/v1/completions", _cmpl(prompt=[5000000])),
    Case("unknown model", "/v1/completions", {**_cmpl(), "model": "gpt-5"}),
    Case("max_tokens over the context", "/v1/completions", _cmpl(max_tokens=5000)),
    Case("prompt over the context", "/v1/completions", _cmpl(prompt=list(range(3, 403)) * 3)),
    Case("bad json_schema", "/v1/chat/completions", _chat(response_format={"type": "json_schema"})),
    Case("bad regex", "/v1/completions", _cmpl(structured_outputs={"regex": "(unclosed"})),
    Case("tool_choice names an unknown tool", "/v1/chat/completions",
         _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})),
    Case("logprobs too many", "/v1/completions", _cmpl(logprobs=100)),
    Case("n too large for best_of", "/v1/completions", _cmpl(n=3, best_of=2)),
    Case("unknown path", "/v1/nothing", {"model": MODEL}),
]


def _events(text: str) -> Iterator[Any]:
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))
        elif line.startswith("event: ") or not line.strip() or line == "data: [DONE]":
            continue


def normalize(value: Any) -> Any:
    """Drop what differs by construction; keep everything a client would act on."""
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    if isinstance(value, str) and value.startswith(("chatcmpl-", "cmpl-", "resp_", "msg_", "chatcmpl-tool-")):
        return "<id>"
    return value


def fold_stream(events: list[Any]) -> dict[str, Any]:
    """A stream as a client reads it: text per choice, tool calls, finish reasons, logprob
    tokens, usage and any error event. Independent of how tokens were grouped into events."""
    out: dict[str, Any] = {"choices": {}, "usage": None, "errors": [], "types": []}
    for e in events:
        if "error" in e and "choices" not in e:
            out["errors"].append(normalize_error(e["error"]))
            continue
        if "type" in e and "choices" not in e:  # /v1/responses events
            if e["type"] not in out["types"]:
                out["types"].append(e["type"])
            if e["type"] == "response.completed":
                out["final"] = normalize(e["response"])
            continue
        if e.get("usage"):
            out["usage"] = e["usage"]
        for c in e.get("choices", []):
            mine = out["choices"].setdefault(c["index"], {"text": "", "tool_args": "", "tools": [], "finish": None, "lp": []})
            delta = c.get("delta") or {}
            mine["text"] += c.get("text") or delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if fn.get("name"):
                    mine["tools"].append(fn["name"])
                mine["tool_args"] += fn.get("arguments") or ""
            mine["finish"] = c.get("finish_reason") or mine["finish"]
            lp = c.get("logprobs")
            if lp:
                mine["lp"] += lp.get("tokens") or [t["token"] for t in lp.get("content") or []]
    return out


def observe(client: httpx.Client, base: str, case: Case) -> dict[str, Any]:
    """What a client sees of `case` on the server at `base` (no /v1 suffix)."""
    headers = {"content-type": "application/json", **case.headers}
    content = case.body if isinstance(case.body, bytes) or case.body is None else json.dumps(case.body).encode()
    r = client.request(case.method, base + case.path, content=content, headers=headers)
    seen: dict[str, Any] = {"status": r.status_code}
    if case.stream and r.status_code == 200:
        seen["stream"] = fold_stream(list(_events(r.text)))
        return seen
    try:
        body = r.json()
    except ValueError:
        seen["text"] = r.text
        return seen
    if isinstance(body, dict) and "error" in body:
        seen["error"] = normalize_error(body["error"])
    else:
        seen["body"] = normalize(body)
    return seen
