"""`specpilot serve` as a real process on loopback, driven by the official openai client.

The demo pair serves completions (its tokenizer has no chat template); SmolLM2 on its own GGUF blocks, drafting
for itself from a q4 copy, serves chat. Greedy outputs are compared with transformers' float32 generate.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import signal
import time

import openai
import pytest
from transformers import AutoConfig, AutoTokenizer

from specpilot.core.deployment import DEMO_DRAFTER, DEMO_TARGET
from serve_helpers import Server, hf_greedy

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

PROMPTS = ["def add(a, b):", "class Stack:\n    def push(self, x):", "import os\n\ndef list_files(path):",
           "# sort a list\ndef sort(xs):", "for i in range(10):", "def fib(n):\n    if n < 2:",
           "with open(path) as f:", "def main():\n    args ="]
LENGTHS = [40, 7, 25, 60, 13, 33, 50, 19]


@pytest.fixture(scope="module")
def demo():
    with Server("--target", str(DEMO_TARGET), "--drafter", str(DEMO_DRAFTER), "--recipe", "stock",
                "--max-batch", "4", "--max-queue", "8", "--served-model-name", "demo") as server:
        yield server


@pytest.fixture(scope="module")
def demo_reference():
    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    ids = [tok.encode(p) for p in PROMPTS]
    return tok, [tok.decode(t, skip_special_tokens=True) for t in hf_greedy(DEMO_TARGET, ids, LENGTHS)]


def test_completion_plain_and_streamed_equal_transformers(demo, demo_reference):
    tok, ref = demo_reference
    c = demo.client()
    r = c.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=LENGTHS[0], temperature=0)
    assert r.choices[0].text == ref[0]
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[0]))
    assert r.choices[0].finish_reason in ("stop", "length")
    assert (r.usage.completion_tokens == LENGTHS[0]) == (r.choices[0].finish_reason == "length")
    stream = c.completions.create(model="demo", prompt=PROMPTS[3], max_tokens=LENGTHS[3], temperature=0,
                                  stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == ref[3]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) > 1  # it streamed, not one block


def test_eight_concurrent_clients_each_equal_transformers(demo, demo_reference):
    _, ref = demo_reference
    c = demo.client()

    def one(i: int) -> str:
        if i % 2:
            s = c.completions.create(model="demo", prompt=PROMPTS[i], max_tokens=LENGTHS[i], temperature=0,
                                     stream=True)
            return "".join(ch.choices[0].text for ch in s if ch.choices)
        return c.completions.create(model="demo", prompt=PROMPTS[i], max_tokens=LENGTHS[i], temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    assert got == ref
    m = demo.metrics()
    assert m[("specpilot_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 8
    assert m[("specpilot_accepted_tokens_per_step_count", ())] > 0


def test_stop_strings_and_token_prompts(demo, demo_reference):
    tok, ref = demo_reference
    c = demo.client()
    stop = next(w for w in ref[6].split() if len(w) >= 3 and ref[6].index(w) > 2)[:3]
    r = c.completions.create(model="demo", prompt=PROMPTS[6], max_tokens=LENGTHS[6], temperature=0, stop=[stop])
    assert r.choices[0].text == ref[6][: ref[6].index(stop)] and r.choices[0].finish_reason == "stop"
    ids = tok.encode(PROMPTS[2])
    r = c.completions.create(model="demo", prompt=ids, max_tokens=LENGTHS[2], temperature=0)
    assert r.choices[0].text == ref[2]


def test_seeded_sampling_is_reproducible_and_differs_by_seed(demo):
    c = demo.client()

    def sample(seed: int) -> str:
        return c.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=30, temperature=1.0, seed=seed).choices[0].text

    a, b = sample(7), sample(7)
    others = {sample(s) for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1


def test_seeded_request_equals_the_targets_own_seeded_sampling(demo):
    """A sampled request beside greedy ones emits exactly the target's seeded AR sample (lossless)."""
    from specpilot.core.engine import Engine
    from specpilot.core.engine.decode import Verification
    from specpilot.core.engine.scheduler import generate

    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    c = demo.client()
    with cf.ThreadPoolExecutor(3) as pool:
        greedy = [pool.submit(c.completions.create, model="demo", prompt=PROMPTS[i], max_tokens=40, temperature=0)
                  for i in (4, 5)]
        sampled = c.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=30, temperature=0.8, top_p=0.9,
                                       seed=11).choices[0].text
        [g.result() for g in greedy]
    engine = Engine.load(DEMO_TARGET)
    ids = tok.encode(PROMPTS[1])
    ar = generate(engine.target, None, [ids], 30, None, Verification("seeded", 0.8, 0.9, 11), [0]).tokens[0]
    assert sampled == tok.decode(ar, skip_special_tokens=True)


