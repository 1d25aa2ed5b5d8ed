"""`specpilot export`: a stored incumbent as the nearest configuration vLLM, SGLang, llama.cpp and transformers
express, with one line per mechanism each gives up; the transformers export checked through `generate`."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specpilot.core.cli import main
from specpilot.core.recipe_source import run_incumbent
from specpilot.core.deployment import DEMO_DRAFTER, DEMO_TARGET, Deployment
from specpilot.core.engine import Engine
from specpilot.core.recipe import Recipe, RecipeError
from specpilot.core.store import Store


def stored(tmp_path, *incumbents: dict, deployment: Deployment | None = None) -> tuple[str, int]:
    """A store whose one run finished a round per incumbent (recipe dict + measurements)."""
    db = str(tmp_path / "store.db")
    store = Store(db)
    run = store.create_run((deployment or Deployment()).to_dict(), {})
    for i, inc in enumerate(incumbents, 1):
        recipe = Recipe.from_dict(inc["recipe"])
        store.finish_round(store.start_round(run, i, {}), {**inc, "recipe": recipe.to_toml(), "round": i})
    return db, run


def export_json(capsys, db: str, run: int | str, engine: str, *extra: str) -> dict:
    assert main(["export", str(run), "--to", engine, "--json", "--db", db, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_engine_gets_its_flags_and_the_cost_of_what_it_drops(tmp_path, capsys):
    db, run = stored(tmp_path,
                     {"recipe": {"tree": {"policy": "dynamic", "depth": 6, "budget": 12}}, "heldout_speedup_vs_ar": 1.3,
                      "heldout_speedup_vs_stock": 1.1},
                     {"recipe": {"batching": {"policy": "budget"}}, "heldout_speedup_vs_ar": 1.5,
                      "heldout_speedup_vs_stock": 1.25})
    vllm = export_json(capsys, db, run, "vllm")
    assert vllm["argv"][:3] == ["vllm", "serve", str(DEMO_TARGET)]
    spec = json.loads(vllm["argv"][vllm["argv"].index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": str(DEMO_DRAFTER), "num_speculative_tokens": 4}
    # the final incumbent (budget batching on stock's chain) reduces to stock, which every round measured
    assert len(vllm["dropped"]) == 1 and "batching policy 'budget'" in vllm["dropped"][0]
    assert "0.80x the found recipe's held-out speed (stock, measured)" in vllm["dropped"][0]
    sglang = export_json(capsys, db, run, "sglang")["argv"]
    assert sglang[sglang.index("--speculative-algorithm") + 1] == "STANDALONE"
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == str(DEMO_DRAFTER)
    assert sglang[sglang.index("--speculative-num-steps") + 1] == "4"
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "5"
    llama = export_json(capsys, db, run, "llama.cpp")
    argv = llama["argv"]
    assert argv[0] == "llama-server" and argv[argv.index("-md") + 1] == str(DEMO_DRAFTER)
    assert argv[argv.index("--spec-draft-n-max") + 1] == "4" and argv[argv.index("--draft-p-min") + 1] == "0.0"
    assert any("convert_hf_to_gguf" in n for n in llama["notes"])  # the demo pair is not GGUF
    hf = export_json(capsys, db, run, "transformers")["kwargs"]
    assert hf == {"assistant_model": str(DEMO_DRAFTER), "num_assistant_tokens": 4,
                  "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0,
                  "do_sample": False}
    assert main(["export", str(run), "--to", "vllm", "--db", db]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# vLLM 0.11+\nvllm serve ") and "# not expressible: batching policy" in text


def test_a_dropped_mechanism_without_a_measurement_says_how_to_measure_it(tmp_path, capsys):
    db, run = stored(tmp_path, {"recipe": {"draft": {"method": "ngram", "ngram_max": 2},
                                           "tree": {"policy": "dynamic", "depth": 7}}, "heldout_speedup_vs_ar": 2.0})
    out = export_json(capsys, db, run, "vllm", "--nearest", str(tmp_path / "near.toml"))
    spec = json.loads(out["argv"][-1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    assert out["dropped"] == ["the dynamic tree (a chain of 7 instead): the nearest expressible recipe runs at not "
                              "measured in this run; measure it with `specpilot bench --recipes best,NEAREST.toml` "
                              "(write NEAREST.toml with --nearest)"]
    near = Recipe.load(str(tmp_path / "near.toml"))
    assert near.tree.policy == "chain" and near.tree.depth == 7 and near.draft.method == "ngram"
    hf = export_json(capsys, db, run, "transformers")["kwargs"]
    assert hf == {"prompt_lookup_num_tokens": 7, "max_matching_ngram_size": 2, "do_sample": False}


@pytest.mark.parametrize("recipe", [{}, {"draft": {"method": "ngram", "ngram_max": 3}, "tree": {"depth": 6}}],
                         ids=["draft-model", "prompt-lookup"])
def test_the_transformers_export_through_generate_gives_the_recipes_greedy_output(tmp_path, capsys, recipe):
    db, run = stored(tmp_path, {"recipe": recipe, "heldout_speedup_vs_ar": 1.0})
    kwargs = export_json(capsys, db, run, "transformers")["kwargs"]
    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    model = AutoModelForCausalLM.from_pretrained(str(DEMO_TARGET), dtype=torch.float32)
    if "assistant_model" in kwargs:
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(kwargs["assistant_model"], dtype=torch.float32)
    engine = Engine.load(DEMO_TARGET, DEMO_DRAFTER)
    ours = Recipe.from_dict(recipe)
    for prompt in ("def add(a, b):", "class Stack:\n    def push(self, x):"):
        ids = tok.encode(prompt)
        with torch.inference_mode():
            theirs = model.generate(torch.tensor([ids]), max_new_tokens=30, pad_token_id=tok.eos_token_id or 0,
                                    tokenizer=tok, **kwargs)[0, len(ids):].tolist()
        assert theirs == engine.generate([ids], 30, ours).tokens[0][: len(theirs)]
        assert len(theirs) == 30 or theirs[-1] in engine.target.cfg.eos_token_ids


def test_a_run_of_another_deployment_is_refused_in_one_line(tmp_path, capsys):
    other = Deployment(drafter=None)
    db, run = stored(tmp_path, {"recipe": {}, "heldout_speedup_vs_ar": 1.0}, deployment=other)
    with pytest.raises(RecipeError, match=f"run {run} tuned another deployment"):
        run_incumbent(run, Deployment(), db)
    assert main(["serve", "--recipe", str(run), "--db", db, "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tuned another deployment" in err
    assert main(["export", "7", "--to", "vllm", "--db", db]) == 2
    assert "run 7 is not in" in capsys.readouterr().err


def test_llama_cpp_flags_are_the_built_servers_own(tmp_path, capsys):
    """Every flag the llama.cpp export uses is one `llama-server -h` lists (where a built llama-server is
    found: $LLAMA_SERVER or on PATH), for the draft-model and the n-gram modes."""
    import os
    import shutil
    import subprocess

    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary:
        pytest.skip("no llama-server built here (set LLAMA_SERVER=PATH); its flags are checked where it is")
    help_text = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=60).stdout
    for recipe in ({}, {"draft": {"method": "ngram"}}):
        (tmp_path / str(len(recipe))).mkdir()
        db, run = stored(tmp_path / str(len(recipe)), {"recipe": recipe, "heldout_speedup_vs_ar": 1.0})
        argv = export_json(capsys, db, run, "llama.cpp")["argv"]
        for flag in (a for a in argv[1:] if a.startswith("-")):
            assert f"{flag}," in help_text or f"{flag} " in help_text, flag
