"""OpenAI request and response shapes, and the checks that turn bad input into a 4xx.

Requests are decoded with msgspec into typed Structs: a wrong type, a missing field or an
out-of-range value becomes an `ApiError` naming the field, never a 500. Unknown fields
are ignored, as OpenAI-compatible servers do, so tools that send extras keep working.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from actors.protocol import SamplingOptions


class ApiError(Exception):
    """A client error: the HTTP status, a message that says what to fix, and the field."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = False


class _SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    n: Annotated[int, Meta(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0)] = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's extension: also return the prompt's and the output's token ids.
    return_token_ids: bool = False
    user: str | None = None

    def sampling(self, max_tokens: int) -> SamplingOptions:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingOptions(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    # A string, a list of token ids, or a one-element list of either (checked by the ingress).
    prompt: str | list[Any]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields, frozen=True, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None


T = TypeVar("T")


def decode_request(body: bytes, cls: type[T]) -> T:
    """Decode and validate a JSON body, or raise a 400 that names the bad field."""
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as err:
        msg = str(err)
        param = msg.split("at `$.", 1)[1].rstrip("`") if "at `$." in msg else None
        if msg.startswith("Object missing required field"):
            field = msg.split("`")[1]
            raise ApiError(400, f"missing required field `{field}`", param=field) from None
        raise ApiError(400, f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None


def reject_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Features Tandem does not serve yet get a clear 400 instead of a silent wrong answer."""
    if req.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
    else:
        if req.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if req.tools:
            raise ApiError(400, "tools are not supported", param="tools")


def message_text(msg: ChatMessage, index: int) -> str:
    """A message's text; content parts other than text are refused with a 400."""
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    texts = []
    for part in msg.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"only text content parts are supported (got {part.get('type')!r})", param=f"messages[{index}].content")
        texts.append(part["text"])
    return "".join(texts)


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def now() -> int:
    return int(time.time())
