"""A Claude agent: streams one proposal from the Messages API and turns its edits into a candidate.

The shared context (plugin interfaces, incumbent recipe, cost report, memory) is one cached system block so
parallel agents in a round pay for it once; each agent's direction comes last. A reply that did not finish
(no message_stop, or cut at max_tokens) is a failure and is never parsed: half a diff is not a candidate.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

import anthropic

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.diffs import (PLUGIN_GLOB, RECIPE_FILE, AllowList, DiffError, apply_edits, make_unified_diff,
                        parse_agent_output, workspace_files)
from specpilot.core.mechanisms import interfaces_doc
from specpilot.core.memory import rejection_line
from specpilot.core.recipe import Recipe, RecipeError
from specpilot.core.store.redact import KEY_ENV, redact, redact_text

ClientFactory = Callable[[], anthropic.Anthropic]

OUTPUT_FORMAT = """\
Reply in exactly this shape:

TITLE: <one line, at most 80 characters>
RATIONALE: <a few sentences: which gap this closes and why it should be faster while staying lossless>
PREDICTED_SPEEDUP: <your estimate of the speedup over the incumbent, a number such as 1.08>
DIFFERS: <only if your change resembles one the person rejected: what differs from it, in one line>

Then the edits, each introduced by a line `FILE: <path>` followed by a fenced block holding either
SEARCH/REPLACE blocks or a unified diff:

FILE: recipe.toml
```
<<<<<<< SEARCH
depth = 4
=======
depth = 6
>>>>>>> REPLACE
```

