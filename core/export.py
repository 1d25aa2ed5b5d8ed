"""A found recipe as the nearest configuration other engines can express, and what each one gives up.

Every engine here speculates with a draft model or prompt n-grams in a chain of a fixed length; none of them
verifies on a GGUF file's exact blocks, drafts on a q4 copy, grows a dynamic tree, sets draft lengths per
step, or runs a SpecPilot plugin. So the export first reduces the recipe to that common part (the nearest
expressible recipe), prints the engine's flags for it, and gives one line per mechanism dropped, with what
the run measured for the nearest recipe against the found one where the store holds that measurement.

Flags target vLLM 0.11 (`--speculative-config`), SGLang 0.5 (`--speculative-*`), llama.cpp's llama-server at
commit 0c1e570 (`-md`, `--spec-draft-n-max`, `--spec-draft-n-min`, `--draft-p-min`, `--spec-type ngram-simple`;
builds before the `--spec-*` rename spell the first two `--draft-max`, `--draft-min`) and transformers 5
(`generate` kwargs).

The printed configuration states the deployment's numerics. None of these engines reproduces q8 as we run it:
vLLM and SGLang serve bf16/f16, transformers floats, and llama.cpp's own q8-like arithmetic is not
batch-invariant; each says so in one "not expressible" line.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from specpilot.core.engine.numerics import NUMERICS, check
from specpilot.core.recipe import Recipe, changed_fields, stock

ENGINES = ("vllm", "sglang", "llama.cpp", "transformers")
# what each engine does under numerics other than f32: one "not expressible" line
NUMERICS_GIVEN_UP = {
    "q8": {
        "vllm": "numerics q8: vLLM serves bf16/f16 (a GGUF dequantised), not q8's 8-bit activations and integer "
                "products, so its output is not our q8 plain decoding",
        "sglang": "numerics q8: SGLang serves bf16/f16 (a GGUF dequantised), not q8's 8-bit activations and "
                  "integer products, so its output is not our q8 plain decoding",
        "llama.cpp": "bit-identical speculation under numerics q8: llama.cpp's own arithmetic is q8-like (8-bit "
                     "activations) but not batch-invariant, so its speculative output is not guaranteed identical "
                     "to its plain decoding",
        "transformers": "numerics q8: transformers computes in float on the dequantised GGUF, not q8's 8-bit "
                        "activations and integer products, so its output is not our q8 plain decoding",
    },
}
VERSIONS = {"vllm": "vLLM 0.11+", "sglang": "SGLang 0.5+", "llama.cpp": "llama.cpp llama-server, commit 0c1e570",
            "transformers": "transformers 5.x"}


@dataclass
class Export:
    """One engine's configuration for a recipe: its flags (argv) or kwargs, and what it cannot express."""

    engine: str
    version: str
    nearest: Recipe
    argv: list[str] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    numerics: str = "f32"

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "version": self.version, "numerics": self.numerics, "argv": self.argv,
                "kwargs": self.kwargs, "dropped": self.dropped, "notes": self.notes,
                "nearest_recipe": self.nearest.to_dict()}

    def text(self) -> str:
        lines = [f"# {self.version}"]
        if self.argv:
            lines.append(shlex.join(self.argv))
        if self.kwargs:
            shown = {k: (f"AutoModelForCausalLM.from_pretrained({v!r})" if k == "assistant_model" else repr(v))
                     for k, v in self.kwargs.items()}
            lines.append("model.generate(**inputs, " + ", ".join(f"{k}={v}" for k, v in shown.items()) + ")")
        lines.append(f"# deployment numerics: {self.numerics} ({NUMERICS[self.numerics]})")
        lines += [f"# not expressible: {d}" for d in self.dropped] + [f"# note: {n}" for n in self.notes]
        return "\n".join(lines)


def nearest(recipe: Recipe, has_drafter: bool) -> tuple[Recipe, list[str]]:
    """The recipe reduced to what every engine here expresses, and one phrase per mechanism dropped."""
    data = recipe.to_dict()
    dropped: list[str] = []
    d, t, w, r, b = data["draft"], data["tree"], data["weights"], data["runtime"], data["batching"]
    if d["method"] not in ("model", "ngram"):
        dropped.append(f"the drafter {d['method']!r} (replaced by {'the draft model' if has_drafter else 'n-grams'})")
        d["method"] = "model" if has_drafter else "ngram"
    if d["length"] != "fixed":
        dropped.append(f"draft length policy {d['length']!r} (a fixed draft length instead)")
        d["length"] = "fixed"
    if t["policy"] != "chain":
        depth = t["depth"] if t["policy"] == "dynamic" else max((len(p) for p in t["paths"]), default=t["depth"])
        dropped.append(f"the {t['policy']} tree (a chain of {depth} instead)")
        t.update(policy="chain", depth=depth, paths=[])
    if w["format"] != "native":
        dropped.append(f"exact verification on the weights' {w['format']!r} blocks (the engine's own kernels)")
        w["format"], w["drafter"] = "native", False
    if w["drafter_format"] != "same":
        dropped.append(f"the drafter's {w['drafter_format']!r} products")
        w["drafter_format"] = "same"
    if r["linear"] != "native":
        dropped.append(f"the {r['linear']!r} linear backend")
        r["linear"] = "native"
    if b["policy"] != "fixed":
        dropped.append(f"batching policy {b['policy']!r} (one draft length for every request)")
        b["policy"] = "fixed"
    if data["verify"]["sampling"] == "seeded":
        dropped.append("seeded verification (the engine's own sampler: same distribution, other samples)")
    data["name"] = f"{recipe.name}-nearest"
    return Recipe.from_dict(data), dropped


