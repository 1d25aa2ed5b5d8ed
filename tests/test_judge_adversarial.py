"""Adversarial candidates through the real Judge, with real worker subprocesses, on the mini deployment.

Each candidate is a test plugin (tests/plugins/) copied into its own workspace, or a recipe. The judge must
fail the lossy and hanging ones with a reason, see through faked clocks and faked stats (only its own
timings and its own forcing decide), kill a hung worker's whole process group, and never import candidate
code into its own process. (A plugin that kills its worker is judged in the live loop: test_loop_claude.)
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

import mini_deployment
from conftest import register_test_plugin
from specpilot.core.deployment import Deployment
from specpilot.core.judge import Judge, Worker
from specpilot.core.recipe import builtin
from specpilot.core.setup import prepare

PLUGINS = Path(__file__).resolve().parent / "plugins"
LIMIT_S = 5.0


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    built = mini_deployment.build(root, requests=3, max_new_tokens=8)
    deployment = Deployment(target=built["target"], drafter=built["drafter"], workload=built["workload"])
    ctx = prepare(deployment, max_requests=3, max_new_tokens=8)
    stock = builtin("stock")
    outputs = [ctx.engine.generate([r.prompt], r.max_new_tokens, stock, [r.index]).tokens[0] for r in ctx.tuning]
    stock_rate = ctx.force(ctx.tuning, outputs, stock)["rate"]
    return root, deployment, ctx, stock, stock_rate


@pytest.fixture(scope="module")
def judge(setting):
    """The run's judge with its calibration filled in (floor 0, stock's measured forcing rate); its baseline
    worker stays resident across the tests, as it does across a run's candidates."""
    _, deployment, ctx, _, stock_rate = setting
    with Judge(deployment, ctx.tuning, ctx.heldout, ctx.force, limit_s=60.0, start_limit_s=120.0) as judge:
        judge.floor, judge.stock_rate = 0.0, stock_rate
        yield judge


@pytest.fixture
def started(judge, monkeypatch):
    """Every fresh worker the judge starts for a recipe during the test (not its baseline worker)."""
    workers = []
    original = Judge.worker

    def recording(self, recipe, *args, **kwargs):
        worker = original(self, recipe, *args, **kwargs)
        if recipe is not None:
            workers.append(worker)
        return worker

    monkeypatch.setattr(Judge, "worker", recording)
    return workers


def workspace(setting, plugin: str) -> Path:
    root = setting[0]
    ws = root / f"ws-{plugin}"
    (ws / "plugins").mkdir(parents=True, exist_ok=True)
    shutil.copy(PLUGINS / f"{plugin}.py", ws / "plugins" / f"{plugin}.py")
    return ws


def hang_pid_file(ws: Path) -> Path:
    """Where tests/plugins/hang.py leaves its child's pid (outside the guarded workspace)."""
    import hashlib
    import tempfile

    return Path(tempfile.gettempdir()) / f"hang-{hashlib.sha1(str(ws.resolve()).encode()).hexdigest()[:12]}.pid"


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def assert_no_candidate_code_imported(*workspaces: Path) -> None:
    roots = [str(ws.resolve()) for ws in workspaces]
    for name, module in list(sys.modules.items()):
        assert not name.startswith("specpilot_plugin_"), name
        path = getattr(module, "__file__", None) or ""
        assert not any(str(Path(path).resolve()).startswith(r) for r in roots if path), (name, path)
    from specpilot.core.mechanisms import names

    assert not set(names("tree_policy")) & {"plugin:hang", "plugin:crash_exit", "plugin:fast_clock",
                                             "plugin:fake_stats"}


def failed_gate(verdict) -> tuple[str, str]:
    return next((g, r.detail) for g, r in verdict.gates.items() if not r.passed)


def test_lossy_verification_fails_forcing(setting, judge, started):
    _, _, ctx, stock, _ = setting
    lossy = stock.replace(verify={"sampling": register_test_plugin("lossy_top2")}, draft={"method": "early_exit"})
    changed = [ctx.engine.generate([r.prompt], r.max_new_tokens, lossy, [r.index]).tokens[0] for r in ctx.tuning]
    assert ctx.force(ctx.tuning, changed, lossy)["rate"] > 0.05  # precondition: it changes the output here
    verdict = judge.evaluate(lossy, stock, workspace=workspace(setting, "lossy_top2"))
    assert failed_gate(verdict)[0] == "forcing"
    assert verdict.forcing.rate > verdict.forcing.threshold
    assert "tuning" not in verdict.gates and not verdict.passed
    assert [w.alive for w in started] == [False]  # the candidate's worker, closed; the baseline stays


