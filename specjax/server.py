"""`specjax serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over specjax.AsyncLLM.

Routes: /v1/models, /v1/completions, /v1/chat/completions (stream: true -> server-sent events),
/health (never needs the API key), /metrics (Prometheus text format).

A request's path through the server:
  _Guard (ASGI): API key (401) -> body read up to max_body_bytes (413)
  route: pydantic body (400) -> model name (400) -> concurrency ticket (429) -> SamplingParams per
         choice (400) -> AsyncLLM.add_request per prompt x choice (tokenize, prompt limit, bounded
         grammar compilation: 400) -> JSON response, or SSE chunks
  the client goes away: its requests are cancelled in the engine (slots and pages freed), its ticket
  returned. An error of one request never touches the others: each request has its own engine slot.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
from collections import Counter
from collections.abc import Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specjax import openai_protocol as oai
from specjax.async_llm import AsyncLLM, EngineDeadError, RequestError
from specjax.server_metrics import render_metrics

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_exceeded", 500: "internal_error", 503: "unavailable"}


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str  # the name clients put in "model" (compared as a string, never opened)
    api_key: str | None = None  # Bearer token required on every route but /health
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # default: the context (max_seq_len - 1)
    max_tokens: int | None = None  # the most max_tokens a request may ask for; default: max_seq_len
    max_n: int = 16
    max_concurrent: int = 256  # generation requests in flight (streams included); more get 429


class _State:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.in_flight = 0
        self.responses: Counter = Counter()  # (route, status code) -> count
        self.prompt_tokens = 0


def error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "error"), "param": None, "code": status}}


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


class _ClientGone(Exception):
    pass


class _Guard:
    """ASGI middleware: API key, body size limit, response counts. The body is read here (bounded)
    and replayed to the app; later receive() calls (the disconnect) pass through."""

    def __init__(self, app, state: _State):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ("/health", "/metrics", "/v1/models", "/v1/completions",
                                 "/v1/chat/completions") else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.state.responses[(route, message["status"])] += 1
            await send(message)

        cfg = self.state.cfg
        headers = dict(scope["headers"])
        if cfg.api_key is not None and path != "/health" and not self._authorized(headers):
            return await _error(401, "missing or invalid API key (send the header Authorization: Bearer <key>)",
                                {"WWW-Authenticate": "Bearer"})(scope, receive, counting_send)
        too_big = _error(413, f"request body larger than this server's limit of {cfg.max_body_bytes} bytes")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > cfg.max_body_bytes):
            return await too_big(scope, receive, counting_send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > cfg.max_body_bytes:
                return await too_big(scope, receive, counting_send)
        replay = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def replay_receive():
            return replay.pop() if replay else await receive()
        await self.app(scope, replay_receive, counting_send)

    def _authorized(self, headers: dict) -> bool:
        given = headers.get(b"authorization", b"")
        return hmac.compare_digest(given, b"Bearer " + self.state.cfg.api_key.encode())


class _EventStream(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects (whatever the ASGI spec
    version), then always run on_close (cancel the engine requests, return the ticket)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:
                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()
                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, coro):
    """Await coro; if the client disconnects first, cancel it and raise _ClientGone."""
    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise _ClientGone()
    return work.result()


async def _merge(streams):
    """(choice index, delta) from several RequestStreams as they arrive."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                i = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                yield i, delta
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Api:
    """The generation routes' work: model check, ticket (429), submission, JSON or SSE bodies."""

    def __init__(self, llm: AsyncLLM, cfg: ServerConfig, state: _State):
        self.llm, self.cfg, self.state = llm, cfg, state
        self.limits = oai.Limits(max_tokens=cfg.max_tokens or llm.max_seq_len, max_n=cfg.max_n,
                                 max_prompt_tokens=cfg.max_prompt_tokens or llm.max_seq_len - 1)
        self.text_of = oai.TokenText(llm.tokenizer)

    def model_card(self) -> dict:
        return {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "specjax",
                "max_model_len": self.llm.max_seq_len}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.cfg.model_name:
            raise RequestError(f"unknown model {name!r}; this server serves {self.cfg.model_name!r}")

    def take_ticket(self) -> Callable[[], None]:
        """Count a generation request in flight (429 past the limit); returns its give-back (idempotent)."""
        if self.state.in_flight >= self.cfg.max_concurrent:
            raise HTTPException(429, f"too many requests in flight (this server's limit is {self.cfg.max_concurrent}); "
                                "retry later")
        self.state.in_flight += 1
        returned = False

        def give_back():
            nonlocal returned
            if not returned:
                returned = True
                self.state.in_flight -= 1
        return give_back

    async def submit(self, prompts, params) -> list:
        """One stream per prompt x choice (prompt-major); all or none (a bad one cancels the rest)."""
        streams = []
        try:
            for p_idx, prompt in enumerate(prompts):
                for sp in params:
                    streams.append(await self.llm.add_request(prompt, sp, index=p_idx,
                                                              max_prompt_tokens=self.limits.max_prompt_tokens))
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        self.state.prompt_tokens += sum(len(s.prompt_token_ids) for s in streams)
        return streams

    async def generate(self, request: Request, body, prompts, chat: bool):
        self.check_model(body.model)
        params = oai.sampling_params(body, self.limits, len(prompts))
        give_back = self.take_ticket()
        streams, handed_over = [], False
        try:
            streams = await self.submit(prompts, params)
            rid, created = oai.new_id("chatcmpl" if chat else "cmpl"), oai.now()
            k, n = params[0].logprobs, len(params)
            if body.stream:
                def on_close():
                    for s in streams:
                        s.cancel()
                    give_back()
                usage = body.stream_options is not None and body.stream_options.include_usage
                chunks = (self.chat_chunks if chat else self.completion_chunks)(streams, rid, created, k, usage, n)
                handed_over = True  # the response cancels the streams and returns the ticket when it ends
                return _EventStream(chunks, on_close)
            await _unless_disconnected(request, _drain(streams))
            return self.final(streams, rid, created, chat, k, n)
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if not handed_over:
                for s in streams:
                    s.cancel()
                give_back()

    def final(self, streams, rid, created, chat: bool, k: int | None, n: int) -> JSONResponse:
        outs = [s.output for s in streams]
        for o in outs:
            if o.finish_reason == "error":
                return _error(400 if not o.token_ids else 500, o.error)
        choices = []
        for i, o in enumerate(outs):
            if chat:
                c = {"index": i, "message": {"role": "assistant", "content": o.text},
                     "logprobs": None if k is None else oai.chat_logprobs(self.text_of, o.token_ids, o.logprobs, k)}
            else:
                c = {"index": i, "text": o.text, "logprobs": None if k is None else
                     oai.completion_logprobs(self.text_of, o.token_ids, o.logprobs, k, 0)}
            c["finish_reason"] = o.finish_reason
            choices.append(c)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": created, "model": self.cfg.model_name, "choices": choices,
                             "usage": self.usage(streams, n)})

    @staticmethod
    def usage(streams, n: int) -> dict:
        """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
        return oai.usage(sum(len(s.prompt_token_ids) for s in streams[::n]),
                         sum(len(s.output.token_ids) for s in streams if s.output is not None))

    async def completion_chunks(self, streams, rid, created, k, include_usage, n):
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.cfg.model_name}
        offsets = [0] * len(streams)
        async for i, d in _merge(streams):
            if d.finish_reason in ("error", "cancelled"):
                yield _stream_error(d)
                return
            lp = None
            if k is not None and d.token_ids:
                lp = oai.completion_logprobs(self.text_of, d.token_ids, d.logprobs, k, offsets[i])
                offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            yield _sse(dict(head, choices=[{"index": i, "text": d.text, "logprobs": lp,
                                            "finish_reason": d.finish_reason}]))
        if include_usage:
            yield _sse(dict(head, choices=[], usage=self.usage(streams, n)))
        yield "data: [DONE]\n\n"

    async def chat_chunks(self, streams, rid, created, k, include_usage, n):
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.cfg.model_name}
        for i in range(len(streams)):
            yield _sse(dict(head, choices=[{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]))
        async for i, d in _merge(streams):
            if d.finish_reason in ("error", "cancelled"):
                yield _stream_error(d)
                return
            lp = None
            if k is not None and d.token_ids:
                lp = oai.chat_logprobs(self.text_of, d.token_ids, d.logprobs, k)
            yield _sse(dict(head, choices=[{"index": i, "delta": {"content": d.text} if d.text else {},
                                            "logprobs": lp, "finish_reason": d.finish_reason}]))
        if include_usage:
            yield _sse(dict(head, choices=[], usage=self.usage(streams, n)))
        yield "data: [DONE]\n\n"


async def _drain(streams) -> None:
    for s in streams:
        async for _ in s:
            pass


def _stream_error(delta) -> str:
    status = 400 if delta.error and not delta.token_ids else 500
    return _sse(error_body(status, delta.error or f"request {delta.finish_reason}")) + "data: [DONE]\n\n"


def build_app(llm: AsyncLLM, cfg: ServerConfig, on_shutdown: Callable[[], None] | None = None):
    """The ASGI app serving `llm` under cfg.model_name. The caller owns llm; on_shutdown runs when the
    server shuts down (`specjax serve` stops the engine there)."""
    state = _State(cfg)
    api = _Api(llm, cfg, state)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        if on_shutdown is not None:
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="specjax", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        return _error(400, oai.validation_message(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(_, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestError)
    async def _bad(_, exc: RequestError):
        return _error(400, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(_, exc: EngineDeadError):
        return _error(503, f"the engine has stopped: {exc}")

    @app.exception_handler(Exception)
    async def _internal(_, exc: Exception):  # a bug or a broken worker: say what, in the API's error format
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health():
        if llm.error is not None:
            return _error(503, f"the engine has stopped: {llm.error}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(llm, state), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != cfg.model_name:
            raise HTTPException(404, f"unknown model {name!r}; this server serves {cfg.model_name!r}")
        return api.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request, body: oai.CompletionRequest):
        return await api.generate(request, body, oai.prompts_of(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: oai.ChatCompletionRequest):
        try:
            prompt = llm.llm.apply_chat_template(oai.chat_messages(body))
        except Exception as e:  # noqa: BLE001 - no template, or the template refuses the messages
            raise RequestError(f"cannot apply the chat template: {e}") from None
        return await api.generate(request, body, [prompt], chat=True)

    return _Guard(app, state)