BAD = [
    ("malformed JSON", b"{not json", 400),
    ("missing prompt", {"model": "demo", "max_tokens": 5}, 400),
    ("unknown model", {"model": "gpt-9", "prompt": "x", "max_tokens": 5}, 400),
    ("max_tokens 0", {"model": "demo", "prompt": "x", "max_tokens": 0}, 400),
    ("beyond the context", {"model": "demo", "prompt": "x", "max_tokens": 100000}, 400),
    ("n > 1", {"model": "demo", "prompt": "x", "max_tokens": 5, "n": 2}, 400),
    ("logprobs", {"model": "demo", "prompt": "x", "max_tokens": 5, "logprobs": 2}, 400),
    ("token out of vocabulary", {"model": "demo", "prompt": [1, 2, 10 ** 7], "max_tokens": 5}, 400),
]


def test_sixteen_streams_a_third_of_them_abandoned(demo_reference):
    """16 streaming clients at once, every third one closing its stream after a few chunks: every other request
    gets exactly the text it gets alone (transformers' greedy text), every request is accounted for as finished
    or aborted, and no row, queue slot or KV reservation is left held, nor the KV pages the requests wrote
    (measured: the caches' resident bytes, read from the kernel)."""
    import random

    tok, ref = demo_reference
    rng = random.Random(7)
    leave_after = {i: rng.randint(1, 3) for i in range(16) if i % 3 == 0}
    with Server("--target", str(DEMO_TARGET), "--drafter", str(DEMO_DRAFTER), "--recipe", "stock",
                "--max-batch", "8", "--max-queue", "16", "--served-model-name", "demo") as server:

        def one(i: int) -> str | None:
            stream = server.client().completions.create(model="demo", prompt=PROMPTS[i % 8], stream=True,
                                                        max_tokens=LENGTHS[i % 8] if i not in leave_after else 200,
                                                        temperature=0)
            text = []
            for n, chunk in enumerate(stream):
                text.append(chunk.choices[0].text)
                if n + 1 == leave_after.get(i):
                    stream.close()  # the client goes away mid-stream
                    return None
            return "".join(text)

        with cf.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(one, range(16)))
        for i, text in enumerate(got):
            assert (text is None) == (i in leave_after)
            if text is not None:
                assert text == ref[i % 8], i
        deadline = time.monotonic() + 30
        while True:
            m = server.metrics()
            finished = sum(v for (name, _), v in m.items() if name == "specpilot_finished_requests_total")
            if finished == 16 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert finished == 16, m
        assert m[("specpilot_finished_requests_total", (("reason", "abort"),))] >= 1
        assert m[("specpilot_requests_in_flight", ())] == 0 and m[("specpilot_queue_depth", ())] == 0
        assert m[("specpilot_kv_cache_reserved_bytes", ())] == 0
        # what stays is at most the page at each row's edge in each (layer, kv head, keys or values) slab, which
        # no row owns alone; a request's own pages would add several per slab
        slabs = sum(2 * c.num_hidden_layers * c.num_key_value_heads for c in map(AutoConfig.from_pretrained,
                                                                                   (DEMO_TARGET, DEMO_DRAFTER)))
        assert 0 <= m[("specpilot_kv_cache_resident_bytes", ())] <= slabs * 8 * mmap.PAGESIZE
        r = server.client().completions.create(model="demo", prompt=PROMPTS[0], max_tokens=LENGTHS[0], temperature=0)
        assert r.choices[0].text == ref[0]


def test_sigterm_with_sixteen_in_flight_and_sixteen_queued(demo_reference):
    """SIGTERM while 16 requests decode and 16 wait for a row: the 16 in flight finish whole, the 16 queued get
    503, and the process exits 0."""
    with Server("--target", str(DEMO_TARGET), "--drafter", str(DEMO_DRAFTER), "--recipe", "stock",
                "--max-batch", "16", "--max-queue", "16", "--grace", "120", "--served-model-name", "demo") as server:
        started = cf.ThreadPoolExecutor(32)

        def one(i: int) -> str | int:
            try:
                stream = server.client().completions.create(
                    model="demo", prompt=PROMPTS[i % 8], stream=True, max_tokens=400, temperature=0)
                chunks = list(stream)
            except openai.APIStatusError as exc:
                return exc.status_code
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            return "".join(c.choices[0].text for c in chunks)

        futures = [started.submit(one, i) for i in range(32)]
        deadline = time.monotonic() + 60
        while True:
            m = server.metrics()
            if m[("specpilot_requests_in_flight", ())] == 16 and m[("specpilot_queue_depth", ())] == 16:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        assert server.stop(signal.SIGTERM, timeout=120) == 0
        got = [f.result(timeout=120) for f in futures]
    finished = [g for g in got if isinstance(g, str)]
    assert len(finished) == 16 and all(finished), got
    assert sorted(g for g in got if not isinstance(g, str)) == [503] * 16


