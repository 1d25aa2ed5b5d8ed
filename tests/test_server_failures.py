"""Failure isolation in the server, in-process so a failure can be injected into the engine: the request
that fails gets HTTP 500 alone, while the requests beside it stream on to their exact outputs."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import openai
import pytest
import uvicorn
from transformers import AutoTokenizer

from specpilot.core.deployment import DEMO_DRAFTER, DEMO_TARGET
from specpilot.core.engine import Engine
from specpilot.core.engine.decode import Verification
from specpilot.core.recipe import builtin
from specpilot.core.server.app import ServerState, build_app
from specpilot.core.server.engine_loop import EngineLoop
from specpilot.core.server.metrics import Metrics
from serve_helpers import free_port

POISON = "def explode():"


@pytest.fixture(scope="module")
def served():
    engine = Engine.load(DEMO_TARGET, DEMO_DRAFTER)
    tok = AutoTokenizer.from_pretrained(str(DEMO_TARGET))
    sched = engine.scheduler(builtin("stock"), 4, 256)
    target = sched.target
    poison = tok.encode(POISON)[:-1]
    real = target.extend_row

    def prefill(cache, row, tokens):
        if list(tokens) == poison:
            raise RuntimeError("injected failure")
        return real(cache, row, tokens)

    target.extend_row = prefill
    loop = EngineLoop(sched, Metrics(), 8)
    state = ServerState(loop, tok, ("demo",), 256, Verification("greedy"), set(target.cfg.eos_token_ids),
                        target.cfg.vocab_size, loop.metrics)
    loop.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="error",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    yield engine, tok, client, state
    server.should_exit = True
    thread.join(10)
    loop.stop()
    target.extend_row = real


def test_a_request_failing_in_the_engine_gets_500_alone(served):
    engine, tok, client, state = served
    prompts = ["def add(a, b):", "for i in range(10):"]
    ref = [tok.decode(engine.generate([tok.encode(p)], 40, speculative=False).tokens[0], skip_special_tokens=True)
           for p in prompts]

    def streamed(p: str) -> str:
        s = client.completions.create(model="demo", prompt=p, max_tokens=40, temperature=0, stream=True)
        return "".join(ch.choices[0].text for ch in s if ch.choices)

    with cf.ThreadPoolExecutor(3) as pool:
        good = [pool.submit(streamed, p) for p in prompts]
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError, match="injected failure"):
                client.completions.create(model="demo", prompt=POISON, max_tokens=40, temperature=0, stream=stream)
        assert [g.result(60) for g in good] == ref
    assert state.engine.failure is None and state.engine.outstanding == 0
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(state.metrics.render().decode()) for s in f.samples}
    assert samples[("specpilot_requests_total", (("endpoint", "/v1/completions"), ("status", "500")))] == 2
    assert samples[("specpilot_finished_requests_total", (("reason", "error"),))] == 2
    assert client.completions.create(model="demo", prompt=prompts[0], max_tokens=40, temperature=0).choices[0].text == ref[0]
