"""Chunked prefill under a per-step token budget, and the prefix cache.

On the real SmolLM2 GGUF in q8 (row-invariant arithmetic), against the q8 model's own one-shot prefill and q8
plain decoding:
- a prompt prefilled in two pieces, cut at every position, leaves the same cache bits as one forward over it,
  and so does a 640-token prompt cut into chunks of several sizes;
- the scheduler under token budgets from 5 tokens to none, with and without a prefix cache, AR and
  speculative, emits q8 plain decoding's tokens for every request, a 650-token one among them;
- requests already decoding keep decoding while a long prompt is prefilled chunk by chunk;
- a request whose prompt starts with cached blocks prefills only the rest, and the cache stays within its
  byte budget, evicting leaves before their parents.
On the float32 tiny pair the same scheduler options give single-request AR's tokens.
"""

from __future__ import annotations

import pytest
import torch

from specpilot.core.engine import Engine
from specpilot.core.engine.batching import CostTable, Policy
from specpilot.core.engine.prefix_cache import BLOCK, PrefixCache
from specpilot.core.engine.scheduler import Scheduler, drive
from specpilot.core.recipe import builtin

pytestmark = pytest.mark.slow  # a long file: the test workers take these first (conftest.py)


@pytest.fixture(scope="module")
def q8(smollm2_dir, one_thread):
    return Engine.load(smollm2_dir, smollm2_dir, numerics="q8")


def _tokens(engine, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, engine.target.cfg.vocab_size, (n,), generator=gen).tolist()


def _chunked_cache(model, tokens: list[int], cuts: list[int], room: int):
    cache = model.new_cache(1, room)
    for a, b in zip([0, *cuts], [*cuts, len(tokens)]):
        model.extend_row(cache, 0, tokens[a:b])
    return cache


def _same(a, b, n: int) -> bool:
    return (torch.equal(a.k[:, :, :, :n], b.k[:, :, :, :n]) and torch.equal(a.v[:, :, :, :n], b.v[:, :, :, :n])
            and torch.equal(a.lengths, b.lengths))


def test_a_prompt_cut_anywhere_leaves_the_bits_of_one_prefill(q8):
    m = q8.target
    short = _tokens(q8, 40, 1)
    whole = _chunked_cache(m, short, [], 48)
    for cut in range(1, len(short)):
        assert _same(_chunked_cache(m, short, [cut], 48), whole, len(short)), cut
    long = _tokens(q8, 640, 2)
    whole = _chunked_cache(m, long, [], 650)
    for size in (16, 100, 333, 512):
        cuts = list(range(size, len(long), size))
        assert _same(_chunked_cache(m, long, cuts, 650), whole, len(long)), size


@pytest.fixture(scope="module")
def shared(q8):
    """Prompts that share a 200-token opening (a system prompt), one 650 tokens long, and their q8 AR tokens."""
    system = _tokens(q8, 200, 3)
    prompts = [system + _tokens(q8, n, 10 + n) for n in (5, 30, 450, 17)] + [_tokens(q8, 7, 4)]
    limits = [12, 20, 9, 15, 10]
    reference = [q8.generate([p], n, speculative=False).tokens[0] for p, n in zip(prompts, limits)]
    return prompts, limits, reference


