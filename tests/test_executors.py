"""Executors: the judge on several devices of this machine (local) and on a real local Ray cluster (ray).

The Ray cluster is started here (two 1-CPU devices); nothing of Ray is mocked. Candidates are judged in
parallel, one A/B per device; a Ray worker's actor holds no API key, candidate code runs only in its
subprocess worker, the judge's own clock decides, and a killed actor fails only its own candidate.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mini_deployment
from specpilot.core.cli import main
from specpilot.core.deployment import Deployment
from specpilot.core.executors import ExecutorError, make_executor
from specpilot.core.judge import Judge, diff_applies
from specpilot.core.recipe import builtin
from specpilot.core.setup import prepare

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = Path(__file__).resolve().parent / "plugins"
SECRET = "sk-ant-executor-test-not-a-key"


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("executors")
    built = mini_deployment.build(root, requests=3, max_new_tokens=8)
    deployment = Deployment(target=built["target"], drafter=built["drafter"], workload=built["workload"])
    ctx = prepare(deployment, max_requests=3, max_new_tokens=8)
    stock = builtin("stock")
    outputs = [ctx.engine.generate([r.prompt], r.max_new_tokens, stock, [r.index]).tokens[0] for r in ctx.tuning]
    return root, built, deployment, ctx, ctx.force(ctx.tuning, outputs, stock)["rate"]


def judge_on(setting, executor) -> Judge:
    _, _, deployment, ctx, stock_rate = setting
    judge = Judge(deployment, ctx.tuning, ctx.heldout, ctx.force, limit_s=60.0, start_limit_s=120.0,
                  executor=executor)
    judge.floor, judge.stock_rate = 0.0, stock_rate
    return judge


def recording(monkeypatch) -> list:
    """Every fresh candidate worker the judges start during the test, with the device it was given."""
    started: list = []
    original = Judge.worker

    def worker(self, recipe, workspace=None, start=True, slot=None):
        w = original(self, recipe, workspace, start, slot)
        if recipe is not None:
            started.append((recipe, (slot or self.slots[0]).device.name, w))
        return w

    monkeypatch.setattr(Judge, "worker", worker)
    return started


def plugin_workspace(root: Path, plugin: str) -> Path:
    ws = root / f"ws-{plugin}"
    (ws / "plugins").mkdir(parents=True, exist_ok=True)
    shutil.copy(PLUGINS / f"{plugin}.py", ws / "plugins" / f"{plugin}.py")
    return ws


def in_parallel(*jobs):
    """Run each job in its own thread; their results, in order (an exception is re-raised here)."""
    results: list = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # handed to the test's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# -- bad input: one line that says what to do ---------------------------------------------------------

def one_line_error(capsys, *argv: str) -> str:
    assert main(["run", "--rounds", "1", "--auto", "--headless", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specpilot: error: "), err
    return err[0]


def test_unknown_executor_is_one_line(capsys, tmp_path):
    line = one_line_error(capsys, "--db", str(tmp_path / "s.db"), "--executor", "dask")
    assert "--executor 'dask' is unknown; use one of: local, ray" in line
    assert not (tmp_path / "s.db").exists()  # refused before anything began


@pytest.mark.parametrize("devices, says", [("cpu:99", "core 99 is not available here"),
                                           ("cuda:0", "pass --device cuda"), ("cpu:0,cpu:0", "named twice"),
                                           ("gpu0", "expected cuda:N or cpu:CORES"),
                                           ("cpu:0 --threads 2", "1 core(s) for --threads 2")])
def test_bad_local_devices_are_one_line(capsys, tmp_path, devices, says):
    devices, *more = devices.split()
    assert says in one_line_error(capsys, "--db", str(tmp_path / "s.db"), "--devices", devices, *more)


def test_unreachable_ray_address_is_one_line(capsys, tmp_path):
    pytest.importorskip("ray")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = one_line_error(capsys, "--db", str(tmp_path / "s.db"), "--executor", "ray", "--ray-address",
                          f"127.0.0.1:{port}")
    assert f"--ray-address 127.0.0.1:{port}: no Ray cluster answers there" in line and "ray start --head" in line


def test_ray_not_installed_is_one_line(tmp_path):
    """With `ray` unimportable (as on an install without the [ray] extra) the CLI says how to get it."""
    code = ("import sys; sys.modules['ray'] = None\nfrom specpilot.core.cli import main\n"
            f"sys.exit(main(['run', '--auto', '--headless', '--db', {str(tmp_path / 's.db')!r}, '--executor', 'ray']))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "--executor ray needs Ray, which is not installed: pip install 'specpilot[ray]'" in lines[0]


def test_ray_devices_must_be_a_count(setting):
    pytest.importorskip("ray")
    with pytest.raises(ExecutorError, match="--devices is how many"):
        make_executor("ray", setting[2], "cpu:0,cpu:1", None)


# -- the applies gate: the diff, applied to a clean workspace, makes what is judged ---------------------

def test_applies_gate_checks_the_diff_against_a_clean_workspace(setting, tmp_path):
    from specpilot.core.diffs import DiffError, make_unified_diff

    stock = builtin("stock")
    new = stock.replace(tree={"policy": "plugin:fast_clock"})
    source = (PLUGINS / "fast_clock.py").read_text()
    diff = make_unified_diff("", source, "plugins/fast_clock.py") + make_unified_diff(
        stock.to_toml(), new.to_toml(), "recipe.toml")
    ws = plugin_workspace(tmp_path, "fast_clock")
    assert "applies to a clean workspace (2 edit(s))" in diff_applies(diff, new, stock, ws, None)
    with pytest.raises(DiffError, match="does not make the candidate's recipe"):
        diff_applies(diff, stock.replace(tree={"policy": "plugin:fast_clock", "depth": 3}), stock, ws, None)
    shutil.copy(PLUGINS / "hang.py", ws / "plugins" / "hang.py")  # code the diff does not show
    with pytest.raises(DiffError, match="plugins/hang.py is in the workspace but not in the diff"):
        diff_applies(diff, new, stock, ws, None)
    judge = judge_on(setting, None)
    stale = diff.replace('policy = "chain"', 'policy = "static"')  # made against another recipe
    verdict = judge.evaluate(new, stock, ws, diff=stale)
    gate = verdict.gates["applies"]
    assert list(verdict.gates) == ["applies"] and not gate.passed
    assert gate.detail.startswith("diff did not apply: recipe.toml: hunk 1: context and removed lines not found")
    assert judge.slots[0].baseline is None  # refused before any worker started


# -- local: several devices of this machine -------------------------------------------------------------

def test_local_devices_judge_two_candidates_at_once_each_pinned_to_its_core(setting, monkeypatch):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    cores = sorted(os.sched_getaffinity(0))[:2]
    started = recording(monkeypatch)
    stock = builtin("stock")
    pinned: dict[str, set[int]] = {}
    both = threading.Barrier(2, timeout=120)  # judged one after the other, the first would wait here in vain

    def hook(name: str):
        def on_gate(gate: str, passed: bool, detail: str) -> None:
            if gate == "smoke":
                w = next(w for r, _, w in started if r.draft.method == name)
                pinned[name] = os.sched_getaffinity(w.pid)
                both.wait()
        return on_gate

    with judge_on(setting, make_executor("local", setting[2], f"cpu:{cores[0]},cpu:{cores[1]}")) as judge:
        assert judge.parallel == 2
        a, b = (stock.replace(draft={"method": m}) for m in ("ngram", "early_exit"))
        va, vb = in_parallel(lambda: judge.evaluate(a, stock, on_gate=hook("ngram")),
                             lambda: judge.evaluate(b, stock, on_gate=hook("early_exit")))
    assert {d for _, d, _ in started} == {f"cpu:{cores[0]}", f"cpu:{cores[1]}"}  # one candidate per device
    assert sorted(map(tuple, pinned.values())) == [(cores[0],), (cores[1],)]
    for v in (va, vb):  # both lossless, both timed
        assert v.gates["forcing"].passed and v.forcing.mismatches == 0 and "tuning" in v.gates


# -- ray: a real local cluster --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of two 1-CPU devices, started (with an API key in this process's environment,
    as a user's shell may have) the way a user would start one."""
    ray = pytest.importorskip("ray")
    saved = os.environ.get("ANTHROPIC_API_KEY")
    os.environ["ANTHROPIC_API_KEY"] = SECRET
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False,
             logging_level="ERROR")
    try:
        yield ray
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("ANTHROPIC_API_KEY", None)
        else:
            os.environ["ANTHROPIC_API_KEY"] = saved


