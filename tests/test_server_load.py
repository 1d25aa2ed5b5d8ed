"""`specpilot serve` under load, as a real process driven by the official openai client on loopback.

- A flood past the queue: every request is answered either 429 with Retry-After or in full with its reference
  text, and every request accepted is counted finished (none is lost).
- SmolLM2 in q8 with chunked prefill (16 tokens a step) and the prefix cache: chats that share their template
  and system prompt find its blocks, every text equals the engine's own q8 plain decoding, no step prefills
  more than its budget, the steps' time is reported by phase with the tokens the drafter was fed (and each
  step is logged at debug level), and once idle the caches hold nothing reserved and give their memory back
  (measured).
- A KV budget smaller than the context: the server says the context it can serve, a prompt of exactly that
  much is served and one token more gets a 400 saying how many fit; a budget that holds no request is a
  one-line error at start.
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys
import time

import openai
import pytest
from transformers import AutoTokenizer

from specpilot.core.deployment import DEMO_DRAFTER, DEMO_TARGET
from specpilot.core.engine.decode import PHASES
from serve_helpers import ROOT, Server, hf_greedy

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "import os\n\ndef list_files(path):",
           "# sort a list\ndef sort(xs):"]
LENGTHS = [40, 27, 25, 60]


@pytest.fixture(scope="module")
def demo_reference():
    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    ids = [tok.encode(p) for p in PROMPTS]
    return [tok.decode(t, skip_special_tokens=True) for t in hf_greedy(DEMO_TARGET, ids, LENGTHS)]


def _sample(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_flood_past_the_queue_gets_429_and_loses_no_accepted_request(demo_reference):
    with Server("--target", str(DEMO_TARGET), "--drafter", str(DEMO_DRAFTER), "--recipe", "stock",
                "--max-batch", "2", "--max-queue", "2", "--served-model-name", "demo") as server:

        def one(i: int) -> str | int:
            try:
                r = server.client().completions.create(model="demo", prompt=PROMPTS[i % 4], max_tokens=LENGTHS[i % 4],
                                                       temperature=0)
            except openai.RateLimitError as exc:
                assert exc.response.headers.get("retry-after") == "1"
                return 429
            return r.choices[0].text

        with cf.ThreadPoolExecutor(24) as pool:
            got = list(pool.map(one, range(24)))
        accepted = [i for i, g in enumerate(got) if g != 429]
        assert len(accepted) < 24, "the flood never went past the queue"
        assert len(accepted) >= 4  # two rows and two queue places
        for i in accepted:
            assert got[i] == demo_reference[i % 4], i
        m = server.metrics()
        finished = sum(v for (name, _), v in m.items() if name == "specpilot_finished_requests_total")
        assert finished == len(accepted)
        assert _sample(m, "specpilot_requests_total", endpoint="/v1/completions", status="429") == 24 - len(accepted)


SYSTEM = ("You are a careful Python reviewer on a team that ships a small web service. Answer in one short "
          "paragraph, name the standard library module that helps when there is one, prefer plain words to jargon, "
          "and show code only when asked for it.")
CHATS = ["What does a list comprehension do?", "Why use a context manager for files?", "What is a generator?"]


def test_q8_chunked_prefill_and_prefix_cache_serve_q8_plain_decoding(smollm2_gguf, smollm2_dir):
    from specpilot.core.engine import Engine

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    messages = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": c}] for c in CHATS]
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for m in messages]
    assert all(len(i) > 48 for i in ids)
    engine = Engine.load(smollm2_dir, numerics="q8")
    want = [tok.decode(engine.generate([i], 20, speculative=False).tokens[0], skip_special_tokens=True) for i in ids]
    del engine
    with Server("--target", smollm2_gguf, "--drafter", smollm2_gguf, "--numerics", "q8", "--recipe", "stock-gguf-q4",
                "--max-batch", "2", "--max-num-batched-tokens", "16", "--served-model-name", "smol",
                "--log-level", "debug") as server:
        c = server.client()
        got = [c.chat.completions.create(model="smol", messages=m, max_tokens=20, temperature=0).choices[0]
               .message.content for m in messages]
        with cf.ThreadPoolExecutor(3) as pool:  # and together, sharing steps
            together = list(pool.map(lambda m: c.chat.completions.create(
                model="smol", messages=m, max_tokens=20, temperature=0).choices[0].message.content, messages))
        deadline = time.monotonic() + 30  # the engine thread sets its gauges after it has sent a step's events
        while (m := server.metrics())[("specpilot_kv_cache_reserved_bytes", ())] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert got == want and together == want
    assert _sample(m, "specpilot_prefix_cache_hits_total") >= 5 * 16  # the template and system prompt, 5 times
    assert _sample(m, "specpilot_prefix_cache_queries_total") == 2 * sum(len(i) - 1 for i in ids)
    steps = _sample(m, "specpilot_step_prefill_tokens_count")
    assert steps > 0 and _sample(m, "specpilot_step_prefill_tokens_bucket", le="16.0") == steps
    # where the steps' time went, and what the drafter was fed: every prompt, once, before its row first drafted
    seconds = {p: _sample(m, "specpilot_step_seconds_total", phase=p) for p in PHASES}
    assert all(seconds[p] > 0 for p in ("prefill", "catch_up", "draft", "verify")), seconds
    assert _sample(m, "specpilot_drafter_catch_up_tokens_total") >= 2 * sum(len(i) - 1 for i in ids)
    rows, drafting = _sample(m, "specpilot_step_rows_sum"), _sample(m, "specpilot_step_drafting_rows_sum")
    assert _sample(m, "specpilot_step_rows_count") == steps and 0 < drafting <= rows <= 2 * steps
    assert server.log.count(b" step: ") == steps  # --log-level debug: one line a step
    assert _sample(m, "specpilot_kv_cache_reserved_bytes") == 0
    budget = _sample(m, "specpilot_kv_cache_budget_bytes")
    assert 0 <= _sample(m, "specpilot_kv_cache_resident_bytes") < 0.01 * budget


def test_a_kv_budget_below_the_context_sets_what_fits(demo_reference):
    with Server("--target", str(DEMO_TARGET), "--drafter", str(DEMO_DRAFTER), "--recipe", "stock",
                "--max-batch", "4", "--kv-cache-memory", "0.002", "--prefix-cache-memory", "0",
                "--served-model-name", "demo") as server:
        context = server.client().models.list().data[0].max_model_len
        assert 64 < context < 2048
        m = 8
        fits = [5 + i % 50 for i in range(context - m)]
        r = server.client().completions.create(model="demo", prompt=fits, max_tokens=m, temperature=0)
        assert r.usage.prompt_tokens == context - m and r.usage.completion_tokens >= 1
        code, answer = server.post("/v1/completions", {"model": "demo", "prompt": fits + [7], "max_tokens": m})
        assert code == 400 and f"but {m - 1} fit" in answer["error"]["message"], answer
        r = server.client().completions.create(model="demo", prompt=PROMPTS[0], max_tokens=LENGTHS[0], temperature=0)
        assert r.choices[0].text == demo_reference[0]
    run = subprocess.run([sys.executable, "-m", "specpilot.core.cli", "serve", "--target", str(DEMO_TARGET),
                          "--drafter", str(DEMO_DRAFTER), "--recipe", "stock", "--kv-cache-memory", "0.00001",
                          "--prefix-cache-memory", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert last.startswith("specpilot: error:") and "holds no request" in last and "raise it" in last