def _same(a: Recipe, b: Recipe) -> bool:
    return not changed_fields(a, b)


def measured_ratio(near: Recipe, history: list[dict], has_drafter: bool) -> str | None:
    """What the run measured for `near` against its final incumbent, from the rounds' stored incumbents:
    stock's held-out speed (every round stores the incumbent's speedup over stock), or an earlier incumbent
    equal to `near`. None when the run never measured it."""
    if not history:
        return None
    final = history[-1]
    if _same(near, stock(has_drafter)) and final.get("heldout_speedup_vs_stock"):
        return f"{1 / final['heldout_speedup_vs_stock']:.2f}x the found recipe's held-out speed (stock, measured)"
    for inc in history[:-1]:
        try:
            same = _same(near, Recipe.from_toml(inc["recipe"], source="store"))
        except Exception:  # an incumbent stored by another version: not comparable
            same = False
        if same and inc.get("heldout_speedup_vs_ar") and final.get("heldout_speedup_vs_ar"):
            return (f"{inc['heldout_speedup_vs_ar'] / final['heldout_speedup_vs_ar']:.2f}x the found recipe's "
                    f"held-out speed (round {inc.get('round', '?')}'s incumbent, measured)")
    return None


def export(recipe: Recipe, engine: str, target: str, drafter: str | None, history: list[dict] | None = None,
           target_gguf: str | None = None, drafter_gguf: str | None = None, numerics: str = "f32") -> Export:
    """`engine`'s configuration nearest to `recipe` on this deployment (checkpoint directories, and the GGUF
    files llama.cpp reads when the deployment came from them), stating the deployment's numerics and, when the
    engine cannot compute them, what that gives up."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; export to one of {', '.join(ENGINES)}")
    check(numerics)
    near, dropped = nearest(recipe, drafter is not None)
    if dropped:
        ratio = measured_ratio(near, history or [], drafter is not None)
        cost = ratio or ("not measured in this run; measure it with `specpilot bench --recipes best,NEAREST.toml`"
                         " (write NEAREST.toml with --nearest)")
        dropped = [f"{what}: the nearest expressible recipe runs at {cost}" for what in dropped]
    d, t = near.draft, near.tree
    ngram = d.method == "ngram"
    k = t.depth
    dropped += [NUMERICS_GIVEN_UP[numerics][engine]] if numerics in NUMERICS_GIVEN_UP else []
    out = Export(engine, VERSIONS[engine], near, dropped=dropped, numerics=numerics)
    if engine == "vllm":
        spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": d.ngram_max,
                 "prompt_lookup_min": 1} if ngram else
                {"method": "draft_model", "model": drafter, "num_speculative_tokens": k})
        out.argv = ["vllm", "serve", target, "--speculative-config", json.dumps(spec)]
    elif engine == "sglang":
        out.argv = ["python", "-m", "sglang.launch_server", "--model-path", target]
        if ngram:
            out.argv += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k + 1)]
        else:
            out.argv += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", drafter,
                         "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                         "--speculative-num-draft-tokens", str(k + 1)]
    elif engine == "llama.cpp":
        out.argv = ["llama-server", "-m", target_gguf or target]
        if ngram:
            out.argv += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(d.ngram_max),
                         "--spec-ngram-simple-size-m", str(k)]
        else:
            out.argv += ["-md", drafter_gguf or drafter, "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                         "--draft-p-min", "0.0"]
        if not target_gguf:
            out.notes.append("llama.cpp reads GGUF files: convert the checkpoints with convert_hf_to_gguf.py first")
    else:
        out.kwargs = ({"prompt_lookup_num_tokens": k, "max_matching_ngram_size": d.ngram_max} if ngram else
                      {"assistant_model": drafter, "num_assistant_tokens": k,
                       "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0})
        if near.verify.sampling == "greedy":
            out.kwargs["do_sample"] = False
        else:
            out.kwargs.update(do_sample=True, temperature=near.verify.temperature, top_p=near.verify.top_p)
    if near.verify.sampling == "greedy" and engine != "transformers":
        out.notes.append("the recipe decodes greedily: send temperature 0 with each request")
    return out
