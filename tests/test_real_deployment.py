"""A real deployment as a user meets it: SmolLM2-135M-Instruct from its GGUF, with no drafter model, is
lossless against transformers in float32 for AR, n-gram, early exit and a dynamic tree; `--recipes best`
takes the loop's stored incumbent; a backend that would not fit is refused before it loads."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import mini_deployment
from specpilot.core.deployment import Deployment
from specpilot.core.engine import Engine, ModelLoadError
from specpilot.core.recipe import Recipe, builtin, stock

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

RECIPES = {
    "ngram": Recipe.from_dict({"draft": {"method": "ngram", "ngram_max": 3}, "tree": {"policy": "chain", "depth": 6}}),
    "early_exit": Recipe.from_dict({"draft": {"method": "early_exit", "exit_layer": 10},
                                    "tree": {"policy": "chain", "depth": 3}}),
    "gguf-ngram": Recipe.from_dict({"draft": {"method": "ngram", "ngram_max": 3}, "tree": {"policy": "chain", "depth": 6},
                                    "weights": {"format": "gguf"}}),
    "gguf-dynamic": Recipe.from_dict({"draft": {"method": "early_exit", "exit_layer": 15},
                                      "tree": {"policy": "dynamic", "depth": 4, "topk": 3, "budget": 10},
                                      "weights": {"format": "gguf"}}),
}
GGUF_AR = Recipe.from_dict({"weights": {"format": "gguf"}})
NEW_TOKENS = 16
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "Explain what a hash map is in two sentences.",
           "Fix this code: def add(a, b): return a - b"]


@pytest.fixture(scope="module")
def smol(smollm2_dir, one_thread):
    from transformers import AutoTokenizer

    from specpilot.core.hf import hf_model
    from specpilot.core.workload import Request, encode

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [encode(tok, Request(str(i), p, NEW_TOKENS, chat=True)) for i, p in enumerate(PROMPTS)]
    reference = hf_model(str(smollm2_dir))
    with torch.inference_mode():
        greedy = [reference.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=tok.eos_token_id)[0, len(p):].tolist() for p in prompts]
    return Engine.load(smollm2_dir), prompts, greedy


def _until_eos(tokens, eos):
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("name", ["ar", "gguf-ar", *RECIPES])
def test_smollm2_greedy_identity_against_transformers(smol, name):
    """Weights read as stored (format gguf, the file's Q4_1/Q8_0 blocks) give transformers' float32 greedy
    output too."""
    engine, prompts, greedy = smol
    eos = engine.target.cfg.eos_token_ids[0]
    for p, ref in zip(prompts, greedy):
        if name in ("ar", "gguf-ar"):
            ours = engine.generate([p], NEW_TOKENS, GGUF_AR if name == "gguf-ar" else None, speculative=False)
        else:
            ours = engine.generate([p], NEW_TOKENS, RECIPES[name])
        assert _until_eos(ours.tokens[0], eos) == _until_eos(ref, eos)
        if name != "ar":
            assert any(a > 0 for s in ours.steps for a in s.accepted)  # it really speculated


def test_reference_shares_the_engine_mapping(smollm2_dir):
    """The transformers reference reads the same float32 values, with no private copy of the model."""
    from transformers import AutoModelForCausalLM

    from specpilot.core.hf import hf_model

    shared = hf_model(str(smollm2_dir))
    plain = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1789]])
    with torch.inference_mode():
        assert torch.equal(shared(ids).logits, plain(ids).logits)
    storage = shared.model.layers[0].self_attn.q_proj.weight.untyped_storage()
    assert storage.nbytes() == (smollm2_dir / "model.safetensors").stat().st_size  # a view of the mapped file


def test_no_drafter_deployment(smollm2_gguf):
    d = Deployment(target=smollm2_gguf, drafter="none")
    assert d.drafter is None and d.target_source == smollm2_gguf and d.dtype == "float32"
    assert d.describe().startswith("smollm2-135m-instruct") and "+ none" in d.describe()
    assert stock(False).draft.method == "ngram" and stock(True).draft.method == "model"
    d.validate()


def test_recipe_needing_a_drafter_is_refused_in_one_line(smollm2_gguf, capsys, tmp_path):
    from specpilot.core.cli import main

    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt": "Say hi.", "chat": True, "max_new_tokens": 4}) + "\n")
    code = main(["verify", "--target", smollm2_gguf, "--drafter", "none", "--workload", str(workload),
                 "--recipe", "chain6", "--max-requests", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "needs a drafter checkpoint" in err and "\n" not in err


def test_bench_without_drafter_skips_assisted_with_a_note(smollm2_gguf, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"id": "a", "prompt": "List three colours.", "chat": True,
                                    "max_new_tokens": 6}) + "\n")
    cmd = [sys.executable, "-m", "specpilot.core.cli", "bench", "--target", smollm2_gguf, "--drafter", "none",
           "--workload", str(workload), "--repeats", "1", "--recipes", "stock", "--quiet", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert [r["name"] for r in summary["results"]] == ["hf-ar", "hf-lookup", "ar", "stock"]
    assert any("hf-assisted skipped" in n for n in summary["notes"])
    assert all(r["mismatched_requests"] == 0 for r in summary["results"])


def test_batched_bench_compares_a_block_recipe_with_batched_ar_on_the_blocks(smol, smollm2_gguf, tmp_path):
    """`bench --batch-sizes` with a gguf recipe also runs batched AR on the blocks ("ar+gguf"), so what its
    speculation keeps at each batch size is measured on the same weights; every output equals batched AR's."""
    from specpilot.core.batchbench import run_batched

    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": str(i), "prompt": p, "chat": True, "max_new_tokens": 8}) + "\n"
                                for i, p in enumerate(PROMPTS)))
    engine = smol[0]
    recipe = RECIPES["gguf-ngram"].replace(name="gguf-ngram")
    summary = run_batched(Deployment(smollm2_gguf, None, str(workload)), [recipe], [1, 2], repeats=1,
                          progress=False, engine=engine)
    by = {(r["batch_size"], r["name"]): r for r in summary["results"]}
    assert set(by) == {(b, n) for b in (1, 2) for n in ("ar", "ar+gguf", "gguf-ngram")}
    assert all(r["mismatched_requests"] == 0 for r in summary["results"])
    for b in (1, 2):
        assert by[(b, "ar+gguf")]["mean_accepted_length"] is None
        same = by[(b, "gguf-ngram")]["tokens_per_s"] / by[(b, "ar+gguf")]["tokens_per_s"]
        assert by[(b, "gguf-ngram")]["speedup_vs_ar_same_runtime"] == pytest.approx(same)