@pytest.mark.parametrize("what,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_bodies_get_openai_errors_and_the_server_serves_on(demo, what, body, status):
    code, answer = demo.post("/v1/completions", body)
    assert code == status
    assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    r = demo.client().completions.create(model="demo", prompt=PROMPTS[4], max_tokens=5, temperature=0)
    assert r.choices[0].text


def test_a_prompt_that_exactly_fits_is_served_and_one_token_more_gets_a_400_saying_what_fits(demo):
    context = demo.client().models.list().data[0].max_model_len
    m = 8
    fits = [5 + i % 50 for i in range(context - m)]
    r = demo.client().completions.create(model="demo", prompt=fits, max_tokens=m, temperature=0)
    assert r.usage.prompt_tokens == context - m and r.usage.completion_tokens >= 1
    code, answer = demo.post("/v1/completions", {"model": "demo", "prompt": fits + [7], "max_tokens": m})
    assert code == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert f"but {m - 1} fit" in answer["error"]["message"], answer["error"]["message"]


def test_bad_chat_bodies(demo):
    c = demo.client()
    for kwargs in ({"messages": []}, {"messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {}}}]}):
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="demo", **kwargs)
    code, answer = demo.post("/v1/chat/completions", {"model": "demo"})
    assert code == 400 and answer["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
    assert c.completions.create(model="demo", prompt="x", max_tokens=3, temperature=0).choices[0].text is not None


def test_models_health_and_metrics(demo):
    c = demo.client()
    models = c.models.list().data
    assert [m.id for m in models] == ["demo"]
    assert demo.get("/health") == (200, '{"status":"ok"}')
    m = demo.metrics()
    names = {n for n, _ in m}
    for name in ("specpilot_time_to_first_token_seconds_bucket", "specpilot_inter_token_latency_seconds_bucket",
                 "specpilot_queue_depth", "specpilot_requests_in_flight", "specpilot_prompt_tokens_total",
                 "specpilot_generation_tokens_total"):
        assert name in names, name
    assert m[("specpilot_requests_in_flight", ())] == 0


def test_api_key(tmp_path):
    with Server("--target", str(DEMO_TARGET), "--drafter", "none", "--recipe", "ar", "--api-key", "sekrit",
                "--served-model-name", "demo", "--max-batch", "1") as s:
        with pytest.raises(openai.AuthenticationError):
            s.client().completions.create(model="demo", prompt="x", max_tokens=2)
        r = s.client(api_key="sekrit").completions.create(model="demo", prompt="x", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens >= 1


# SmolLM2: chat through its template, a cancelled stream, queue overflow and the SIGTERM drain

CHATS = ["Write a Python function that reverses a string.", "What is a prime number?"]


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    with Server("--target", smollm2_gguf, "--drafter", smollm2_gguf, "--recipe", "stock-gguf-q4",
                "--max-batch", "1", "--max-queue", "1", "--served-model-name", "smol", "--grace", "60") as server:
        yield server


def test_chat_plain_and_streamed_equal_transformers(smol, smollm2_dir):
    from specpilot.core.workload import Request, encode

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = [encode(tok, Request(str(i), p, 24, chat=True)) for i, p in enumerate(CHATS)]
    ref = [tok.decode(t, skip_special_tokens=True) for t in hf_greedy(smollm2_dir, ids, [24, 24])]
    c = smol.client()
    r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": CHATS[0]}], max_tokens=24,
                                  temperature=0)
    assert r.choices[0].message.content == ref[0] and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids[0])
    s = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": CHATS[1]}], max_tokens=24,
                                  temperature=0, stream=True)
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref[1]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def _long_stream(client, tokens: int = 400):
    return client.chat.completions.create(model="smol", max_tokens=tokens, temperature=0, stream=True,
                                          messages=[{"role": "user", "content": "Count from 1 to 500, one per line."}])


def test_cancelled_stream_frees_its_row(smol):
    before = smol.metrics()
    c = smol.client()
    stream = _long_stream(c)
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()  # the client goes away mid-stream
    # the only row (--max-batch 1) must be free again long before 400 tokens could have been generated
    r = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                  temperature=0)
    assert r.usage.completion_tokens >= 1
    after = smol.metrics()
    aborted = ("specpilot_finished_requests_total", (("reason", "abort"),))
    assert after[aborted] - before.get(aborted, 0) == 1
    made = after[("specpilot_generation_tokens_total", ())] - before[("specpilot_generation_tokens_total", ())]
    assert made < 400


def test_queue_overflow_gets_429(smol):
    c = smol.client()
    running = iter(_long_stream(c))
    next(running)  # holds the only row
    waiting = cf.ThreadPoolExecutor(1).submit(lambda: c.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0))
    time.sleep(0.5)  # the second request is queued (--max-queue 1)
    with pytest.raises(openai.RateLimitError) as info:
        c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert info.value.response.headers.get("retry-after") == "1"
    for _ in running:
        pass
    assert waiting.result(timeout=120).choices[0].message.content is not None


def test_sigterm_drains_requests_in_flight(smol):
    """Last on this server: SIGTERM turns new requests away with 503 while the one in flight finishes."""
    c = smol.client()
    stream = iter(_long_stream(c, 60))
    got = [next(stream)]
    smol.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    code, answer = smol.post("/v1/chat/completions", {"model": "smol", "messages": [{"role": "user", "content": "x"}]})
    assert code == 503 and "shutting down" in answer["error"]["message"]
    got += list(stream)
    assert got[-1].choices[0].finish_reason == "length"
    assert smol.proc.wait(60) == 0
