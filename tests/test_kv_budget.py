"""A bounded KV budget: lazy caches that hold memory for the positions written, and admission that waits for room.

Measured, not assumed: the caches' private pages are the kernel's count (/proc/self/smaps). On the real SmolLM2
GGUF in q8, AR and speculative, a scheduler whose budget holds two requests' reservations never runs a third,
its caches never hold more than the budget, every request still gets q8 plain decoding's tokens, and rows give
their memory back when their requests leave. A request the budget can never hold is refused in one line that
says how many tokens fit.
"""

from __future__ import annotations

import pytest
import torch

from specpilot.core.engine import Engine
from specpilot.core.engine.decode import GenerationError
from specpilot.core.engine.model import KVCache
from specpilot.core.engine.scheduler import Scheduler
from specpilot.core.recipe import builtin

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)

MB = 1 << 20


def test_a_lazy_cache_holds_the_pages_written_and_gives_them_back():
    cache = KVCache(4, 8, 2, 4096, 64, torch.float32, "cpu", lazy=True)
    assert cache.resident_bytes() < MB
    assert float(cache.k[:, :, :, :2048].abs().sum()) == 0.0  # reading costs nothing and reads zeros
    assert cache.resident_bytes() < MB
    cache.k[:, 3, :, :1000] = 1.0
    cache.v[:, 3, :, :1000] = 2.0
    written = 2 * 4 * 2 * 1000 * 64 * 4
    assert written <= cache.resident_bytes() <= written + 2 * 4 * 2 * 4096
    cache.release_row(3)
    assert cache.resident_bytes() < MB and float(cache.k[:, 3].abs().sum()) == 0.0
    eager = KVCache(4, 8, 2, 256, 64, torch.float32, "cpu")
    assert eager.resident_bytes() == 2 * eager.k.numel() * 4


@pytest.fixture(scope="module")
def q8(smollm2_dir, one_thread):
    return Engine.load(smollm2_dir, smollm2_dir, numerics="q8")


@pytest.fixture(scope="module")
def work(q8):
    gen = torch.Generator().manual_seed(0)
    vocab = q8.target.cfg.vocab_size
    prompts = [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in (300, 250, 280, 310, 200, 260)]
    limits = [10, 14, 8, 12, 9, 11]
    reference = [q8.generate([p], n, speculative=False).tokens[0] for p, n in zip(prompts, limits)]
    return prompts, limits, reference


def _scheduler(engine, speculative: bool, **options) -> Scheduler:
    base = engine.scheduler(builtin("stock") if speculative else None, 8, 2048)
    return Scheduler(base.target, base.drafter, base.spec, base.policy, 8, 2048, base.ver, base.draft_length,
                     **options)


def _resident(sched: Scheduler) -> int:
    drafter = getattr(sched.drafter, "cache", None)
    return sched.cache.resident_bytes() + (0 if drafter is None else drafter.resident_bytes())


@pytest.mark.parametrize("speculative", [False, True])
def test_admission_waits_for_room_and_the_caches_stay_within_the_budget(q8, work, speculative):
    prompts, limits, reference = work
    probe = _scheduler(q8, speculative)
    budget = 2 * probe.reservation(max(len(p) + n for p, n in zip(prompts, limits))) + 1000
    sched = _scheduler(q8, speculative, kv_cache_bytes=budget)
    ids = {sched.add(p, n): k for k, (p, n) in enumerate(zip(prompts, limits))}
    out: dict[int, list[int]] = {}
    most, peak = 0, 0
    while not sched.idle():
        for ev in sched.step():
            out.setdefault(ids[ev.id], []).extend(ev.tokens)
        assert sched.reserved <= budget
        most, peak = max(most, sched.in_flight), max(peak, _resident(sched))
    assert most == 2  # eight rows, room for two
    assert 0 < peak <= budget
    assert [out[k] for k in range(len(prompts))] == reference
    assert _resident(sched) < 0.05 * budget  # every row gave its positions back


def test_what_the_budget_can_never_hold_is_refused_saying_how_many_tokens_fit(q8, work):
    prompts, _, _ = work
    probe = _scheduler(q8, False)
    sched = _scheduler(q8, False, kv_cache_bytes=probe.reservation(200))
    assert sched.fits() == 200
    with pytest.raises(GenerationError, match="the context is 200 tokens"):
        sched.add(prompts[0], 10)
    assert sched.idle()
    with pytest.raises(GenerationError, match="holds no request"):
        _scheduler(q8, False, kv_cache_bytes=probe.reservation(0) - 1)
