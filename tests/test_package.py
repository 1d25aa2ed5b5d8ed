"""The package as a GPU box or a Ray node installs it: a wheel built from this tree, installed into a fresh
directory and run from outside the checkout, carries the demo deployment and its request sets, trains with
`specpilot train-demo`, ships no test double, and benchmarks the demo pair."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel's files installed (without dependencies: they are this environment's) into a fresh directory."""
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(out / "dist")], capture_output=True, text=True, timeout=300)
    if build.returncode != 0:
        pytest.fail(f"the wheel did not build: {build.stderr[-2000:]}")
    wheel = next((out / "dist").glob("specpilot-*.whl"))
    site = out / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr
    names = zipfile.ZipFile(wheel).namelist()
    assert "specpilot/models/demo-target/model.safetensors" in names
    assert "specpilot/workloads/code.jsonl" in names
    assert not [n for n in names if "fake_core" in n or n.startswith("tests/")], "the wheel ships test code"
    return site


def _run(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("SPECPILOT_LOOP_FACTORY", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_installed_package_resolves_its_own_demo(installed, tmp_path):
    probe = ("import specpilot.core.deployment as d, specpilot.core.demo_training as t; "
             "print(d.__file__); "
             "print(d.DEMO_TARGET.is_dir() and d.DEMO_DRAFTER.is_dir() and d.DEMO_WORKLOAD.is_file()); "
             "print(bool(t.HELDOUT_MODULES))")
    out = _run(installed, tmp_path, "-c", probe)
    assert out.returncode == 0, out.stderr
    where, demo, heldout = out.stdout.split()
    assert Path(where).is_relative_to(installed), where  # the installed copy, not the checkout
    assert demo == "True" and heldout == "True"


def test_the_installed_cli_benchmarks_the_demo_pair_outside_the_checkout(installed, tmp_path):
    out = _run(installed, tmp_path, "-m", "specpilot.core.cli", "bench", "--max-requests", "2", "--max-new-tokens",
               "8", "--repeats", "1", "--no-hf", "--quiet", "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"stock"' in out.stdout and str(installed) in out.stdout  # the demo target read from the install


def test_the_dashboard_refuses_a_loop_factory_that_names_nothing(monkeypatch):
    from argparse import Namespace

    from specpilot.app.bridge import LOOP_FACTORY_ENV, LoopUnavailable, build_handle

    monkeypatch.setenv(LOOP_FACTORY_ENV, "no_such_module_here:factory")
    with pytest.raises(LoopUnavailable, match="names nothing importable"):
        build_handle(Namespace())
