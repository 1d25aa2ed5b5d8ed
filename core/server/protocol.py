"""The OpenAI request bodies the server accepts, checked before anything reaches the engine.

A request is parsed into a `Job` or refused with an `ApiError` that carries its HTTP status and OpenAI's error
shape ({"error": {"message", "type", "param", "code"}}), so a client library raises its usual exception and the
server keeps serving. Parameters the engine does not implement are refused by name, never ignored: a client
that asked for `n` = 2 or `tools` would otherwise get an answer that silently is not what it asked for.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from specpilot.core.engine.decode import Verification, misfit

UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "presence_penalty", "frequency_penalty", "response_format", "best_of", "echo", "suffix")


class ApiError(Exception):
    """A refused request: HTTP status, OpenAI error type, the offending parameter and an optional code."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """One accepted request as the engine thread sees it, and the channel its tokens come back on."""

    kind: str  # "chat" or "completion"
    model: str
    prompt: list[int]
    max_tokens: int
    ver: Verification
    seed_id: int
    stop: list[str]
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    rid: str = field(default_factory=lambda: secrets.token_hex(12))
    arrived: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue | None = None  # the scheduler's Events, put from the engine thread
    loop: asyncio.AbstractEventLoop | None = None
    engine_id: int | None = None  # the scheduler's id once the engine thread has added it
    done: bool = False


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"`{name}` must be a number in [{low}, {high}], got {value!r}", name)
    return float(value)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "`stop` must be a non-empty string or a list of at most 4 of them", "stop")
    return stops


def sampling(body: dict, default: Verification) -> tuple[Verification, int]:
    """The request's verification and the id its seeded noise is keyed by. Left out, temperature, top_p and
    seed are the recipe's own; temperature 0 is greedy. A sampled request is verified seeded (exact: its
    tokens are the target's own seeded sample, whatever was drafted), with `seed` or a fresh one, and keyed
    by id 0, so one seed and prompt always give one output, as OpenAI's `seed` promises."""
    base_t = default.temperature if default.sampling != "greedy" else 0.0
    temperature = _number(body, "temperature", base_t, 0.0, 2.0)
    top_p = _number(body, "top_p", default.top_p, 0.0, 1.0)
    if top_p <= 0.0:
        raise ApiError(400, "`top_p` must be above 0", "top_p")
    if temperature == 0.0:
        return Verification("greedy"), 0
    seed = body.get("seed")
    if seed is None:
        seed = default.seed if default.sampling == "seeded" and "temperature" not in body else secrets.randbits(31)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise ApiError(400, f"`seed` must be an integer, got {seed!r}", "seed")
    return Verification("seeded", temperature, top_p, int(seed) & 0x7FFFFFFF), 0


def parse(body: Any, kind: str, model_names: tuple[str, ...], encode, context: int, default: Verification) -> Job:
    """Check one /v1/chat/completions (kind "chat") or /v1/completions body and encode its prompt.

    `encode(body) -> token ids` applies the chat template or tokenizes the prompt; `context` is the most
    tokens (prompt and new ones) one request may take."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model not in model_names:
        raise ApiError(400, f"model {model!r} is not served here; use one of "
                       f"{', '.join(model_names)} (GET /v1/models)", "model", code="model_not_found")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise ApiError(400, f"`{name}` is not supported by this server; leave it out", name)
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError(400, f"`n` must be 1 (one choice per request), got {n!r}", "n")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "`messages` must be a non-empty list of {role, content} objects", "messages")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise ApiError(400, "each message needs a `role` of system, developer, user or assistant",
                               "messages")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise ApiError(400, "only text content parts are supported", "messages")
            elif not isinstance(content, str):
                raise ApiError(400, "each message's `content` must be a string or a list of text parts", "messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ids:
            raise ApiError(400, "`prompt` must be a non-empty string or a list of token ids (one prompt a request)",
                           "prompt")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name, 16 if kind == "completion" else None)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0):
        raise ApiError(400, f"`{name}` must be a positive integer, got {max_tokens!r}", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "`stream` must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "`stream_options` must be an object", "stream_options")
    stop = _stops(body)
    ver, seed_id = sampling(body, default)
    try:
        prompt_ids = encode(body)
    except ApiError:
        raise
    except Exception as exc:  # a chat template that refuses the conversation, a tokenizer error
        raise ApiError(400, f"the prompt could not be encoded: {exc}", "messages" if kind == "chat" else "prompt")
    if max_tokens is None:
        max_tokens = max(context - len(prompt_ids), 1)
    if why := misfit(len(prompt_ids), max_tokens, context, name):
        raise ApiError(400, why, name, code="context_length_exceeded")
    return Job(kind, model, prompt_ids, max_tokens, ver, seed_id, stop, stream,
               bool(options.get("include_usage")))