def _scheduler(engine, speculative: bool, **options) -> Scheduler:
    base = engine.scheduler(builtin("stock") if speculative else None, 3, 1024)
    return Scheduler(base.target, base.drafter, base.spec, base.policy, 3, 1024, base.ver, base.draft_length,
                     **options)


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("budget,cache_bytes", [(None, 0), (5, 0), (37, 1 << 24), (None, 1 << 24)])
def test_budgets_and_the_prefix_cache_give_q8_plain_decodings_tokens(q8, shared, speculative, budget, cache_bytes):
    prompts, limits, reference = shared
    sched = _scheduler(q8, speculative, token_budget=budget, prefix_cache_bytes=cache_bytes)
    assert drive(sched, prompts, limits).tokens == reference
    if cache_bytes:
        assert sched.prefix.stats.hits >= 3 * (200 // BLOCK) * BLOCK // (2 if speculative else 1)
        assert sched.prefilled == sum(len(p) - 1 for p in prompts) - sched.prefix.stats.hits
    else:
        assert sched.prefilled == sum(len(p) - 1 for p in prompts)


def _run(sched: Scheduler, out: dict[int, list[int]], until=lambda: False) -> None:
    while not sched.idle() and not until():
        for ev in sched.step():
            out.setdefault(ev.id, []).extend(ev.tokens)


def test_running_requests_keep_decoding_while_a_long_prompt_is_chunked(q8, shared):
    prompts, limits, reference = shared
    sched = _scheduler(q8, False, token_budget=64)
    first = sched.add(prompts[0], 40)
    while not sched.step():  # the short prompt is prefilled, joins and decodes
        pass
    long = sched.add(prompts[2], limits[2])
    out: dict[int, list[int]] = {}
    during = []
    while sched.partial is not None or sched.is_queued(long):
        events = sched.step()
        for ev in events:
            out.setdefault(ev.id, []).extend(ev.tokens)
        during.append(([e.id for e in events if e.tokens], sched.steps[-1].prefilled))
    chunks = [p for _, p in during if p]
    assert len(chunks) >= (len(prompts[2]) - 1) // 64 and max(chunks) <= 64
    assert all(first in ids for ids, _ in during)  # a decode step beside every chunk
    _run(sched, out)
    assert out[long] == reference[2]


def test_a_part_way_prompt_follows_the_rows_down_when_a_request_leaves(q8, shared):
    prompts, limits, reference = shared
    sched = _scheduler(q8, False, token_budget=32)
    short, long = sched.add(prompts[4], 3), sched.add(prompts[0], limits[0])
    out: dict[int, list[int]] = {}
    _run(sched, out, lambda: short in out and len(out[short]) == 3)
    assert sched.partial is not None and sched.partial.rid == long  # the short one left mid-prefill
    late = sched.add(prompts[3], limits[3])
    _run(sched, out)
    assert out[short] == reference[4][:3] and out[long] == reference[0] and out[late] == reference[3]


def test_a_part_way_prompt_can_be_aborted(q8, shared):
    prompts, limits, reference = shared
    sched = _scheduler(q8, False, token_budget=16)
    rid = sched.add(prompts[2], limits[2])
    sched.step()
    assert sched.partial is not None and sched.in_flight == 1 and not sched.is_queued(rid)
    assert sched.abort(rid) and sched.idle() and not sched.abort(rid)
    other = sched.add(prompts[4], limits[4])
    out: dict[int, list[int]] = {}
    _run(sched, out)
    assert out == {other: reference[4]}


def test_the_prefix_cache_stays_in_budget_and_evicts_leaves_first(q8):
    m = q8.target
    one_block = 2 * m.num_layers * m.cfg.num_kv_heads * BLOCK * m.cfg.head_dim * 4
    pc = PrefixCache(5 * one_block)
    a, b = _tokens(q8, 4 * BLOCK + 3, 5), _tokens(q8, 3 * BLOCK, 6)
    cache = _chunked_cache(m, a, [], 80)
    pc.store(cache, 0, a)
    assert len(pc.blocks) == 4 and pc.bytes == 4 * one_block
    found = pc.match(a[:2 * BLOCK + 5])
    assert len(found) == 2 and pc.stats.hits == 2 * BLOCK
    pc.store(_chunked_cache(m, b, [], 80), 0, b)  # needs 3 blocks: 2 of a's go, leaves first
    assert pc.bytes <= 5 * one_block and pc.stats.evicted == 2
    assert len(pc.match(a)) == 2 and len(pc.match(b)) == 3
    fresh = m.new_cache(1, 80)
    n = pc.load(fresh, 0, pc.match(a))
    m.extend_row(fresh, 0, a[n:])
    assert _same(fresh, cache, len(a))


def test_a_tiny_budget_never_stores_a_path_it_cannot_keep(q8):
    m = q8.target
    one_block = 2 * m.num_layers * m.cfg.num_kv_heads * BLOCK * m.cfg.head_dim * 4
    pc = PrefixCache(one_block * 3 // 2)
    a = _tokens(q8, 3 * BLOCK, 7)
    pc.store(_chunked_cache(m, a, [], 64), 0, a)
    assert len(pc.blocks) == 1 and len(pc.match(a)) == 1


@pytest.mark.parametrize("budget,cache_bytes", [(3, 0), (8, 1 << 20)])
def test_the_float32_pair_under_a_budget_equals_single_request_ar(pair_engine, budget, cache_bytes):
    engine = pair_engine
    gen = torch.Generator().manual_seed(9)
    system = torch.randint(0, 101, (40,), generator=gen).tolist()
    prompts = [system + torch.randint(0, 101, (n,), generator=gen).tolist() for n in (3, 11, 25, 6)]
    limits = [9, 14, 6, 11]
    reference = [engine.generate([p], n, speculative=False).tokens[0] for p, n in zip(prompts, limits)]
    for speculative in (False, True):
        sched = _scheduler(engine, speculative, token_budget=budget, prefix_cache_bytes=cache_bytes)
        assert drive(sched, prompts, limits).tokens == reference


def _flat_table(rows: int) -> CostTable:
    """Prices under which drafting always pays (a verify forward costs the same at any width): the policy then
    drafts as deep as it may, and only the token budget holds it back."""
    return CostTable({(r, t): 10.0 for r in range(1, rows + 1) for t in range(1, 10)}, {r: 0.01 for r in range(1, rows + 1)})


@pytest.mark.parametrize("policy", ["budget", "allocate"])
def test_drafts_share_the_token_budget_with_waiting_prompts(q8, shared, policy):
    """Under a token budget a step's drafts take what is left after every running row's own token and the
    block a waiting prompt advances by: prompts keep advancing while rows speculate, the drafts left go to
    the rows most likely to accept them, and the tokens stay q8 plain decoding's."""
    prompts, limits, reference = shared
    base = q8.scheduler(builtin("stock"), 3, 1024)
    table = _flat_table(3)
    sched = Scheduler(base.target, base.drafter, base.spec, Policy(policy, base.spec, table), 3, 1024, base.ver,
                      token_budget=24)
    seen = []
    real = sched.policy.depths

    def recording(alphas, cap=None, **owed):  # owed: what each row owes the drafter, and has left
        seen.append((len(alphas), cap, d := real(alphas, cap, **owed)))
        return d

    sched.policy.depths = recording
    assert drive(sched, prompts, limits).tokens == reference
    capped = [(n, cap, d) for n, cap, d in seen if cap is not None and cap < 24 - n]
    assert capped, "a prompt waited beside running rows"
    assert all(sum(d) <= cap for _, cap, d in capped)
    assert any(sum(d) > 0 for _, _, d in capped)  # speculation went on beside prefill
    assert all(s.prefilled <= 24 for s in sched.steps)
    assert any(s.prefilled and s.nodes > len(s.accepted) for s in sched.steps)  # a chunk beside drafted rows
    uncapped = [d for n, cap, d in seen if cap == 24 - n]
    assert uncapped and max(max(d) for d in uncapped) > 2  # free of waiting prompts, drafts go deep


def test_a_node_cap_keeps_the_drafts_of_confident_rows():
    table = _flat_table(3)
    policy = Policy("budget", None, table)
    free = policy.depths([0.9, 0.2, 0.6])
    assert len(set(free)) == 1 and free[0] > 2  # uniform depth when nothing caps it
    capped = policy.depths([0.9, 0.2, 0.6], node_cap=5)
    assert sum(capped) == 5 and capped[0] > capped[2] > capped[1] == 0
    assert policy.depths([0.9, 0.2, 0.6], node_cap=0) == [0, 0, 0]


def test_a_drafter_keeps_no_prefix_cache_from_an_earlier_scheduler(q8):
    """The engine keeps one drafter per recipe across schedulers: a scheduler without a prefix cache must not
    find the drafter still reading an earlier scheduler's."""
    with_cache = _scheduler(q8, True, prefix_cache_bytes=1 << 24)
    assert with_cache.drafter.prefix is not None
    without = _scheduler(q8, True)
    assert without.drafter is with_cache.drafter and without.drafter.prefix is None