Each SEARCH must match the current file exactly once, whitespace included; add neighbouring lines to make
it unique. You may edit only recipe.toml and plugins/<name>.py. Create a new plugin file with a SEARCH/
REPLACE block whose SEARCH part is empty, or a unified diff from /dev/null. Make one coherent change.
"""


class MissingAPIKey(RuntimeError):
    """Raised when a Claude agent is requested but ANTHROPIC_API_KEY is not set."""


def require_api_key() -> str:
    """The API key from the environment, or a one-line error that says how to proceed without it."""
    key = os.environ.get(KEY_ENV, "").strip()
    if not key:
        raise MissingAPIKey("Claude agents need ANTHROPIC_API_KEY; set it or use --agents local:N")
    return key


def build_system_prefix(ctx: AgentContext, files: dict[str, str]) -> str:
    """The shared, cacheable part of the prompt: identical for every agent of a round."""
    plugins = "".join(f"\n--- {path} ---\n{text}" for path, text in files.items() if path != RECIPE_FILE)
    sections = [
        "You are a speculative-decoding performance engineer. You propose one change at a time to a "
        "deployment's decoding recipe (and optionally plugin code) to make generation faster while keeping "
        "the output exactly identical to the target model's (lossless).",
        OUTPUT_FORMAT,
        interfaces_doc(),  # read now: every mechanism registered so far
        "Deployment:\n" + json.dumps(ctx.deployment, indent=1, sort_keys=True, default=str),
        f"Current recipe ({RECIPE_FILE}):\n{files[RECIPE_FILE]}",
        "Existing plugin files:" + (plugins or " none"),
        "Cost report (where the time goes):\n" + json.dumps(ctx.cost_report, indent=1, sort_keys=True, default=str),
        "Tuning requests (summary):\n" + json.dumps(ctx.tuning_summary, indent=1, sort_keys=True, default=str),
        "Validated memory (mechanisms that won before, with evidence):\n"
        + json.dumps(ctx.memory, indent=1, sort_keys=True, default=str),
    ]
    if ctx.rejected:
        sections.append(
            "Rejected by the person running this search (do not propose these again; a change that resembles "
            "one must say what differs in its DIFFERS line, or it is not judged). Their notes, verbatim:\n"
            + "\n".join(f"- {rejection_line(e)}; fields: {json.dumps(e.get('fragment'), sort_keys=True)}"
                        for e in ctx.rejected))
    return redact_text("\n\n".join(sections))


def build_user_message(ctx: AgentContext) -> str:
    """The per-agent part of the prompt; the direction goes last so the cached prefix stays shared."""
    return redact_text(f"Propose one candidate (seed {ctx.seed}). Follow the reply shape exactly.\n\n"
                       f"Direction: {ctx.direction}")


def _field(text: str, name: str) -> str | None:
    match = re.search(rf"^\s*\**{name}\**:\s*(.*)$", text, re.M | re.I)
    return match.group(1).strip() if match else None


def _rationale(text: str) -> str:
    match = re.search(r"^\s*\**RATIONALE\**:\s*(.*?)(?=^\s*\**(?:PREDICTED_SPEEDUP|FILE)\**:|^```|\Z)",
                      text, re.M | re.S | re.I)
    return " ".join(match.group(1).split()) if match else ""


def _speedup(text: str) -> float | None:
    raw = _field(text, "PREDICTED_SPEEDUP")
    match = re.match(r"[0-9]*\.?[0-9]+", raw or "")
    return float(match.group(0)) if match else None


class _StreamFailed(Exception):
    """A reply that must not be parsed; the message is the failure reason."""


def _describe(exc: anthropic.APIStatusError) -> str:
    """'type: message' from an API error body, so reasons read the same for HTTP errors and error events."""
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and ("type" in error or "message" in error):
            return f"{error.get('type', 'error')}: {error.get('message', '')}".strip()
    return str(exc.message)


class ClaudeAgent:
    """Proposes candidates with Claude through the `anthropic` SDK (ANTHROPIC_BASE_URL is honoured)."""

    def __init__(self, model: str = "claude-opus-5-5", max_tokens: int = 4096,
                 client_factory: ClientFactory | None = None, name: str = "claude", max_retries: int = 2,
                 timeout: float = 300.0) -> None:
        if client_factory is None:
            require_api_key()
        self.name = name
        self.model = model
        self.max_tokens = max_tokens
        self.max_retries = max_retries
        self.timeout = timeout
        self._client_factory = client_factory or self._default_client
        self._client: anthropic.Anthropic | None = None

    def _default_client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(api_key=require_api_key(), max_retries=self.max_retries, timeout=self.timeout)

    def _fail(self, reason: str) -> AgentFailure:
        return AgentFailure(self.name, redact_text(" ".join(reason.split())))

    def propose(self, ctx: AgentContext, on_chunk: Callable[[str], None]) -> Candidate | AgentFailure:
        """Stream one reply, then apply its edits strictly; every problem becomes an AgentFailure."""
        files = workspace_files(ctx.workspace, ctx.recipe)
        try:
            text = self._stream(ctx, files, on_chunk)
        except _StreamFailed as exc:
            return self._fail(str(exc))
        except MissingAPIKey as exc:
            return self._fail(str(exc))
        return self._candidate(text, files)

    def _stream(self, ctx: AgentContext, files: dict[str, str], on_chunk: Callable[[str], None]) -> str:
        if self._client is None:
            self._client = self._client_factory()
        request: dict[str, Any] = dict(
            model=self.model,
            max_tokens=self.max_tokens,
            system=[{"type": "text", "text": build_system_prefix(ctx, files),
                     "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": build_user_message(ctx)}],
        )
        parts: list[str] = []
        stop_reason: str | None = None
        finished = False
        opened = False
        try:
            with self._client.messages.stream(**request) as stream:
                opened = True
                for event in stream:
                    if event.type == "content_block_delta" and event.delta.type == "text_delta":
                        parts.append(event.delta.text)
                        on_chunk(redact_text(event.delta.text))
                    elif event.type == "message_delta":
                        stop_reason = event.delta.stop_reason
                    elif event.type == "message_stop":
                        finished = True
        except anthropic.APIStatusError as exc:
            if opened:
                raise _StreamFailed(f"error event in the stream: {_describe(exc)}") from None
            raise _StreamFailed(f"API error after {self.max_retries} retries: HTTP {exc.status_code} "
                                f"{_describe(exc)}") from None
        except anthropic.APIConnectionError as exc:
            raise _StreamFailed(f"API unreachable after {self.max_retries} retries: {exc}") from None
        except Exception as exc:  # a broken stream (e.g. the connection dropped mid-body) is a failed candidate
            raise _StreamFailed(f"stream broke: {type(exc).__name__}: {exc}") from None
        if not finished:
            raise _StreamFailed("truncated: the stream ended without message_stop; the reply was not parsed")
        if stop_reason == "max_tokens":
            raise _StreamFailed(f"max_tokens: the reply hit max_tokens ({self.max_tokens}) before finishing; "
                                "the reply was not parsed")
        if stop_reason not in ("end_turn", "stop_sequence"):
            raise _StreamFailed(f"stop_reason {stop_reason}: the reply did not end normally; it was not parsed")
        return "".join(parts)

    def _candidate(self, text: str, files: dict[str, str]) -> Candidate | AgentFailure:
        try:
            edits = parse_agent_output(text)
            if not edits:
                return self._fail("no edits in the reply: expected FILE: <path> followed by a fenced diff")
            new_files = apply_edits(edits, files, AllowList((RECIPE_FILE, PLUGIN_GLOB)))
        except DiffError as exc:
            return self._fail(f"diff did not apply: {exc}")
        try:
            recipe = Recipe.from_toml(new_files[RECIPE_FILE], source=RECIPE_FILE)
        except RecipeError as exc:
            return self._fail(f"invalid recipe: {exc}")
        changed = [path for path in new_files if new_files[path] != files.get(path)]
        if not changed:
            return self._fail("the edits changed nothing")
        plugins = {path: new_files[path] for path in changed if path != RECIPE_FILE}
        recipe_changed = RECIPE_FILE in changed
        kind = "recipe+plugin" if recipe_changed and plugins else ("recipe" if recipe_changed else "plugin")
        diff = "".join(make_unified_diff(files.get(path, ""), new_files[path], path) for path in changed)
        title = _field(text, "TITLE") or next((ln.strip("# ").strip() for ln in text.splitlines() if ln.strip()), "")
        return Candidate(
            agent=self.name,
            title=redact_text(title[:120]),
            rationale=redact_text(_rationale(text)),
            kind=kind,
            diff=redact_text(diff),
            recipe=recipe,
            files=redact(plugins),
            predicted_speedup=_speedup(text),
            differs=redact_text(_field(text, "DIFFERS") or ""),
        )