def test_no_ar_bench_counts_against_ar_on_the_blocks(smol, smollm2_gguf, tmp_path):
    """`bench --no-ar` skips our float32 AR, plain and batched: the block recipe is then set against AR on the
    blocks, whose outputs become the reference; a float32 recipe has no baseline left and is refused up front."""
    from specpilot.core import bench
    from specpilot.core.batchbench import run_batched

    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": str(i), "prompt": p, "chat": True, "max_new_tokens": 8}) + "\n"
                                for i, p in enumerate(PROMPTS)))
    deployment = Deployment(smollm2_gguf, None, str(workload))
    recipe = RECIPES["gguf-ngram"].replace(name="gguf-ngram")
    plain = bench.run(deployment, [recipe], repeats=1, hf=False, progress=False, engine=smol[0], our_ar=False)
    assert [r["name"] for r in plain["results"]] == ["ar+gguf", "gguf-ngram"] and plain["reference"] == "ar+gguf"
    assert all(r["mismatched_requests"] == 0 for r in plain["results"])
    batched = run_batched(deployment, [recipe], [2], repeats=1, progress=False, engine=smol[0], our_ar=False)
    assert {r["name"]: r["batch_size"] for r in batched["results"]} == {"ar+gguf": 2, "gguf-ngram": 2}
    assert batched["baseline"] == "ar+gguf" and "vs ar+gguf" in bench.table(batched)
    assert batched["results"][0]["speedup_vs_ar"] == 1.0
    assert all(r["mismatched_requests"] == 0 for r in batched["results"])  # against ar+gguf at batch 1
    native = RECIPES["ngram"].replace(name="ngram")
    with pytest.raises(ValueError, match="nothing to count mismatches against"):
        bench.run(deployment, [native], hf=False, engine=smol[0], our_ar=False)
    with pytest.raises(ValueError, match="recipe ngram runs on float32 weights"):
        run_batched(deployment, [native], [1], engine=smol[0], our_ar=False)


