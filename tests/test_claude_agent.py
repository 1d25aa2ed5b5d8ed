"""ClaudeAgent against a real loopback server speaking the Messages streaming protocol."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import anthropic
import pytest
from sse_server import SSEServer, error_event, max_tokens, overloaded, stream, truncated

from specpilot.core.agents.base import AgentContext, AgentFailure, Candidate
from specpilot.core.agents.claude import ClaudeAgent, MissingAPIKey, require_api_key
from specpilot.core.recipe import Recipe, builtin

KEY = "sk-ant-test-123"
HEAD = ("TITLE: Deeper chain\nRATIONALE: Acceptance stays high at depth 6,\nso longer drafts pay.\n"
        "PREDICTED_SPEEDUP: 1.12\n\n")
RECIPE_EDIT = "FILE: recipe.toml\n```\n<<<<<<< SEARCH\ndepth = 4\n=======\ndepth = 6\n>>>>>>> REPLACE\n```\n"
PLUGIN_EDIT = ("FILE: plugins/foo.py\n```diff\n--- /dev/null\n+++ b/plugins/foo.py\n@@ -0,0 +1,2 @@\n"
               "+def build_tree(draft_logprobs, depth, budget):\n+    return [-1] + list(range(depth - 1))\n```\n")


@pytest.fixture
def ctx(tmp_path: Path) -> AgentContext:
    return AgentContext(deployment={"target": "demo-target", "drafter": "demo-drafter", "device": "cpu"},
                        recipe=builtin("stock"), cost_report={"largest_gap": "draft", "gaps": []},
                        memory=[{"mechanism": "deeper chain", "effect": 1.05}],
                        direction="DIRECTION: shorten draft time",
                        workspace=tmp_path, tuning_summary={"requests": 8}, seed=3)


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)


@pytest.fixture
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[SSEServer]:
    with SSEServer(list(request.param)) as srv:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", srv.url)
        yield srv


def scripted(*replies):  # type: ignore[no-untyped-def]
    return pytest.mark.parametrize("server", [replies], indirect=True)


def propose(ctx: AgentContext, **kwargs: object) -> tuple[Candidate | AgentFailure, list[str]]:
    chunks: list[str] = []
    kwargs.setdefault("model", "claude-test-model")
    result = ClaudeAgent(**kwargs).propose(ctx, chunks.append)  # type: ignore[arg-type]
    assert all(KEY not in c for c in chunks)
    assert KEY not in repr(result)
    return result, chunks


@scripted(stream(HEAD[:20], HEAD[20:], RECIPE_EDIT[:30], RECIPE_EDIT[30:]))
def test_recipe_edit_streams_in_order_and_yields_candidate(server: SSEServer, ctx: AgentContext) -> None:
    result, chunks = propose(ctx)
    assert chunks == [HEAD[:20], HEAD[20:], RECIPE_EDIT[:30], RECIPE_EDIT[30:]]
    assert isinstance(result, Candidate)
    assert result.recipe == builtin("stock").replace(tree={"depth": 6})
    assert (result.title, result.kind, result.predicted_speedup, result.files) == ("Deeper chain", "recipe", 1.12, {})
    assert result.rationale == "Acceptance stays high at depth 6, so longer drafts pay."
    assert "-depth = 4\n+depth = 6\n" in result.diff


@scripted(stream(HEAD, PLUGIN_EDIT))
def test_plugin_file_is_created(server: SSEServer, ctx: AgentContext) -> None:
    result, _ = propose(ctx)
    assert isinstance(result, Candidate) and result.kind == "plugin"
    assert result.files == {"plugins/foo.py": "def build_tree(draft_logprobs, depth, budget):\n"
                                              "    return [-1] + list(range(depth - 1))\n"}
    assert result.recipe == builtin("stock")
    assert "+++ b/plugins/foo.py" in result.diff


@scripted(stream(HEAD, RECIPE_EDIT))
def test_request_caches_shared_prefix_and_puts_direction_last(server: SSEServer, ctx: AgentContext) -> None:
    propose(ctx, model="claude-test-model-2", max_tokens=1000)
    [req] = server.requests
    assert req.path == "/v1/messages" and req.headers["authorization"] == f"Bearer {KEY}"
    body = req.body
    assert (body["model"], body["max_tokens"], body["stream"]) == ("claude-test-model-2", 1000, True)
    [system] = body["system"]
    assert system["cache_control"] == {"type": "ephemeral"}
    for part in ("register_tree_policy", builtin("stock").to_toml(), '"largest_gap": "draft"', "deeper chain"):
        assert part in system["text"]
    assert "shorten draft time" not in system["text"]
    [message] = body["messages"]
    assert message["role"] == "user" and message["content"].endswith("Direction: DIRECTION: shorten draft time")


@pytest.mark.parametrize("server,reason", [
    ([truncated(HEAD, RECIPE_EDIT)], "truncated: the stream ended without message_stop; the reply was not parsed"),
    ([max_tokens(HEAD, RECIPE_EDIT)], "max_tokens: the reply hit max_tokens (4096) before finishing; "
                                      "the reply was not parsed"),
    ([error_event(HEAD)], "error event in the stream: overloaded_error: Overloaded"),
    ([overloaded()] * 3, "API error after 2 retries: HTTP 529 overloaded_error: Overloaded"),
], indirect=["server"])
def test_unfinished_replies_fail_with_named_reason(server: SSEServer, ctx: AgentContext, reason: str) -> None:
    result, chunks = propose(ctx)
    assert result == AgentFailure("claude", reason)


@scripted(overloaded(), stream(HEAD, RECIPE_EDIT))
def test_overloaded_then_success_retries(server: SSEServer, ctx: AgentContext) -> None:
    result, _ = propose(ctx)
    assert isinstance(result, Candidate)
    assert [r.headers["x-stainless-retry-count"] for r in server.requests] == ["0", "1"]


@pytest.mark.parametrize("server,reason", [
    ([stream(HEAD, RECIPE_EDIT.replace("depth = 4", "depth = 5"))],
     "diff did not apply: recipe.toml: block 1: SEARCH text found 0 times (first line: 'depth = 5'); "
     "it must match the file exactly once, whitespace included"),
    ([stream(HEAD, "FILE: core/judge.py\n```\n<<<<<<< SEARCH\n=======\nX = 1\n>>>>>>> REPLACE\n```\n")],
     "diff did not apply: path core/judge.py is outside the allow-list: allowed: recipe.toml, plugins/*.py"),
    ([stream(HEAD, RECIPE_EDIT.replace("depth = 6", "depth = 0"))],
     "invalid recipe: tree.depth must be an integer in [1, 64], got 0"),
    ([stream(HEAD, "I would make the tree deeper.")],
     "no edits in the reply: expected FILE: <path> followed by a fenced diff"),
], indirect=["server"])
def test_bad_edits_fail_with_the_diff_error(server: SSEServer, ctx: AgentContext, reason: str) -> None:
    result, _ = propose(ctx)
    assert result == AgentFailure("claude", reason)


@scripted(stream(f"TITLE: leak {KEY}\n", "RATIONALE: the key is sk-ant-other-999.\n", RECIPE_EDIT))
def test_key_never_appears_in_chunks_or_candidate(server: SSEServer, ctx: AgentContext) -> None:
    result, chunks = propose(ctx)
    assert isinstance(result, Candidate)
    assert result.title == "leak [redacted]" and "sk-ant-" not in result.rationale
    assert chunks[0] == "TITLE: leak [redacted]\n"


@scripted(stream(HEAD, RECIPE_EDIT))
def test_existing_plugins_are_editable_and_shown(server: SSEServer, ctx: AgentContext) -> None:
    (ctx.workspace / "plugins").mkdir()
    (ctx.workspace / "plugins" / "old.py").write_text("OLD = 1\n")
    propose(ctx)
    assert "--- plugins/old.py ---\nOLD = 1\n" in server.requests[0].body["system"][0]["text"]


def test_missing_key_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    message = "Claude agents need ANTHROPIC_API_KEY; set it or use --agents local:N"
    with pytest.raises(MissingAPIKey, match=message):
        require_api_key()
    with pytest.raises(MissingAPIKey, match=message):
        ClaudeAgent()


@scripted(stream(HEAD, RECIPE_EDIT))
def test_client_factory_with_explicit_base_url(server: SSEServer, ctx: AgentContext,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_BASE_URL")
    factory = lambda: anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)  # noqa: E731
    result, _ = propose(ctx, client_factory=factory)
    assert isinstance(result, Candidate) and isinstance(result.recipe, Recipe)


def test_unreachable_api_fails_with_reason(ctx: AgentContext, monkeypatch: pytest.MonkeyPatch) -> None:
    with SSEServer() as srv:
        url = srv.url
    monkeypatch.setenv("ANTHROPIC_BASE_URL", url)
    result, _ = propose(ctx, max_retries=0)
    assert isinstance(result, AgentFailure) and result.reason.startswith("API unreachable after 0 retries: ")
