"""Claude agents in the live loop, steered by hand, against the loopback server that speaks the Anthropic
streaming protocol (tests/sse_server.py).

One run, one round, four Claude agents (built by the registry, model passed through from the options),
each given one scripted reply: a recipe diff (n-gram drafter), a plugin-code diff that registers a tree
policy, a plugin whose tree policy kills its worker, and an edit outside the allow-list. Without --auto the
candidate that passes waits for a person: the test approves it from another thread, is refused when it
tries to approve a failed one, pauses and resumes between steps, and stops the run. The run happens once
(module fixture); the tests below check what it recorded.
"""

from __future__ import annotations

import hashlib
import queue
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest
from sse_server import SSEServer, stream

import mini_deployment
from specpilot.core.cli import build_parser
from specpilot.core.events import DecisionRefused
from specpilot.core.loop import build_loop

KEY = "sk-ant-test-0123456789abcdefXYZ"
MODEL = "claude-test-model"
JUDGE_PY = Path(__file__).resolve().parent.parent / "core" / "judge.py"


def plugin_diff(name: str, text: str) -> str:
    lines = text.splitlines()
    return (f"FILE: plugins/{name}.py\n```diff\n--- /dev/null\n+++ b/plugins/{name}.py\n@@ -0,0 +1,{len(lines)} @@\n"
            + "".join(f"+{line}\n" for line in lines) + "```\n")


def policy_edit(name: str) -> str:
    return (f'FILE: recipe.toml\n```\n<<<<<<< SEARCH\npolicy = "chain"\n=======\npolicy = "plugin:{name}"\n'
            ">>>>>>> REPLACE\n```\n")


FOO = '''import hashlib
import os
import tempfile
from pathlib import Path

from specpilot.core.engine.plugins import register_tree_policy
from specpilot.core.engine.tree import chain_paths

ws = str(Path(__file__).resolve().parent.parent)  # the worker's guard refuses writes inside the workspace
(Path(tempfile.gettempdir()) / f"saw_key-{hashlib.sha1(ws.encode()).hexdigest()[:12]}.txt").write_text(
    str("ANTHROPIC_API_KEY" in os.environ))
register_tree_policy("foo", lambda tree: chain_paths(tree.depth))
'''
CRASH = (Path(__file__).resolve().parent / "plugins" / "crash_exit.py").read_text()
REPLIES = {
    "N-gram drafter, chain 1": [
        "TITLE: N-gram drafter, chain 1\nRATIONALE: Drafting dominates; ",
        "an n-gram lookup costs nothing.\nPREDICTED_SPEEDUP: 2.0\n\n",
        'FILE: recipe.toml\n```\n<<<<<<< SEARCH\nmethod = "model"\n=======\nmethod = "ngram"\n>>>>>>> REPLACE\n',
        "<<<<<<< SEARCH\ndepth = 4\n=======\ndepth = 1\n>>>>>>> REPLACE\n```\n",
    ],
    "Stock chain as a plugin tree policy": [
        "TITLE: Stock chain as a plugin tree policy\nRATIONALE: A tree-shaping plugin ",
        f"(it must never see {KEY}) ",
        "starting from the stock chain.\nPREDICTED_SPEEDUP: 1.01\n\n",
        plugin_diff("foo", FOO),
        policy_edit("foo"),
    ],
    "Plugin that kills its worker": [
        "TITLE: Plugin that kills its worker\nRATIONALE: x\nPREDICTED_SPEEDUP: 1.5\n\n",
        plugin_diff("crash_exit", CRASH), policy_edit("crash_exit"),
    ],
    "Edit outside the workspace": [
        "TITLE: Edit outside the workspace\nRATIONALE: x\nPREDICTED_SPEEDUP: 1.5\n\n",
        "FILE: ../../x.py\n```\n<<<<<<< SEARCH\n=======\nprint('escaped')\n>>>>>>> REPLACE\n```\n",
    ],
}


def stuck(seen: list) -> str:
    """What the loop had emitted, every gate's verdict and where every thread stood, for a wait that failed:
    a timeout alone says nothing about which step never ended, or whether the run ended without the event."""
    last = [f"{e.kind} {str(e.payload)[:100]}" for e in seen[-12:]]
    gates = [f"{e.payload['cid']} {e.payload['gate']} {e.payload['passed']}: {e.payload.get('detail', '')}"
             for e in seen if e.kind == "gate"]
    frames = sys._current_frames()
    stacks = [f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident])[-8:])
              for t in threading.enumerate() if t.ident in frames]
    return (f"{len(seen)} events, the last:\n" + "\n".join(last) + "\ngates:\n" + "\n".join(gates)
            + "\nthreads:\n" + "\n".join(stacks))


