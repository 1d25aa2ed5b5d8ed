"""The package as a GPU box or a Ray node installs it: a wheel built from this tree, installed by pip into a fresh
virtual environment outside the checkout, carries the demo deployment and its request sets, trains with
`specpilot train-demo`, ships no test double, and its console scripts run there: `specpilot bench` and
`specpilot run` on the demo pair, `specpilot serve` answering a request, and the dashboard replaying that run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from serve_helpers import Server

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # slow: the test workers take it first (conftest.py)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment (`python -m venv`, outside the checkout) with the wheel installed by pip, console
    scripts and all. Its dependencies are this environment's, reached through a .pth file: no network, and no
    second multi-GB torch."""
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(out / "dist")], capture_output=True, text=True, timeout=300)
    if build.returncode != 0:
        pytest.fail(f"the wheel did not build: {build.stderr[-2000:]}")
    wheel = next((out / "dist").glob("specpilot-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "specpilot/models/demo-target/model.safetensors" in names
    assert "specpilot/workloads/code.jsonl" in names
    assert not [n for n in names if "fake_core" in n or n.startswith("tests/")], "the wheel ships test code"
    env_dir = out / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, timeout=60).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    deps = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) or p in ours]
    (Path(site) / "specpilot_test_deps.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr
    for script in ("specpilot", "specpilot-tui"):
        assert (env_dir / "bin" / script).is_file(), f"pip installed no {script} console script"
    return env_dir


def _env() -> dict[str, str]:
    """This environment without anything that would point an installed package back at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECPILOT_LOOP_FACTORY", "SPECPILOT_DB")}
    return {**env, "TOKENIZERS_PARALLELISM": "false"}


def _run(venv: Path, cwd: Path, program: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / program), *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def one_round(venv, tmp_path_factory) -> tuple[Path, dict]:
    """`specpilot run --rounds 1 --headless` on the demo pair, from the installed console script."""
    work = tmp_path_factory.mktemp("run")
    out = _run(venv, work, "specpilot", "run", "--rounds", "1", "--headless", "--auto", "--json", "--agents",
               "local:2", "--max-requests", "3", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr[-3000:]
    return work / "store.db", json.loads(out.stdout)


def test_the_installed_package_resolves_its_own_demo(venv, tmp_path):
    probe = ("import specpilot.core.deployment as d, specpilot.core.demo_training as t; "
             "print(d.__file__); "
             "print(d.DEMO_TARGET.is_dir() and d.DEMO_DRAFTER.is_dir() and d.DEMO_WORKLOAD.is_file()); "
             "print(bool(t.HELDOUT_MODULES))")
    out = _run(venv, tmp_path, "python", "-c", probe)
    assert out.returncode == 0, out.stderr
    where, demo, heldout = out.stdout.split()
    assert Path(where).is_relative_to(venv), where  # the installed copy, not the checkout
    assert demo == "True" and heldout == "True"


def test_the_installed_cli_benchmarks_the_demo_pair_outside_the_checkout(venv, tmp_path):
    out = _run(venv, tmp_path, "specpilot", "bench", "--max-requests", "2", "--max-new-tokens", "8", "--repeats", "1",
               "--no-hf", "--quiet", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"stock"' in out.stdout and str(venv) in out.stdout  # the demo target read from the install


def test_the_installed_cli_runs_a_round_of_the_loop_on_the_demo(venv, one_round):
    db, summary = one_round
    assert db.is_file() and isinstance(summary["run"], int)
    runs = _run(venv, db.parent, "specpilot", "runs", "--json")
    assert runs.returncode == 0, runs.stderr
    run = next(r for r in json.loads(runs.stdout) if r["id"] == summary["run"])
    assert str(venv) in json.dumps(run["deployment"])  # the installed demo pair, not the checkout's


def test_the_installed_server_answers_as_the_checkout_decodes(venv, tmp_path):
    from transformers import AutoTokenizer

    from specpilot.core.deployment import DEMO_TARGET
    from specpilot.core.engine import Engine

    prompt = "def fibonacci(n):"
    with Server("--recipe", "ar", command=[str(venv / "bin" / "specpilot")], cwd=tmp_path, env=_env()) as server:
        text = server.client().completions.create(model=Path(DEMO_TARGET).name, prompt=prompt, max_tokens=12,
                                                  temperature=0).choices[0].text
    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    ids = tok(prompt).input_ids
    reference = Engine.load(DEMO_TARGET).generate([ids], 12, speculative=False).tokens[0]
    assert text == tok.decode(reference, skip_special_tokens=True)


REPLAY = """
import asyncio, sys
from specpilot.app.app import SpecPilotApp, build_parser
from specpilot.app.screens.runs import RunsScreen

async def main():
    app = SpecPilotApp(build_parser().parse_args(["--replay", "--db", sys.argv[1]]))
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(400):
            if isinstance(app.screen, RunsScreen) and app.screen.rounds:
                break
            await pilot.pause(0.05)
        print(type(app.screen).__name__, app.screen.rounds)
        app.exit()

asyncio.run(main())
"""


def test_the_installed_dashboard_replays_that_run(venv, one_round):
    db, _ = one_round
    out = _run(venv, db.parent, "python", "-c", REPLAY, str(db), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split(None, 1) == ["RunsScreen", "[1]\n"], out.stdout
    assert _run(venv, db.parent, "specpilot-tui", "--help").returncode == 0


def test_the_dashboard_refuses_a_loop_factory_that_names_nothing(monkeypatch):
    from argparse import Namespace

    from specpilot.app.bridge import LOOP_FACTORY_ENV, LoopUnavailable, build_handle

    monkeypatch.setenv(LOOP_FACTORY_ENV, "no_such_module_here:factory")
    with pytest.raises(LoopUnavailable, match="names nothing importable"):
        build_handle(Namespace())
