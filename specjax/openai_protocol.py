"""The OpenAI API as specjax serves it: request bodies (validated with pydantic; unknown or unsupported
fields are refused with the reason, never silently ignored), their translation to SamplingParams, and
the response / stream-chunk bodies.

Extra body fields (the OpenAI client's `extra_body`): top_k, repetition_penalty, ignore_eos,
stop_token_ids, and one output constraint: json_schema / regex / choice / grammar (EBNF), also under
the names guided_json / guided_regex / guided_choice / guided_grammar.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from specjax.async_llm import RequestError
from specjax.sampling_params import SamplingParams, SamplingParamsError


@dataclasses.dataclass(frozen=True)
class Limits:
    max_tokens: int  # the most max_tokens a request may ask for
    max_n: int  # the most choices one request may ask for (n times the number of prompts)
    max_prompt_tokens: int


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # refused unless empty
    user: str | None = None  # accepted, not used
    response_format: ResponseFormat | None = None
    # extra body fields
    top_k: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    json_schema: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False  # refused if true (no prompt logprobs)
    best_of: int | None = None  # refused unless 1 or n
    suffix: str | None = None  # refused


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None  # refused unless empty
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None


def validation_message(errors) -> str:
    """One line per pydantic error: `field.path: message`."""
    lines = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = e.get("msg", "invalid")
        if e.get("type") == "extra_forbidden":
            msg = "unknown or unsupported field"
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


# -------------------------------------------------------------------------- requests -> SamplingParams

_CONSTRAINTS = (("json_schema", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                ("grammar", "guided_grammar"))


def _constraint(body: _Sampling) -> dict:
    given: dict[str, object] = {}
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        given["response_format"] = ("json_schema", {"type": "object"})
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise RequestError("response_format of type json_schema needs json_schema.schema")
        given["response_format"] = ("json_schema", rf.json_schema.schema_)
    for plain, guided in _CONSTRAINTS:
        for name in (plain, guided):
            if getattr(body, name) is not None:
                given[name] = (plain, getattr(body, name))
    if len(given) > 1:
        raise RequestError(f"at most one output constraint may be given, got {', '.join(given)}")
    return dict(given.values())


def _refuse_unsupported(body) -> None:
    if body.logit_bias:
        raise RequestError("logit_bias is not supported")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise RequestError("echo is not supported (prompt logprobs are not computed)")
        if body.suffix:
            raise RequestError("suffix is not supported")
        if body.best_of not in (None, 1, body.n):
            raise RequestError("best_of is not supported (only best_of = n)")
    else:
        if body.tools:
            raise RequestError("tools are not supported")
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")


def sampling_params(body: CompletionRequest | ChatCompletionRequest, limits: Limits, num_prompts: int = 1
                    ) -> list[SamplingParams]:
    """One SamplingParams per choice (n of them); RequestError with the reason for a bad request.
    With a seed, choice i uses seed + i (choices differ, and repeat across identical requests)."""
    _refuse_unsupported(body)
    chat = isinstance(body, ChatCompletionRequest)
    if body.n < 1 or body.n * num_prompts > limits.max_n:
        raise RequestError(f"n={body.n}" + (f" times {num_prompts} prompts" if num_prompts > 1 else "")
                           + f" must be in [1, {limits.max_n}] (this server's limit of choices per request)")
    max_tokens = body.max_tokens
    if chat and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = limits.max_tokens if chat else min(16, limits.max_tokens)
    if max_tokens > limits.max_tokens:
        raise RequestError(f"max_tokens={max_tokens} exceeds this server's limit of {limits.max_tokens}")
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    fields = dict(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                  seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                  logprobs=logprobs, repetition_penalty=body.repetition_penalty,
                  frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                  **_constraint(body))
    try:
        base = SamplingParams(**fields)
    except SamplingParamsError as e:
        raise RequestError(str(e).removeprefix("invalid SamplingParams: ")) from None
    if body.seed is None:
        return [dataclasses.replace(base) for _ in range(body.n)]
    return [dataclasses.replace(base, seed=(body.seed + i) & 0xFFFFFFFF) for i in range(body.n)]


def prompts_of(body: CompletionRequest) -> list:
    """The prompts of a completion request: strings or token-id lists."""
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    if not p:
        raise RequestError("prompt is empty")
    return list(p)


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template takes them (text parts joined, developer -> system)."""
    out = []
    for m in body.messages:
        content = m.content if isinstance(m.content, str) or m.content is None \
            else "".join(part.text for part in m.content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


# -------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class TokenText:
    """Token id -> its text (cached): what logprobs entries show."""

    def __init__(self, tokenizer):
        self._tok, self._cache = tokenizer, {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = self._tok.decode([tid])
        return s


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda x: -x[1])[:k]


def chat_logprobs(text_of: TokenText, token_ids, logprobs, k: int) -> dict:
    """{"content": [...]} of the chat API for tokens with their {id: logprob} entries."""
    def item(tid, lp):
        s = text_of(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [dict(item(t, e[t]), top_logprobs=[item(i, lp) for i, lp in _top(e, k)])
                        for t, e in zip(token_ids, logprobs)]}


def completion_logprobs(text_of: TokenText, token_ids, logprobs, k: int, offset: int) -> dict:
    """The completions API's logprobs object; text_offset counts token texts from `offset`."""
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(token_ids, logprobs)],
            "top_logprobs": [{text_of(i): lp for i, lp in _top(e, k)} for e in logprobs],
            "text_offset": offsets}