def next_event(events: queue.Queue, match, seen: list, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            event = events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for an event; {stuck(seen)}") from None
        if match(event):
            return event
        if event.kind == "run_finished":
            raise AssertionError(f"the run finished before the event waited for; {stuck(seen)}")


def drain(events: queue.Queue, seconds: float) -> list:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            out.append(events.get(timeout=0.05))
        except queue.Empty:
            pass
    return out


@pytest.fixture(scope="module")
def steered(tmp_path_factory):
    """Run the loop once, steering it by hand; returns everything the checks below need."""
    root = tmp_path_factory.mktemp("claude")
    # The n-gram candidate must win beyond the judge's noise with the other test worker busy: with 3 requests
    # of 8 tokens a split, its interval's low end fell to 1.02-1.05 in about 1 run of 10 (no candidate waited);
    # with 6 of 16 it stayed at 1.48 or more in 10 runs, where 1 + the floor reached 1.34 at most.
    built = mini_deployment.build(root, requests=6, max_new_tokens=16)
    db = root / "store.db"
    judge_before = JUDGE_PY.read_bytes()
    patch = pytest.MonkeyPatch()
    record: dict = {"refusals": {}}
    with SSEServer([stream(*chunks) for chunks in REPLIES.values()]) as server:
        patch.setenv("ANTHROPIC_API_KEY", KEY)
        patch.setenv("ANTHROPIC_BASE_URL", server.url)
        try:
            args = build_parser().parse_args([
                "run", "--target", built["target"], "--drafter", built["drafter"], "--workload", built["workload"],
                "--rounds", "2", "--agents", "claude:4", "--model", MODEL, "--db", str(db),
                "--max-requests", "6", "--max-new-tokens", "16"])
            loop = build_loop(args)
            events: queue.Queue = queue.Queue()
            seen: list = []
            result: list = []

            def emit(event):
                seen.append(event)
                events.put(event)

            runner = threading.Thread(target=lambda: result.append(loop.run(emit)), daemon=True)
            runner.start()
            first = next_event(events, lambda e: e.kind == "awaiting_decision", seen)
            waiting = [first.payload["cid"]] + [e.payload["cid"] for e in drain(events, 0.5)
                                                if e.kind == "awaiting_decision"]
            titles = {e.payload["cid"]: e.payload["title"] for e in seen if e.kind == "candidate"}
            approve = next(c for c in waiting if titles[c].startswith("N-gram"))
            crashed = next(c for c, t in titles.items() if t.startswith("Plugin that kills"))
            record["still_waiting"] = not [e for e in drain(events, 0.5) if e.kind == "state"]
            for label, (cid, decision) in {"failed": (crashed, "approve"), "unknown": ("nope", "approve"),
                                           "bad": (approve, "maybe")}.items():
                try:
                    loop.decide(cid, decision)
                except DecisionRefused as exc:
                    record["refusals"][label] = str(exc)
            loop.pause()
            for cid in waiting:  # decided from another thread, as the dashboard does
                decider = threading.Thread(target=loop.decide,
                                           args=(cid, "approve" if cid == approve else "reject", "by hand"))
                decider.start()
                decider.join(10)
            record["while_paused"] = drain(events, 1.0)
            try:
                loop.decide(approve, "approve")
            except DecisionRefused as exc:
                record["refusals"]["twice"] = str(exc)
            loop.resume()
            next_event(events, lambda e: e.kind == "state" and e.payload["state"] == "integrating", seen)
            loop.stop()
            runner.join(240)
            assert not runner.is_alive(), "the loop did not stop"
            loop.store.close()
        finally:
            patch.undo()
        record.update(loop=loop, db=db, seen=seen, summary=result[0], titles=titles, approve=approve,
                      crashed=crashed, waiting=waiting, requests=list(server.requests), root=root,
                      judge_unchanged=JUDGE_PY.read_bytes() == judge_before)
    return record


def cid_of(steered, prefix: str) -> str:
    return next(c for c, t in steered["titles"].items() if t.startswith(prefix))


def test_registry_passes_the_model_and_chunks_stream_in_order(steered):
    assert len(steered["requests"]) == 4
    assert all(r.body["model"] == MODEL and r.body["stream"] for r in steered["requests"])
    chunks: dict[str, list[str]] = {}
    for e in steered["seen"]:
        if e.kind == "agent_chunk":
            chunks.setdefault(e.payload["cid"], []).append(e.payload["text"])
    streamed = sorted(chunks.values())
    expected = sorted([c.replace(KEY, "[redacted]") for c in reply] for reply in REPLIES.values())
    assert streamed == expected  # every delta, in order, one agent_chunk each (the key redacted)


def test_recipe_diff_and_plugin_diff_apply_and_are_judged(steered):
    gates: dict[str, dict] = {}
    for e in steered["seen"]:
        if e.kind == "gate":
            gates.setdefault(e.payload["cid"], {})[e.payload["gate"]] = e.payload["passed"]
    recipe_cid, plugin_cid = steered["approve"], cid_of(steered, "Stock chain")
    assert all(gates[recipe_cid].values()) and list(gates[recipe_cid]) == ["applies", "smoke", "forcing",
                                                                             "tuning", "heldout"]
    assert gates[plugin_cid]["applies"] and gates[plugin_cid]["smoke"] and gates[plugin_cid]["forcing"]
    candidate = next(e.payload for e in steered["seen"] if e.kind == "candidate" and e.payload["cid"] == plugin_cid)
    assert candidate["kind"] == "recipe+plugin" and 'policy = "plugin:foo"' in candidate["recipe"]
    workspace = steered["loop"].workspace / plugin_cid
    assert (workspace / "plugins" / "foo.py").read_text() == FOO  # written to the candidate's workspace
    saw = Path(tempfile.gettempdir()) / f"saw_key-{hashlib.sha1(str(workspace.resolve()).encode()).hexdigest()[:12]}.txt"
    assert saw.read_text() == "False"  # ran in a worker without the key
    assert not any(name.startswith("specpilot_plugin_") for name in sys.modules)  # never in this process


def test_refused_edit_and_crash_fail_with_reasons_and_the_loop_goes_on(steered):
    failed = [e.payload for e in steered["seen"] if e.kind == "candidate_failed"]
    assert len(failed) == 1 and "outside the allow-list" in failed[0]["reason"] and "../../x.py" in failed[0]["reason"]
    assert not list(steered["root"].rglob("x.py")) and not (steered["root"].parent / "x.py").exists()
    assert steered["judge_unchanged"]
    crash = [e.payload for e in steered["seen"] if e.kind == "gate" and e.payload["cid"] == steered["crashed"]]
    assert crash[-1]["gate"] == "smoke" and not crash[-1]["passed"]
    assert "worker died with exit code 7" in crash[-1]["detail"]
    judged = [e.payload["cid"] for e in steered["seen"] if e.kind == "gate" and e.payload["gate"] == "applies"]
    assert len(judged) == 3  # every candidate was judged, crash or not


def test_manual_approval_pause_resume_stop(steered):
    refusals = steered["refusals"]
    assert steered["still_waiting"]  # nothing moves while a passed candidate waits
    assert "failed the smoke gate" in refusals["failed"]  # approval never overrides a failed gate
    assert "not waiting" in refusals["unknown"] and "approve or reject" in refusals["bad"]
    assert "twice" in refusals  # decided once is decided
    paused = steered["while_paused"]
    decided = {e.payload["cid"]: e.payload["decision"] for e in paused if e.kind == "decision"}
    assert decided[steered["approve"]] == "approve"
    assert not any(e.kind == "state" and e.payload["state"] == "integrating" for e in paused)

    loop, summary = steered["loop"], steered["summary"]
    assert len(summary["rounds"]) == 1  # stop() ended the run after the round in flight (2 were asked)
    rnd = summary["rounds"][0]
    decisions = {c["cid"]: (c["verdict"], c["decision"]) for c in rnd["candidates"]}
    assert decisions[steered["approve"]] == ("win", "approve") and decisions[steered["crashed"]] == ("fail", None)
    assert 'method = "ngram"' in rnd["incumbent"]["recipe"]
    stored = loop.store.events(loop.run_id)
    assert [(e.seq, e.kind) for e in steered["seen"]] == [(e.seq, e.kind) for e in stored]  # emitted == stored
    kinds = [(e.kind, e.payload.get("state")) for e in stored]
    assert kinds.index(("state", "paused")) < kinds.index(("state", "integrating"))
    assert stored[-2].kind == "run_finished" and stored[-1].payload == {"state": "done"}
    assert loop.store.run(loop.run_id)["status"] == "stopped"
    assert loop.store.candidate(steered["approve"])["decision"]["by"] == "user"


def test_the_key_never_reaches_the_store(steered):
    loop = steered["loop"]
    assert all(KEY not in repr(e.payload) for e in loop.store.events(loop.run_id))
    assert KEY not in repr(steered["summary"])
    db = steered["db"]
    for path in [db, *db.parent.glob("store.db-*")]:
        assert KEY.encode() not in path.read_bytes(), path
