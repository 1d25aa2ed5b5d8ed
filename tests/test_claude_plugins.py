"""The Claude agent may propose a plugin of any kind: against the loopback fake of the streaming API
(tests/sse_server.py), a reply that adds a draft-length plugin and a recipe that selects it is applied,
judged (the plugin runs only in a judge worker) and stored."""

from __future__ import annotations

import sys

import pytest
from sse_server import SSEServer, stream

import mini_deployment
from specpilot.core.cli import build_parser
from specpilot.core.loop import build_loop
from specpilot.core.store import Store

PLUGIN = '''from specpilot.core.mechanisms import register


def length(depth: int, recent: list[int]) -> int:
    return depth if not recent or recent[-1] > 1 else 1


register("draft_length", "short_after_miss", length)
'''


def reply() -> list[str]:
    lines = PLUGIN.splitlines()
    return [
        "TITLE: Draft short after a miss\nRATIONALE: A step whose draft was rejected predicts another; ",
        "draft one token then.\nPREDICTED_SPEEDUP: 1.05\n\n",
        "FILE: plugins/short_after_miss.py\n```diff\n--- /dev/null\n+++ b/plugins/short_after_miss.py\n"
        f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines) + "```\n",
        'FILE: recipe.toml\n```\n<<<<<<< SEARCH\nlength = "fixed"\n=======\nlength = "plugin:short_after_miss"\n'
        ">>>>>>> REPLACE\n```\n",
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("claude-plugin")
    built = mini_deployment.build(root, requests=3, max_new_tokens=8)
    patch = pytest.MonkeyPatch()
    with SSEServer([stream(*reply())]) as server:
        patch.setenv("ANTHROPIC_API_KEY", "sk-ant-test-plugin")
        patch.setenv("ANTHROPIC_BASE_URL", server.url)
        try:
            args = build_parser().parse_args([
                "run", "--target", built["target"], "--drafter", built["drafter"], "--workload", built["workload"],
                "--rounds", "1", "--agents", "claude:1", "--model", "claude-test-model", "--db", str(root / "s.db"),
                "--max-requests", "3", "--max-new-tokens", "8", "--auto"])
            loop = build_loop(args)
            seen: list = []
            summary = loop.run(seen.append)
            loop.store.close()
        finally:
            patch.undo()
        prompt = server.requests[0] if server.requests else {}
    return {"loop": loop, "seen": seen, "summary": summary, "db": root / "s.db", "prompt": prompt}


def test_the_agent_is_told_every_kind(run):
    text = str(run["prompt"])
    for kind in ("drafter", "tree_policy", "draft_length", "acceptance", "batching", "weight_format",
                 "linear_backend"):
        assert f"## {kind} (recipe field" in text, kind


def test_a_draft_length_plugin_is_applied_judged_and_stored(run):
    cand = next(e.payload for e in run["seen"] if e.kind == "candidate")
    assert cand["kind"] == "recipe+plugin" and 'length = "plugin:short_after_miss"' in cand["recipe"]
    cid = cand["cid"]
    ws = run["loop"].workspace / cid
    assert (ws / "plugins" / "short_after_miss.py").read_text() == PLUGIN  # applied to its workspace
    gates = {e.payload["gate"]: e.payload["passed"] for e in run["seen"] if e.kind == "gate" and e.payload["cid"] == cid}
    assert gates["applies"] and gates["smoke"] and gates["forcing"], gates  # ran in a worker, stayed lossless
    assert "tuning" in gates  # timed against the incumbent
    assert not any(name.startswith("specpilot_plugin_") for name in sys.modules)  # never in this process
    store = Store(str(run["db"]))
    try:
        stored = store.candidate(cid)
        assert stored["kind"] == "recipe+plugin" and "+++ b/plugins/short_after_miss.py" in stored["diff"]
        assert stored["recipe_toml"] == cand["recipe"]
        won = run["summary"]["rounds"][0]["candidates"][0]["verdict"] == "win"
        remembered = [m for m in store.memory() if (m.get("evidence") or {}).get("cid") == cid]
        assert bool(remembered) == won
        if won:  # a winning plugin is remembered with its source
            assert remembered[0]["evidence"]["plugins"] == {"plugins/short_after_miss.py": PLUGIN}
    finally:
        store.close()
