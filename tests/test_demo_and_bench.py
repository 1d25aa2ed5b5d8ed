"""The shipped demo pair loads in both loaders and agrees; bench's JSON has its documented fields."""

import json
import os
import subprocess
import sys

import pytest
import torch

import mini_deployment
from specpilot.core.deployment import DEMO_DRAFTER, DEMO_TARGET
from specpilot.kernels.cpu import skinny


@pytest.mark.parametrize("model_dir", [DEMO_TARGET, DEMO_DRAFTER], ids=["target", "drafter"])
def test_shipped_model_matches_transformers(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specpilot.core.engine import Engine

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = Engine.load(model_dir, dtype="float32")
    prompts = ["def read_config(path):\n    \"\"\"Read a config file.\"\"\"\n    with open(", "class Stack:\n    def push(self, "]
    for text in prompts:
        ids = tok.encode(text, add_special_tokens=False)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                              pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        ours = engine.generate([ids], 16, speculative=False).tokens[0]
        assert ours == ref


def test_bench_json_fields(tmp_path):
    d = mini_deployment.build(tmp_path, requests=2, max_new_tokens=6)
    cmd = [sys.executable, "-m", "specpilot.core.cli", "bench", "--target", d["target"], "--drafter", d["drafter"],
           "--workload", d["workload"], "--max-requests", "2", "--repeats", "1", "--recipes", "stock,ngram",
           "--quiet", "--json", "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    names = [r["name"] for r in summary["results"]]
    assert names == ["hf-ar", "hf-assisted", "hf-assisted-tuned", "hf-lookup", "ar", "stock", "ngram"]
    keys = {"name", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "mean_accepted_length", "requests",
            "mismatched_requests"}
    for r in summary["results"]:
        assert keys <= set(r)
        assert r["requests"] == 2
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert (r["mean_accepted_length"] is None) == (r["name"] in ("hf-ar", "hf-assisted", "hf-assisted-tuned", "hf-lookup", "ar"))
    ours = {r["name"]: r for r in summary["results"]}
    assert ours["ar"]["mismatched_requests"] == 0 and ours["stock"]["mismatched_requests"] == 0
    for r in summary["results"]:  # where the time went: our systems only, each phase within the pass's time
        assert ("phases_s" in r) == (not r["name"].startswith("hf-"))
    for name in ("ar", "stock", "ngram"):
        ph = ours[name]["phases_s"]
        assert set(ph) == {"prefill", "catch_up", "draft", "verify", "commit", "host"}
        assert ph["prefill"] > 0 and ph["verify"] > 0
        tokens = 1e3 * sum(ph[p] for p in ("draft", "verify", "commit", "host")) / ours[name]["decode_ms_per_token"]
        assert 2 <= round(tokens) <= 12  # 2 requests of at most 6 new tokens
        assert sum(ph.values()) <= 1.001 * tokens / ours[name]["tokens_per_s"]  # within the pass's wall time
    assert ours["ar"]["phases_s"]["catch_up"] == 0 and ours["ar"]["phases_s"]["draft"] < ours["ar"]["phases_s"]["verify"]
    assert ours["stock"]["phases_s"]["draft"] > 0 and ours["stock"]["phases_s"]["catch_up"] > 0


def test_bench_batched_json(tmp_path):
    """Every system at every batch size; a recipe on another linear backend is also compared with batched AR
    on that backend (system "ar+onednn")."""
    d = mini_deployment.build(tmp_path, requests=3, max_new_tokens=6)
    onednn = tmp_path / "budget-onednn.toml"
    onednn.write_text('name = "budget-onednn"\n\n[batching]\npolicy = "budget"\n\n[runtime]\nlinear = "onednn"\n')
    cmd = [sys.executable, "-m", "specpilot.core.cli", "bench", "--target", d["target"], "--drafter", d["drafter"],
           "--workload", d["workload"], "--repeats", "1", "--recipes", f"stock,batch-budget,{onednn}",
           "--batch-sizes", "1,2", "--quiet", "--json", "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout)["results"]
    names = ("ar", "ar+onednn", "stock", "batch-budget", "budget-onednn")
    assert {(r["batch_size"], r["name"]) for r in results} == {(b, n) for b in (1, 2) for n in names}
    assert all(r["mismatched_requests"] == 0 for r in results)
    assert all(r["phases_s"]["prefill"] > 0 and r["decode_ms_per_token"] > 0 for r in results)
    for b in (1, 2):
        by = {r["name"]: r for r in results if r["batch_size"] == b}
        assert by["ar+onednn"]["mean_accepted_length"] is None and by["budget-onednn"]["mean_accepted_length"] > 0
        assert "speedup_vs_ar_same_runtime" not in by["stock"]
        same = by["budget-onednn"]["tokens_per_s"] / by["ar+onednn"]["tokens_per_s"]
        assert by["budget-onednn"]["speedup_vs_ar_same_runtime"] == pytest.approx(same)


def test_bench_bad_input_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specpilot.core.cli", "bench", "--target", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert "does not exist" in out.stderr


def test_profile_prints_gaps_and_a_verify_curve_per_backend(tmp_path):
    d = mini_deployment.build(tmp_path, requests=2, max_new_tokens=6)
    cmd = [sys.executable, "-m", "specpilot.core.cli", "profile", "--target", d["target"], "--drafter", d["drafter"],
           "--workload", d["workload"], "--max-requests", "2", "--dtype", "float32", "--predict", "ngram"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    curves = [line for line in lines if line.startswith("verify ms by nodes")]
    backends = ["native", "onednn"] + (["skinny", "fused"] if skinny.available() else [])
    assert [c.split(":")[0] for c in curves] == [f"verify ms by nodes ({b})" for b in backends]
    assert all("1:" in c and "64:" in c for c in curves)
    drafters = [line for line in lines if line.startswith("drafter ms by width")]
    # every backend, and the drafter model in each approximate drafter format on the profiled one
    assert [c.split(":")[0] for c in drafters] == [f"drafter ms by width ({b})" for b in
                                                   (*backends, "native+q8", "native+q4")]
    assert all("model 1:" in c and ("early_exit:" in c) == ("+" not in c) for c in drafters)
    assert sum(line.endswith("<- largest") for line in lines) == 1
    assert any(line.startswith("predicted ngram: ") for line in lines)


def test_bench_refuses_two_recipes_of_one_name(tmp_path):
    """A bench keys its systems by recipe name: a second recipe of the same name would silently replace the
    first in the table, so it is refused before anything runs."""
    from specpilot.core.recipe import builtin

    dup = tmp_path / "stock-budget.toml"
    dup.write_text(builtin("stock").replace(batching={"policy": "budget"}).to_toml())  # still named "stock"
    out = subprocess.run([sys.executable, "-m", "specpilot.core.cli", "bench", "--recipes", f"stock,{dup}",
                          "--max-requests", "1", "--repeats", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0
    assert f"stock and {dup} are both named 'stock'" in out.stderr