def test_hang_is_killed_at_the_limit_with_its_process_group(setting, judge, started, monkeypatch):
    ws = workspace(setting, "hang")
    monkeypatch.setattr(judge, "limit_s", LIMIT_S)
    t0 = time.monotonic()
    verdict = judge.evaluate(builtin("stock").replace(tree={"policy": "plugin:hang"}), builtin("stock"), ws)
    elapsed = time.monotonic() - t0
    gate, detail = failed_gate(verdict)
    assert gate == "smoke" and f"exceeded its {LIMIT_S:.0f} s limit and was killed" in detail
    assert elapsed < 120
    candidate = started[0]
    assert candidate.proc.returncode == -9
    assert not alive(candidate.pid)
    child = int(hang_pid_file(ws).read_text())
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "the hung worker's child survived the process-group kill"
    assert_no_candidate_code_imported(ws)


def test_patched_clocks_do_not_change_the_judges_timing(setting, judge):
    ws = workspace(setting, "fast_clock")
    stock = builtin("stock")
    verdict = judge.evaluate(stock.replace(tree={"policy": "plugin:fast_clock"}), stock, ws)
    assert verdict.gates["forcing"].passed
    samples = verdict.samples["tuning"].rows
    for s in samples:  # real seconds, measured by the judge around each round trip
        assert s["candidate_s"] > 1e-3
    assert 0.33 < verdict.tuning.speedup < 3.0, samples  # the stock chain: as fast as stock, not infinitely
    assert_no_candidate_code_imported(ws)


def test_drafter_plugin_reading_the_held_out_file_is_refused(setting, judge, started):
    ws = workspace(setting, "peek_heldout")
    stock = builtin("stock")
    verdict = judge.evaluate(stock.replace(draft={"method": "plugin:peek_heldout"}), stock, ws)
    gate, detail = failed_gate(verdict)
    assert gate == "smoke" and "may not read the request set" in detail, detail
    assert "tuning" not in verdict.gates and not verdict.passed
    assert_no_candidate_code_imported(ws)


def test_drafter_plugin_freezing_the_clock_does_not_change_the_judges_timing(setting, judge):
    ws = workspace(setting, "clock_drafter")
    stock = builtin("stock")
    verdict = judge.evaluate(stock.replace(draft={"method": "plugin:clock_drafter"}), stock, ws)
    assert verdict.gates["forcing"].passed
    for s in verdict.samples["tuning"].rows:
        assert s["candidate_s"] > 1e-3
    assert 0.33 < verdict.tuning.speedup < 3.0, verdict.samples["tuning"].rows  # the stock drafter, as fast as stock
    assert_no_candidate_code_imported(ws)


def test_batching_plugin_editing_the_workspace_is_refused(setting, judge):
    ws = workspace(setting, "edit_workspace")
    victim = ws.parent / "victim.txt"
    victim.write_text("original")
    stock = builtin("stock")
    verdict = judge.evaluate(stock.replace(batching={"policy": "plugin:edit_workspace"}), stock, ws)
    gate, detail = failed_gate(verdict)
    assert gate == "smoke" and "may not write" in detail and "victim.txt" in detail, detail
    assert victim.read_text() == "original"
    assert_no_candidate_code_imported(ws)


def test_plugin_name_no_workspace_file_declares_fails_before_any_worker(setting, judge, started):
    stock = builtin("stock")
    verdict = judge.evaluate(stock.replace(verify={"sampling": "plugin:missing"}), stock, workspace(setting, "hang"))
    gate, detail = failed_gate(verdict)
    assert gate == "applies" and "verify.sampling = 'plugin:missing' is not allowed" in detail, detail
    assert started == []  # nothing ran


def test_fake_stats_are_ignored(setting, judge, monkeypatch):
    ws = workspace(setting, "fake_stats")
    replies = []
    original = Worker.call

    def recording(self, msg, timeout=None):
        reply = original(self, msg, timeout)
        replies.append(reply)
        return reply

    monkeypatch.setattr(Worker, "call", recording)
    stock = builtin("stock")
    verdict = judge.evaluate(stock.replace(tree={"policy": "plugin:fake_stats"}), stock, ws)
    assert max(a for r in replies for a in r.get("accepted", [0])) == 1000  # the lie reached the judge...
    assert verdict.gates["forcing"].passed  # its tokens are right: only its stats lie
    gate, detail = failed_gate(verdict)
    assert gate == "tuning" and verdict.tuning.speedup < 0.8, detail  # ...and changed nothing
    for s in verdict.samples["tuning"].rows:
        assert s["candidate_s"] > 0.09  # the 0.1 s it really sleeps per request, whatever it reports
        assert set(s) == {"request", "incumbent_s", "candidate_s", "incumbent_tps", "candidate_tps"}
    assert_no_candidate_code_imported(ws)