def test_recipes_best_from_the_store(tmp_path, capsys):
    from specpilot.core.recipe_source import best_recipe
    from specpilot.core.store import Store

    d = mini_deployment.build(tmp_path, requests=2, max_new_tokens=4)
    deployment = Deployment(target=d["target"], drafter=d["drafter"], workload=d["workload"])
    db = tmp_path / "store.db"
    with pytest.raises(FileNotFoundError, match="no store at"):
        best_recipe(deployment, str(db))
    store = Store(db)
    with pytest.raises(FileNotFoundError, match="holds no finished round for this deployment"):
        best_recipe(deployment, str(db))
    other = Deployment(target=d["target"], drafter=None, workload=d["workload"])
    for dep, depth in ((deployment, 5), (deployment, 7), (other, 3)):
        run = store.create_run(dep.to_dict(), {})
        rnd = store.start_round(run, 1, {})
        recipe = Recipe.from_dict({"tree": {"policy": "chain", "depth": depth}})
        store.finish_round(rnd, {"recipe": recipe.to_toml(), "heldout_speedup_vs_ar": 1.0})
    unfinished = store.create_run(deployment.to_dict(), {})
    store.start_round(unfinished, 1, {})
    best = best_recipe(deployment, str(db))
    assert best.name == "best" and best.tree.depth == 7  # the newest finished one of this deployment
    assert best_recipe(other, str(db)).tree.depth == 3


PLUGIN = """from specpilot.core.mechanisms import register


def length(depth, recent):
    return min(depth, (recent[-1] if recent else depth) + 1)


register("draft_length", "{name}", length)
"""