def test_ray_judges_in_parallel_keeps_the_guarantees_and_survives_a_killed_actor(setting, cluster, monkeypatch):
    root, _, deployment, _, _ = setting
    started = recording(monkeypatch)
    stock = builtin("stock")
    clocked = stock.replace(tree={"policy": "plugin:fast_clock"})  # freezes every clock in its worker
    doomed = stock.replace(draft={"method": "ngram"})
    ws = plugin_workspace(root, "fast_clock")
    pids: dict[str, tuple[int, int]] = {}
    both = threading.Barrier(2, timeout=120)  # both candidates' workers answered: judged at the same time

    def kill_after_smoke(gate: str, passed: bool, detail: str) -> None:
        if gate == "smoke":  # mid-evaluation: its actor dies between two gates
            both.wait()
            w = next(w for r, _, w in started if r is doomed)
            pids["doomed"] = w.pids()
            os.kill(pids["doomed"][0], signal.SIGKILL)

    def look_at_clocked(gate: str, passed: bool, detail: str) -> None:
        if gate == "smoke":
            both.wait()
            pids["clocked"] = next(w for r, _, w in started if r is clocked).pids()

    with judge_on(setting, make_executor("ray", deployment)) as judge:
        assert [s.device.name for s in judge.slots] == ["ray:0", "ray:1"]
        killed, timed = in_parallel(lambda: judge.evaluate(doomed, stock, on_gate=kill_after_smoke),
                                    lambda: judge.evaluate(clocked, stock, ws, on_gate=look_at_clocked))
        assert {d for _, d, _ in started} == {"ray:0", "ray:1"}  # each A/B on its own device
        gate, detail = next((g, r.detail) for g, r in killed.gates.items() if not r.passed)
        assert gate == "forcing" and "the Ray actor running this worker died" in detail, detail
        assert timed.gates["smoke"].passed and timed.gates["forcing"].passed and "tuning" in timed.gates
        for s in timed.samples["tuning"].rows:  # the judge's clock, around each call: not the frozen one
            assert s["candidate_s"] > 1e-3
        after = judge.evaluate(doomed, stock)  # the run goes on, on both devices
        assert after.gates["forcing"].passed and after.forcing.mismatches == 0
    actor, worker = pids["clocked"]
    environ = Path(f"/proc/{actor}/environ").read_bytes() if alive(actor) else b""
    assert SECRET.encode() not in environ
    deadline = time.monotonic() + 20
    while alive(pids["doomed"][1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pids["doomed"][1]), "the killed actor's worker outlived it"
    assert not any(name.startswith("specpilot_plugin_") for name in sys.modules)  # never in the judge


def test_ray_actor_environment_has_no_api_key(setting, cluster):
    _, _, deployment, _, _ = setting
    with judge_on(setting, make_executor("ray", deployment)) as judge:
        worker = judge.worker(builtin("stock"))
        try:
            actor, sub = worker.pids()
            actor_env = Path(f"/proc/{actor}/environ").read_bytes().split(b"\0")
            sub_env = Path(f"/proc/{sub}/environ").read_bytes().split(b"\0")
        finally:
            worker.close()
    assert os.environ["ANTHROPIC_API_KEY"] == SECRET  # the cluster was started with the key around
    assert not any(SECRET.encode() in e for e in actor_env)
    assert [e for e in actor_env if e.startswith(b"ANTHROPIC_")] == [b"ANTHROPIC_API_KEY=", b"ANTHROPIC_AUTH_TOKEN="]
    assert not any(e.startswith(b"ANTHROPIC_") for e in sub_env)


def run_cli(built: dict, db: Path, *extra: str) -> dict:
    argv = ["run", "--target", built["target"], "--drafter", built["drafter"], "--workload", built["workload"],
            "--rounds", "1", "--agents", "local:2", "--db", str(db), "--max-requests", "3", "--max-new-tokens", "8",
            "--auto", "--headless", "--json", "--seed", "3", *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    env.pop("ANTHROPIC_API_KEY", None)
    proc = subprocess.run([sys.executable, "-m", "specpilot.core.cli", *argv], cwd=db.parent, capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


CLOCK_FREE = ("applies", "smoke", "forcing")  # gates whose verdict no clock decides


def stored(db: Path) -> tuple[dict, list]:
    """Per candidate: what was proposed, its clock-free gates, its forcing result and the requests its tuning
    A/B timed; and every gate event in stored order."""
    from specpilot.core.store import Store

    store = Store(db, read_only=True)
    rnd = store.list_rounds(1)[0]
    cands = {c["cid"]: {"proposed": (c["agent"], c["title"], c["recipe_toml"], c["diff"]),
                        "gates": {g: r["passed"] for g, r in c["gates"].items() if g in CLOCK_FREE},
                        "timed": "tuning" in c["gates"],
                        "forcing": {k: (c.get("forcing") or {}).get(k) for k in ("tokens", "mismatches", "rate",
                                                                                   "near_ties", "passed")},
                        "tuning_requests": [x["request"] for x in c["evaluations"]["tuning"]["samples"]]}
             for c in store.candidates(rnd["id"])}
    gates = [(e.payload["cid"], e.payload["gate"]) for e in store.events(1) if e.kind == "gate"]
    return cands, gates


def test_a_round_on_ray_judges_both_candidates_at_once(setting, cluster, tmp_path):
    """`specpilot run --executor ray --ray-address` on the test's cluster: two agents, one round, both
    candidates through the clock-free gates, their forcing stored, judged at the same time."""
    address = cluster.get_runtime_context().gcs_address
    summary = run_cli(setting[1], tmp_path / "store.db", "--executor", "ray", "--ray-address", address)
    assert len(summary["rounds"]) == 1
    cands, gates = stored(tmp_path / "store.db")
    assert len(cands) == 2 and all(c["timed"] and c["gates"] == dict.fromkeys(CLOCK_FREE, True)
                                   and c["forcing"]["mismatches"] is not None for c in cands.values()), cands
    first, second = sorted(cands)
    end_of_first = max(i for i, (c, _) in enumerate(gates) if c == first)
    assert gates.index((second, "applies")) < end_of_first  # two devices: not one after the other


def verdicts(judge: Judge, trials: list, parallel: bool) -> list[dict]:
    """What the store keeps of each verdict that no clock decides: gates, forcing, the tuning requests timed."""
    jobs = [lambda t=t: judge.evaluate(*t[0], **t[1]) for t in trials]
    out = in_parallel(*jobs) if parallel else [job() for job in jobs]
    return [{"gates": {g: r.passed for g, r in v.gates.items() if g in CLOCK_FREE},
             "details": {g: r.detail for g, r in v.gates.items() if g in CLOCK_FREE},
             "forcing": {k: v.forcing.record.get(k) for k in ("tokens", "mismatches", "rate", "near_ties", "passed")},
             "tuning": [x["request"] for x in v.samples["tuning"].rows]}  # held-out is timed if tuning passes
            for v in out]


def test_ray_stores_the_same_verdicts_as_the_local_executor(setting, cluster, monkeypatch):
    """The same candidates (a recipe, and a plugin with its diff), the same seed: one after the other on the
    local executor, at the same time on Ray's two devices; the same gates, forcing results and requests."""
    from specpilot.core.diffs import make_unified_diff

    root, _, deployment, _, _ = setting
    stock = builtin("stock")
    plugin = stock.replace(tree={"policy": "plugin:fast_clock"})
    diff = make_unified_diff("", (PLUGINS / "fast_clock.py").read_text(), "plugins/fast_clock.py") + \
        make_unified_diff(stock.to_toml(), plugin.to_toml(), "recipe.toml")
    trials = [((stock.replace(draft={"method": "ngram"}), stock), {}),
              ((plugin, stock, plugin_workspace(root, "fast_clock")), {"diff": diff})]
    started = recording(monkeypatch)
    with judge_on(setting, None) as judge:
        local = verdicts(judge, trials, parallel=False)
    with judge_on(setting, make_executor("ray", deployment)) as judge:
        remote = verdicts(judge, trials, parallel=True)
    assert local == remote, (local, remote)
    assert [v["gates"] for v in local] == [dict.fromkeys(CLOCK_FREE, True)] * 2
    assert "diff applies to a clean workspace" in local[1]["details"]["applies"]
    assert all(v["tuning"] for v in local)
    assert sorted(d for _, d, _ in started[2:]) == ["ray:0", "ray:1"]


def test_an_evaluation_in_another_thread_reports_and_obeys_cancellation_as_the_loop_does():
    """The loop judges on several devices from a thread pool: those threads' steps reach the loop's reporter,
    and stopping the run cancels them at their next request (progress.carried)."""
    from specpilot.core import progress

    seen: list[str] = []
    stop = threading.Event()

    def evaluation() -> str:
        with progress.step("judging c1", 3):
            progress.advance()
            stop.set()
            progress.advance()  # the run is stopping now
        return "finished"

    with progress.reporting(lambda step: seen.append(f"{step.name} {step.done}"), stop.is_set):
        job = progress.carried(evaluation)
        with pytest.raises(progress.Cancelled):
            in_parallel(job)
        stop.clear()
        assert progress.carried(lambda: "inline")() == "inline"  # in the reporter's own thread: as it was
        with progress.step("after"):
            pass
    assert seen == ["judging c1 0", "judging c1 1", "judging c1 2", "after 0"], seen
