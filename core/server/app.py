"""The OpenAI-compatible HTTP layer: FastAPI routes over the engine thread.

Every handler parses its body (one-line 400 in OpenAI's error shape on anything wrong), submits a job to the
engine loop, and turns the job's token events into text: one JSON answer, or server-sent events. A handler
never blocks the engine and the engine never waits on a handler: tokens cross between them through an asyncio
queue. A client that goes away has its job cancelled, which frees its cache row before the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specpilot.core.engine.decode import Verification
from specpilot.core.engine.scheduler import Event
from specpilot.core.server.engine_loop import UNAVAILABLE, EngineLoop
from specpilot.core.server.metrics import Metrics
from specpilot.core.server.protocol import ApiError, Job, parse
from specpilot.core.server.text import TextStream
from specpilot.core.workload import encode_messages

log = logging.getLogger("specpilot.serve")
POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


@dataclass
class ServerState:
    """What the routes need: the engine loop, the tokenizer, the names served and the limits."""

    engine: EngineLoop
    tokenizer: Any
    model_names: tuple[str, ...]
    context: int
    default: Verification
    eos: set[int]
    vocab: int
    metrics: Metrics
    api_key: str | None = None
    draining: bool = False
    started: int = field(default_factory=lambda: int(time.time()))
    info: dict[str, Any] = field(default_factory=dict)  # recipe and deployment, shown by /v1/models


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _text_parts(content: Any) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving `state` (routes: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics)."""
    app = FastAPI(title="specpilot serve", docs_url=None, redoc_url=None, openapi_url=None)
    tok = state.tokenizer
    # parsing encodes the prompt (a chat template can take milliseconds): off the event loop, on one thread,
    # since a fast tokenizer is not safe to share between threads
    encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specpilot-encode")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("500 %s", request.url.path)
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error"))

    def encode_chat(body: dict) -> list[int]:
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions with a prompt",
                           "messages")
        messages = [{"role": m["role"], "content": _text_parts(m["content"])} for m in body["messages"]]
        return encode_messages(tok, messages)

    def encode_prompt(body: dict) -> list[int]:
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(tok.encode(prompt))
        if any(not 0 <= t < state.vocab for t in prompt):
            raise ApiError(400, f"`prompt` holds token ids outside this model's vocabulary of {state.vocab}",
                           "prompt")
        return list(prompt)

    def count(endpoint: str, status: int) -> None:
        state.metrics.requests.labels(endpoint, str(status)).inc()

    async def authorised(request: Request) -> None:
        if state.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {state.api_key}":
            raise ApiError(401, "missing or wrong API key; send `Authorization: Bearer KEY`",
                           kind="authentication_error", code="invalid_api_key")

    async def generate(request: Request, kind: str, encode: Callable[[dict], list[int]]) -> Response:
        endpoint = request.url.path
        try:
            await authorised(request)
            if state.draining:
                raise ApiError(503, "the server is shutting down; send the request to another replica",
                               kind="service_unavailable")
            if state.engine.failure is not None:
                raise ApiError(503, f"the engine stopped ({state.engine.failure}); restart the server",
                               kind="service_unavailable")
            try:
                body = json.loads(await request.body() or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})")
            loop = asyncio.get_running_loop()
            job = await loop.run_in_executor(encoder, parse, body, kind, state.model_names, encode, state.context,
                                             state.default)
            job.loop, job.events = loop, asyncio.Queue()
            state.engine.submit(job)
        except ApiError as exc:
            log.warning("%s %s: %s", exc.status, endpoint, exc.message)
            count(endpoint, exc.status)
            return _error(exc)
        session = _Session(state, job, request)
        if job.stream:
            first = await session.first()
            if isinstance(first, ApiError):
                count(endpoint, first.status)
                return _error(first)
            count(endpoint, 200)
            return StreamingResponse(session.sse(first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        answer = await session.whole()
        status = answer.status if isinstance(answer, ApiError) else 200
        count(endpoint, status)
        return _error(answer) if isinstance(answer, ApiError) else JSONResponse(answer)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat", encode_chat)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion", encode_prompt)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            await authorised(request)
        except ApiError as exc:
            return _error(exc)
        data = [{"id": name, "object": "model", "created": state.started, "owned_by": "specpilot",
                 "max_model_len": state.context, **state.info} for name in state.model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        if state.draining or state.engine.failure is not None:
            return JSONResponse({"status": "draining" if state.draining else "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class _Session:
    """One job's answer: its token events turned into text, usage and a finish reason."""

    def __init__(self, state: ServerState, job: Job, request: Request) -> None:
        self.state, self.job, self.request = state, job, request
        self.text = TextStream(state.tokenizer, job.stop, state.eos)
        self.generated = 0
        self.ended = False
        self.prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"

    async def _next(self) -> Event | None:
        """The next event, or None once the client has disconnected (the job is then cancelled)."""
        while True:
            try:
                return await asyncio.wait_for(self.job.events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.cancel()
                    return None

    def cancel(self) -> None:
        if not self.ended:
            self.ended = True
            self.state.engine.cancel(self.job)

    def _advance(self, event: Event) -> tuple[str, str | None]:
        """Text released by one event and the finish reason if the answer is complete."""
        tokens, finish, error = event.tokens, event.finish, event.error
        if finish == UNAVAILABLE:
            self.ended = True
            raise ApiError(503, error or "the server is shutting down", kind="service_unavailable")
        if error:
            self.ended = True
            log.error("500 request %s: %s", self.job.rid, error)
            raise ApiError(500, f"the engine failed on this request: {error}", kind="server_error")
        self.generated += len(tokens)
        chunk = self.text.feed(tokens, final=finish is not None)
        if self.text.stopped:
            self.cancel()
            return chunk, "stop"
        if finish is not None:
            self.ended = True
            return chunk, "stop" if finish == "stop" else "length"
        return chunk, None

    def usage(self) -> dict[str, int]:
        p = len(self.job.prompt)
        return {"prompt_tokens": p, "completion_tokens": self.generated, "total_tokens": p + self.generated}

    def _choice(self, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
        if self.job.kind == "completion":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        body = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, key: body, "logprobs": None, "finish_reason": finish}

    def _envelope(self, choices: list, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.job.kind == "chat" else "text_completion"
        return {"id": self.prefix + self.job.rid, "object": kind, "created": self.job.created,
                "model": self.job.model, "choices": choices}

    async def whole(self) -> dict[str, Any] | ApiError | None:
        """The complete answer of a request that is not streamed."""
        parts = []
        try:
            while True:
                event = await self._next()
                if event is None:
                    return ApiError(499, "the client disconnected")
                chunk, finish = self._advance(event)
                parts.append(chunk)
                if finish is not None:
                    return {**self._envelope([self._choice("".join(parts), finish, False)], False),
                            "usage": self.usage()}
        except ApiError as exc:
            return exc
        finally:
            self.cancel()

    async def first(self) -> Event | ApiError:
        """Wait for the first event before the stream opens, so a request that fails at once is a plain 500."""
        event = await self._next()
        if event is None:
            return ApiError(499, "the client disconnected")
        if event.finish == UNAVAILABLE:
            self.ended = True
            return ApiError(503, event.error or "the server is shutting down", kind="service_unavailable")
        if event.error:
            self.ended = True
            log.error("500 request %s: %s", self.job.rid, event.error)
            return ApiError(500, f"the engine failed on this request: {event.error}", kind="server_error")
        return event

    async def sse(self, first: Event) -> AsyncIterator[bytes]:
        """Server-sent events: a role chunk (chat), text chunks, the finish, usage if asked, [DONE]."""
        def data(obj: Any) -> bytes:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

        try:
            if self.job.kind == "chat":
                yield data(self._envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], True))
            event: Event | None = first
            while event is not None:
                try:
                    chunk, finish = self._advance(event)
                except ApiError as exc:
                    yield data(exc.body())
                    return
                if chunk or finish:
                    yield data(self._envelope([self._choice(chunk, finish, True)], True))
                if finish is not None:
                    break
                event = await self.job.events.get()
            if self.job.include_usage:
                yield data({**self._envelope([], True), "usage": self.usage()})
            yield b"data: [DONE]\n\n"
        finally:
            self.cancel()