def test_recipes_best_loads_the_incumbents_plugins_from_its_workspace(tmp_path, capsys):
    """The loop's winners are often agent-written plugins (an adaptive draft length): `--recipes best` imports
    them from the run's workspace, as the judge's workers did, and runs the recipe losslessly; a workspace
    that is gone is one line, not an unknown-mechanism error."""
    from specpilot.core.store import Store

    d = mini_deployment.build(tmp_path, requests=2, max_new_tokens=6)
    deployment = Deployment(target=d["target"], drafter=d["drafter"], workload=d["workload"])
    db, name = tmp_path / "store.db", "best_len_a1"
    ws = tmp_path / "ws"
    (ws / "plugins").mkdir(parents=True)
    (ws / "plugins" / f"{name}.py").write_text(PLUGIN.format(name=name))
    store = Store(db)
    run = store.create_run(deployment.to_dict(), {})
    recipe = Recipe.from_dict({"draft": {"length": f"plugin:{name}"}, "tree": {"policy": "chain", "depth": 3}})
    store.finish_round(store.start_round(run, 1, {}), {"recipe": recipe.to_toml(), "heldout_speedup_vs_ar": 1.2,
                                                       "workspace": str(ws)})
    cmd = [sys.executable, "-m", "specpilot.core.cli", "bench", "--target", d["target"], "--drafter", d["drafter"],
           "--workload", d["workload"], "--repeats", "1", "--no-hf", "--recipes", "best", "--db", str(db),
           "--quiet", "--json", "--dtype", "float32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"loaded run {run}'s plugins ({name})" in out.stderr
    results = {r["name"]: r for r in json.loads(out.stdout)["results"]}
    assert results["best"]["mismatched_requests"] == 0 and results["best"]["mean_accepted_length"] > 0
    (ws / "plugins" / f"{name}.py").unlink()
    emptied = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    err = emptied.stderr.strip().splitlines()
    assert emptied.returncode != 0 and len(err) == 1 and "no longer holds its plugins" in err[0], emptied.stderr
    shutil.rmtree(ws)
    gone = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    err = gone.stderr.strip().splitlines()
    assert gone.returncode != 0 and len(err) == 1 and "no longer exists" in err[0], gone.stderr[-2000:]


def test_a_backend_that_would_not_fit_is_refused_before_it_loads(monkeypatch, tmp_path):
    from specpilot.core.engine import ram_budget

    d = mini_deployment.build(tmp_path, requests=1, max_new_tokens=4)
    engine = Engine.load(d["target"], d["drafter"])
    monkeypatch.setattr(ram_budget, "available_bytes", lambda: 1 << 20)
    fused = builtin("stock").replace(runtime={"linear": "fused"})
    with pytest.raises(ModelLoadError, match=r"needs .* GB of private memory and only 0.0 GB is available"):
        engine.generate([[1, 2, 3]], 2, fused)
    assert engine._models == {}
    monkeypatch.setattr(ram_budget, "available_bytes", lambda: 64 << 30)
    assert engine.generate([[1, 2, 3]], 2, fused).tokens[0] == engine.generate([[1, 2, 3]], 2, speculative=False).tokens[0]


def test_gguf_format_reads_the_blocks_and_refuses_other_checkpoints(smol, tmp_path):
    engine, prompts, _ = smol
    target, _ = engine.models_for(GGUF_AR)
    assert target.weight_format == "gguf" and type(target.lm_head).__name__ == "GGUFMatrix"
    from specpilot.core.costmodel.profile import weight_bytes

    assert weight_bytes(target) < weight_bytes(engine.target) / 4  # Q4_1 blocks vs float32
    d = mini_deployment.build(tmp_path, requests=1, max_new_tokens=4)
    plain = Engine.load(d["target"])
    with pytest.raises(ModelLoadError, match="needs a GGUF checkpoint"):
        plain.generate([[1, 2, 3]], 2, GGUF_AR, speculative=False)
    from specpilot.core.recipe import RecipeError

    with pytest.raises(RecipeError, match="runs its own block kernel"):
        Recipe.from_dict({"weights": {"format": "gguf"}, "runtime": {"linear": "fused"}})


def test_smollm2_greedy_identity_with_the_bf16x3_arithmetic(smol, monkeypatch):
    """Every block product of the gguf format computed by the exact bf16x3 arithmetic a matrix-unit path
    runs (kernels/reference/bf16x3.py, the plain-PyTorch oracle: three bf16 pieces of each activation, float32 sums,
    the sub-block scales after): transformers' float32 greedy output still, decoding and verifying."""
    from specpilot.kernels.cpu import gguf_blocks
    from specpilot.kernels.reference import bf16x3

    calls = []

    def oracle(self, x, threads=None):
        calls.append(x.reshape(-1, self.k).shape[0])
        if "_oracle" not in self.__dict__:
            self._oracle = bf16x3.Bf16x3Matrix(self.raw, self.qtype, self.n, self.k)
        return self._oracle(x).view(*x.shape[:-1], self.n)

    monkeypatch.setattr(gguf_blocks.GGUFMatrix, "__call__", oracle)
    engine, prompts, greedy = smol
    eos = engine.target.cfg.eos_token_ids[0]
    chain = Recipe.from_dict({"draft": {"method": "early_exit", "exit_layer": 15},
                              "tree": {"policy": "chain", "depth": 4}, "weights": {"format": "gguf"}})
    p, ref = prompts[0], greedy[0]
    ar = engine.generate([p], NEW_TOKENS, GGUF_AR, speculative=False)
    spec = engine.generate([p], NEW_TOKENS, chain)
    assert _until_eos(ar.tokens[0], eos) == _until_eos(ref, eos)
    assert _until_eos(spec.tokens[0], eos) == _until_eos(ref, eos)
    assert any(a > 0 for s in spec.steps for a in s.accepted)
    assert {1, 5} <= set(calls)  # decode and a 5-row verify went through it
    assert max(calls) >= len(p) - 1  # and the prompt (all but its last token, which the first step decodes)
