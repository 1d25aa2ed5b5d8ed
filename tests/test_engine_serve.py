"""Continuous batching: every batching policy, at every batch size, equals single-request AR (float32)."""

import pytest

from specpilot.core.engine import Engine
from specpilot.core.engine.batching import MAX_DEPTH, CostTable, Policy, allocate, expected_accepted, measure_costs
from specpilot.core.engine.scheduler import Scheduler, check_fits, drive
from specpilot.core.engine.tree import chain_paths
from specpilot.core.engine.drafters import TreeSpec


def serve(target, drafter, prompts, limits, spec, policy=None, max_batch=8, verification=None):
    """A scheduler over explicit parts (not a recipe's) driven over a fixed list, as Engine.serve drives one."""
    check_fits(target, prompts, limits)
    sched = Scheduler(target, drafter, spec, policy, max_batch, max(len(p) + n for p, n in zip(prompts, limits)),
                      verification)
    return drive(sched, prompts, limits)


def workload(n=7, vocab=101):
    import torch

    g = torch.Generator().manual_seed(3)
    prompts, limits = [], []
    for i in range(n):
        base = torch.randint(0, vocab, (3 + 2 * i,), generator=g).tolist()
        prompts.append(base + base[: len(base) // 2])
        limits.append([9, 23, 14, 30, 5, 18, 26][i % 7])
    return prompts, limits


@pytest.fixture(scope="module")
def setup(tiny_pair):
    target_dir, drafter_dir, _ = tiny_pair
    engine = Engine.load(target_dir, drafter_dir)
    prompts, limits = workload()
    reference = [engine.generate([p], n, speculative=False).tokens[0] for p, n in zip(prompts, limits)]
    table = measure_costs(engine.target, engine.drafter_model, [1, 2, 3], repeats=1)
    return engine, prompts, limits, reference, table


@pytest.mark.parametrize("policy", ["fixed", "budget", "allocate", "cap"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_serve_equals_single_request_ar(setup, policy, batch):
    engine, prompts, limits, reference, table = setup
    spec = TreeSpec("static", chain_paths(4))
    drafter = engine.drafter_for(engine_recipe())
    pol = Policy(policy, spec, table)
    result = serve(engine.target, drafter, prompts, limits, spec, pol, max_batch=batch)
    assert result.tokens == reference
    assert max(max(s.accepted) for s in result.steps) <= 9


def test_serve_ar_and_ngram(setup):
    engine, prompts, limits, reference, _ = setup
    assert serve(engine.target, None, prompts, limits, None, max_batch=3).tokens == reference
    from specpilot.core.recipe import Recipe

    ngram = engine.drafter_for(Recipe.from_dict({"draft": {"method": "ngram"}}))
    out = serve(engine.target, ngram, prompts, limits, TreeSpec("static", chain_paths(5)), max_batch=4)
    assert out.tokens == reference


def engine_recipe():
    from specpilot.core.recipe import builtin

    return builtin("stock")


def test_allocation_prefers_confident_rows():
    depths = allocate([0.9, 0.2, 0.6], nodes=8)
    assert sum(depths) == 8
    assert depths[0] > depths[2] > depths[1]
    assert allocate([0.5, 0.5], 0) == [0, 0]


def test_expected_accepted_and_table_fallback():
    assert expected_accepted(0.5, 0) == 1
    assert abs(expected_accepted(0.5, 2) - 1.75) < 1e-12
    table = CostTable({(1, 1): 1.0, (1, 2): 1.2, (4, 1): 2.0, (4, 2): 3.0})
    assert table.verify_ms(4, 2) == 3.0
    assert table.verify_ms(8, 2) == 6.0
    assert table.verify_ms(1, 9) == 1.2


def test_long_prompt_joining_late_fits_the_cache(setup):
    """A long prompt admitted while others decode is prefilled alone (no padded writes past the cache)."""
    import torch

    engine, _, _, _, table = setup
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (6, 100, 5, 96)]
    limits = [20, 20, 24, 20]
    reference = [engine.generate([p], n, speculative=False).tokens[0] for p, n in zip(prompts, limits)]
    spec = TreeSpec("static", chain_paths(4))
    out = serve(engine.target, engine.drafter_for(engine_recipe()), prompts, limits, spec,
                Policy("budget", spec, table), max_batch=2)
    assert out.tokens == reference


def test_each_recipe_is_priced_with_its_own_cost_table(setup):
    """Policies price a step with the recipe's own target and drafter: n-gram drafting costs nothing, the
    model drafter its forward; tables are measured once per mechanism and batch size."""
    from specpilot.core.recipe import Recipe

    engine, prompts, limits, reference, _ = setup
    ngram = Recipe.from_dict({"draft": {"method": "ngram"}, "tree": {"policy": "dynamic", "depth": 6, "budget": 10},
                              "batching": {"policy": "budget"}})
    model = Recipe.from_dict({"batching": {"policy": "cap"}})
    t_ngram = engine.cost_table(ngram, [1, 3])
    t_model = engine.cost_table(model, [3])
    assert t_ngram.draft == {} and sorted(t_ngram.verify) == [(b, t) for b in (1, 3) for t in range(1, 10)]
    assert sorted(t_model.draft) == [3] and t_model is not t_ngram
    assert engine.cost_table(ngram.replace(batching={"policy": "allocate"}), [3]) is t_ngram
    for recipe in (ngram, model):
        assert engine.serve(prompts, limits, recipe, 3).tokens == reference


def test_a_depth_must_promise_min_gain_over_plain_decoding():
    """A draft token costing 40 ms beside a 100 ms step promises 7% more tokens per ms at acceptance 0.5: within
    what the measured prices and a running acceptance estimate can be off by, so the policy decodes plainly; at
    20 ms it promises 25% and drafts."""
    from specpilot.core.engine.batching import MIN_GAIN, best_uniform_depth

    for draft_ms, promise, depth in ((40.0, 1.5 * 100 / 140, 0), (20.0, 1.5 * 100 / 120, 1)):
        table = CostTable({(1, 1): 100.0, (1, 2): 100.0}, {1: draft_ms})
        assert (promise >= 1 + MIN_GAIN) == (depth > 0) and promise > 1
        assert best_uniform_depth(table, 1, 0.5, max_depth=1) == depth


def test_policies_price_the_step_overhead_they_observe():
    """A per-step overhead every depth pays makes deeper drafts pay (depth 0 wins on the forward alone, depth
    2 once 20 ms per step is priced in); an overhead that grows with depth is learned per depth."""
    from specpilot.core.engine.batching import best_uniform_depth

    table = CostTable({(2, 1): 10.0, (2, 2): 15.0, (2, 3): 20.0})
    assert best_uniform_depth(table, 2, 0.5, max_depth=2) == 0
    assert best_uniform_depth(table, 2, 0.5, max_depth=2, overhead_ms={0: 20.0}) == 2
    assert best_uniform_depth(table, 2, 0.5, max_depth=2, overhead_ms={0: 20.0, 2: 40.0}) == 1
    policy = Policy("budget", TreeSpec("static", chain_paths(2)), table)
    assert policy.depths([0.5, 0.5]) == [0, 0]
    policy.observe([1, 1], 25.0)  # 15 ms priced for one draft token per row: 10 ms beyond the table
    assert policy.overhead_ms == {2: {1: 10.0}}
    policy.observe([1, 0], 45.0)  # padded to the deepest row: moving average 0.8 * 10 + 0.2 * 30
    assert policy.overhead_ms[2][1] == pytest.approx(14.0)
    assert policy.depths([0.5, 0.5]) != [0, 0]
    fixed = Policy("fixed", None, table)
    fixed.observe([1, 1], 99.0)
    assert fixed.overhead_ms == {}


def test_acceptance_is_estimated_per_tested_token():
    from specpilot.core.engine.batching import acceptance_sample

    assert acceptance_sample(3, 4) == 0.75  # 3 accepted, the 4th tested and rejected
    assert acceptance_sample(4, 4) == 1.0
    assert acceptance_sample(0, 4) == 0.0
    assert acceptance_sample(1, 1) == 1.0 and acceptance_sample(0, 1) == 0.0
    assert acceptance_sample(2, 6) == pytest.approx(2 / 3)


def test_a_policy_that_stops_drafting_still_probes():
    """Depth 0 learns no acceptance, so after PROBE_EVERY undrafted steps one step drafts a token per row;
    each probe that changes nothing doubles the wait for the next, up to PROBE_MAX."""
    from specpilot.core.engine.batching import PROBE_EVERY, PROBE_MAX

    table = CostTable({(2, t): 5.0 + 5.0 * t for t in range(1, MAX_DEPTH + 2)})
    policy = Policy("budget", TreeSpec("static", chain_paths(2)), table)
    waits = [PROBE_EVERY]
    while waits[-1] < PROBE_MAX:
        waits.append(min(2 * waits[-1], PROBE_MAX))
    waits += [PROBE_MAX, PROBE_MAX]
    seen = [policy.depths([0.6, 0.6]) for _ in range(sum(waits))]  # 0.6 does not pay here, 0.705 would
    probes = [i for i, d in enumerate(seen) if d != [0, 0]]
    assert probes == [sum(waits[:j + 1]) - 1 for j in range(len(waits))]
    assert all(seen[i] == [1, 1] for i in probes)
    assert min(policy.depths([0.95, 0.95])) > 0 and policy.idle == 0  # drafting again resets the count
    assert policy.probe_every == PROBE_EVERY  # and the wait
    assert Policy("fixed", None, table).depths([0.5]) is None


def test_a_ragged_target_prices_steps_by_their_mean_depth():
    """Padded verification pays rows x the deepest draft; ragged verification the mean tokens per row."""
    table = CostTable({(2, 1): 10.0, (2, 2): 15.0, (2, 3): 20.0})
    assert table.step_ms([2, 0], ragged=False) == 20.0
    assert table.step_ms([2, 0], ragged=True) == 15.0 and table.step_ms([1, 0], ragged=True) == 12.5
    ragged = Policy("allocate", TreeSpec("static", chain_paths(2)), table, ragged=True)
    ragged.observe([2, 0], 25.0)  # mean depth 1, priced 15 ms
    assert ragged.overhead_ms == {2: {1: 10.0}}


def _reason(tokens: list[int], eos: set[int]) -> str:
    return "stop" if tokens and tokens[-1] in eos else "length"


def test_scheduler_requests_join_and_leave_between_steps(setup):
    """Requests added while others are in flight, more than the rows hold: each one's tokens are its own
    single-request AR output, and each ends once, with the reason it ended."""
    from specpilot.core.recipe import builtin

    engine, prompts, limits, reference, _ = setup
    sched = engine.scheduler(builtin("stock"), max_batch=3, max_len=max(len(p) + n for p, n in zip(prompts, limits)))
    eos = set(engine.target.cfg.eos_token_ids)
    ids, out, ended = {}, {}, {}
    for k in (0, 1):
        ids[sched.add(prompts[k], limits[k])] = k
    rounds = 0
    while not sched.idle() or len(ids) < len(prompts):
        if rounds in (2, 3, 4) or (sched.idle() and len(ids) < len(prompts)):
            for k in range(len(ids), min(len(ids) + 2, len(prompts))):
                ids[sched.add(prompts[k], limits[k], seed_id=k)] = k
        assert sched.in_flight <= 3
        for ev in sched.step():
            k = ids[ev.id]
            assert k not in ended, "a request went on after it ended"
            out.setdefault(k, []).extend(ev.tokens)
            if ev.finish:
                ended[k] = ev.finish
        rounds += 1
    assert [out[k] for k in range(len(prompts))] == reference
    assert ended == {k: _reason(reference[k], eos) for k in range(len(prompts))}
    assert sched.steps and sched.idle() and sched.step() == []


def test_abort_frees_the_row_at_once_and_the_next_request_takes_it(setup):
    from specpilot.core.recipe import builtin

    engine, prompts, limits, reference, _ = setup
    sched = engine.scheduler(builtin("stock"), max_batch=2, max_len=64)
    a, b, c, d = (sched.add(prompts[k], limits[k], seed_id=k) for k in (3, 6, 5, 2))
    events = sched.step()
    assert {ev.id for ev in events} == {a, b} and sched.in_flight == 2 and sched.waiting == 2
    assert sched.abort(b) and sched.in_flight == 1  # freed now, not at the next step
    assert sched.abort(d) and sched.waiting == 1  # a queued request never runs
    assert not sched.abort(b) and not sched.abort(99)
    out = {a: [t for ev in events if ev.id == a for t in ev.tokens], c: []}
    while not sched.idle():
        assert sched.in_flight <= 2
        for ev in sched.step():
            assert ev.id in (a, c)
            out[ev.id].extend(ev.tokens)
    assert out[a] == reference[3] and out[c] == reference[5]


def test_scheduler_refuses_what_its_context_cannot_hold(setup):
    from specpilot.core.engine.decode import GenerationError
    from specpilot.core.recipe import builtin

    engine, *_ = setup
    sched = engine.scheduler(builtin("stock"), max_batch=2, max_len=40)
    with pytest.raises(GenerationError, match="context is 40 tokens: the prompt has 30 and max_new_tokens asks for "
                                              "11 more, but 10 fit"):
        sched.add(list(range(30)), 11)
    with pytest.raises(GenerationError, match="max_new_tokens is 0; ask for at least 1"):
        sched.add([1, 2], 0)
    assert sched.idle()


def test_greedy_and_seeded_requests_share_steps_and_each_equals_its_own_ar(setup):
    """Rows verifying differently in one step (greedy, and seeded at two temperatures and seeds): each
    request's tokens are exactly its own single-request AR output under its own rule."""
    from specpilot.core.engine.decode import Verification
    from specpilot.core.engine.scheduler import generate
    from specpilot.core.recipe import builtin

    engine, prompts, limits, reference, _ = setup
    sched = engine.scheduler(builtin("stock"), max_batch=4, max_len=64)
    vers = [Verification("greedy"), Verification("seeded", 0.7, 0.9, 3), Verification("greedy"),
            Verification("seeded", 1.2, 1.0, 8)]
    picks = [3, 1, 5, 6]
    ids = {sched.add(prompts[k], limits[k], seed_id=k, verification=v): i for i, (k, v) in enumerate(zip(picks, vers))}
    out: dict[int, list[int]] = {i: [] for i in range(4)}
    mixed_steps = 0
    while not sched.idle():
        mixed_steps += len({sched.requests[r].ver for r in sched.rows}) > 1
        for ev in sched.step():
            out[ids[ev.id]].extend(ev.tokens)
    assert mixed_steps > 0
    for i, (k, v) in enumerate(zip(picks, vers)):
        ar = generate(engine.target, None, [prompts[k]], limits[k], None, v, [k]).tokens[0]
        assert out[i] == ar
        if v.sampling == "greedy":
            assert ar == reference[k]
    assert out[1] != reference[1] or out[3] != reference[6]  # the sampled ones really sampled


def test_a_request_whose_prefill_fails_ends_alone(setup, monkeypatch):
    from specpilot.core.recipe import builtin

    engine, prompts, limits, reference, _ = setup
    sched = engine.scheduler(builtin("stock"), max_batch=3, max_len=64)
    poison = prompts[4]
    real = type(engine.target).extend_row

    def prefill(self, cache, row, tokens):
        if list(tokens) == poison[:-1] and self is sched.target:
            raise RuntimeError("out of memory (injected)")
        return real(self, cache, row, tokens)

    monkeypatch.setattr(type(engine.target), "extend_row", prefill)
    ids = {sched.add(prompts[k], limits[k], seed_id=k): k for k in (3, 4, 5)}
    out: dict[int, list[int]] = {3: [], 5: []}
    errors = []
    while not sched.idle():
        for ev in sched.step():
            if ev.finish == "error":
                errors.append((ids[ev.id], ev.error))
            else:
                out[ids[ev.id]].extend(ev.tokens)
    assert errors == [(4, "RuntimeError: out of memory (injected)")]
    assert out == {3: reference[3], 5: reference[5]}


def test_a_failed_step_ends_the_requests_in_flight_and_the_scheduler_serves_on(setup, monkeypatch):
    from specpilot.core.engine import scheduler as serve_mod
    from specpilot.core.recipe import builtin

    engine, prompts, limits, reference, _ = setup
    sched = engine.scheduler(builtin("stock"), max_batch=2, max_len=64)
    a, b = sched.add(prompts[3], limits[3], seed_id=3), sched.add(prompts[5], limits[5], seed_id=5)
    sched.step()
    real = serve_mod.verify
    monkeypatch.setattr(serve_mod, "verify", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    events = sched.step()
    assert {(ev.id, ev.finish) for ev in events} == {(a, "error"), (b, "error")} and sched.idle()
    monkeypatch.setattr(serve_mod, "verify", real)
    c = sched.add(prompts[6], limits[6], seed_id=6)
    out = []
    while not sched.idle():
        out += [t for ev in sched.step() if ev.id == c for t in ev.tokens]
    assert out == reference[6]


def test_no_probe_where_even_two_fully_accepted_ones_could_not_change_the_answer():
    """Each drafted token costs half a plain step here, so with MIN_GAIN drafting pays from an estimate of 0.65
    on: two probes, however well accepted, raise 0.3 to 0.63 at most, so none is taken; from 0.6 they can."""
    from specpilot.core.engine.batching import ALPHA_MAX, PROBE_EVERY, next_alpha

    table = CostTable({(2, t): 5.0 + 5.0 * t for t in range(1, MAX_DEPTH + 2)})
    assert next_alpha(0.5, 1.0) == pytest.approx(0.7 * 0.5 + 0.3 * ALPHA_MAX)
    low = Policy("budget", TreeSpec("static", chain_paths(2)), table)
    assert all(low.depths([0.3, 0.3]) == [0, 0] for _ in range(4 * PROBE_EVERY))
    near = Policy("budget", TreeSpec("static", chain_paths(2)), table)
    assert [near.depths([0.6, 0.6]) for _ in range(PROBE_EVERY)][-1] == [1, 1]


def test_no_probe_where_even_the_best_acceptance_would_not_draft():
    """A probe only corrects an acceptance estimate; where verifying t tokens costs t^2 times one, no estimate
    up to ALPHA_MAX makes drafting pay, so the policy never probes (and never feeds the drafter)."""
    from specpilot.core.engine.batching import ALPHA_MAX, MAX_DEPTH, PROBE_EVERY, best_uniform_depth

    steep = CostTable({(2, t): 10.0 * t * t for t in range(1, MAX_DEPTH + 2)})
    assert best_uniform_depth(steep, 2, ALPHA_MAX) == 0
    policy = Policy("budget", TreeSpec("static", chain_paths(2)), steep)
    assert all(policy.depths([0.5, 0.5]) == [0, 0] for _ in range(10 * PROBE_EVERY))


class _Counting:
    """Wraps a model's forward to count its calls."""

    def __init__(self, model):
        self.calls, self.inner = 0, model.step

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_a_request_never_drafted_for_costs_the_drafter_nothing(setup, monkeypatch):
    """Admission leaves the prompt pending in the drafter: served under a policy that drafts nothing at this
    batch size, the drafter's model never runs, and the tokens are still AR's."""
    from specpilot.core.engine.batching import MAX_DEPTH

    engine, prompts, limits, reference, _ = setup
    spec = TreeSpec("static", chain_paths(4))
    drafter = engine.drafter_for(engine_recipe())
    counting = _Counting(drafter.model)
    monkeypatch.setattr(drafter.model, "step", counting)
    # seconds a step: what the policy learns a real step costs beyond the table (tens of ms on a loaded 2-core
    # machine) cannot make a deeper step look cheaper
    steep = CostTable({(r, t): 1000.0 * r * t * t for r in (1, 2, 3) for t in range(1, MAX_DEPTH + 2)})
    out = serve(engine.target, drafter, prompts, limits, spec, Policy("budget", spec, steep), max_batch=3)
    assert out.tokens == reference
    assert counting.calls == 0


def test_a_drafted_row_is_fed_its_prompt_once_and_alone(setup, monkeypatch):
    """Under the fixed chain every admitted prompt longer than CATCH_UP is fed to the drafter once, in a
    forward of its own (the prefill it used to get at admission), not padded into a drafting batch."""
    from specpilot.core.engine.drafters import CATCH_UP

    engine, prompts, limits, reference, _ = setup
    spec = TreeSpec("static", chain_paths(4))
    drafter = engine.drafter_for(engine_recipe())
    fed = []
    inner = drafter.model.extend_row

    def extend_row(cache, row, tokens):
        fed.append(list(tokens))
        return inner(cache, row, tokens)

    monkeypatch.setattr(drafter.model, "extend_row", extend_row)
    out = serve(engine.target, drafter, prompts, limits, spec, Policy("fixed", spec), max_batch=3)
    assert out.tokens == reference
    long = [p[:-1] for p in prompts if len(p) > CATCH_UP]
    assert len(long) >= 3 and sorted(fed) == sorted(long)


def test_extend_row_appends_what_prefill_would_write(setup):
    """prefill_row(a + b) and prefill_row(a) then extend_row(b) hold the same keys (float32 rounding aside)."""
    import torch

    engine, prompts, _, _, _ = setup
    model, p = engine.drafter_model, prompts[-1]
    whole, split = model.new_cache(1, 64), model.new_cache(1, 64)
    with torch.inference_mode():
        model.prefill_row(whole, 0, p)
        model.prefill_row(split, 0, p[:5])
        model.extend_row(split, 0, p[5:])
    n = len(p)
    assert int(whole.lengths[0]) == int(split.lengths[0]) == n
    assert torch.allclose(whole.k[:, :, :, :n], split.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(whole.v[:, :, :, :n], split.v[:, :, :, :n], atol=1e-5)


# -- the drafter's owed catch-up, priced (issue 46 item 5) ----------------------------------------------------

def _drafting_pays(rows: int = 3, catch_up: float | None = 0.5) -> CostTable:
    """A verify forward costs the same at any width and a draft level 0.5 ms: drafting clearly pays while
    nothing is owed (about 3 ms saved per token per row at batch 2 and acceptance 0.8)."""
    return CostTable({(r, t): 10.0 for r in range(1, rows + 1) for t in range(1, MAX_DEPTH + 2)},
                     {r: 0.5 for r in range(1, rows + 1)}, catch_up=catch_up)


def test_budget_prices_the_catch_up_each_row_owes():
    """A 500-token prompt owed at 0.5 ms a token is 250 ms of catch-up: over 4 tokens left it costs 62 ms per
    token, far more than drafting saves, so the policy decodes plainly (and the drafter is never fed); over 1000
    tokens left it is 0.125 ms per token, and the policy drafts as it does when nothing is owed."""
    from specpilot.core.engine.batching import best_uniform_depth, drafting_saves

    table = _drafting_pays()
    assert best_uniform_depth(table, 2, 0.8) > 0
    assert 2.0 < drafting_saves(table, 2, 0.8) < 5.0
    assert best_uniform_depth(table, 2, 0.8, owed_ms=2 * 500 * 0.5 / 4) == 0
    assert best_uniform_depth(table, 2, 0.8, owed_ms=2 * 500 * 0.5 / 1000) > 0
    policy = Policy("budget", None, table)
    free = policy.depths([0.8, 0.8])
    assert free[0] > 0 and free == policy.depths([0.8, 0.8], owed=[0, 0], left=[4, 4])
    assert policy.depths([0.8, 0.8], owed=[500, 500], left=[4, 4]) == [0, 0]
    assert policy.depths([0.8, 0.8], owed=[500, 500], left=[1000, 1000]) == free
    mixed = policy.depths([0.8, 0.8], owed=[500, 0], left=[4, 4])  # the row that owes nothing still drafts
    assert mixed[0] == 0 and mixed[1] > 0


def test_allocate_and_cap_spare_the_row_whose_catch_up_would_not_pay():
    table = _drafting_pays()
    alphas, owed, left = [0.9, 0.6, 0.6], [500, 0, 500], [4, 30, 1000]
    for name, extra in (("allocate", {}), ("allocate", {"node_budget": 9}), ("cap", {})):
        policy = Policy(name, None, table, **extra)
        assert policy.depths(alphas)[0] > 0, name  # the most confident row drafts deepest when nothing is owed
        depths = policy.depths(alphas, owed=owed, left=left)
        assert depths[0] == 0 and depths[1] > 0 and depths[2] > 0, (name, depths)
        if extra:
            assert sum(depths) == 9  # its share of the node budget goes to the rows that draft
    capped = Policy("budget", None, table).depths(alphas, node_cap=4, owed=owed, left=left)
    assert capped[0] == 0 and sum(capped) == 4  # a token budget's cut keeps the spared row spared


def test_probes_spare_the_rows_whose_catch_up_no_acceptance_would_repay():
    from specpilot.core.engine.batching import PROBE_EVERY

    steep = {(2, t): 6.0 + 2.0 * t for t in range(1, MAX_DEPTH + 2)}  # drafting pays only at high acceptance
    table = CostTable(steep, {2: 0.1}, catch_up=0.5)
    policy = Policy("budget", None, table)
    seen = [policy.depths([0.75, 0.75], owed=[500, 3], left=[2, 100]) for _ in range(PROBE_EVERY)]
    assert seen[:-1] == [[0, 0]] * (PROBE_EVERY - 1) and seen[-1] == [0, 1]
    hopeless = Policy("budget", None, table)
    assert all(hopeless.depths([0.1, 0.1], owed=[500, 500], left=[2, 2]) == [0, 0] for _ in range(4 * PROBE_EVERY))


def test_the_catch_up_price_is_learned_from_the_catch_ups_timed():
    table = _drafting_pays(catch_up=0.5)
    policy = Policy("budget", None, table)
    assert policy.catch_up_price() == 0.5
    policy.observe_catch_up(100, 200.0)  # 2 ms a token in this deployment
    assert policy.catch_up_price() == 2.0
    policy.observe_catch_up(10, 70.0)
    assert policy.catch_up_price() == pytest.approx(0.8 * 2.0 + 0.2 * 7.0)
    assert policy.owed_ms(2) == [0.0, 0.0]  # nothing owed until depths() is told
    policy.depths([0.8, 0.8], owed=[30, 0], left=[10, 5])
    assert policy.owed_ms(2) == [pytest.approx(3 * policy.catch_up_price()), 0.0]
    fixed = Policy("fixed", None, table)
    fixed.observe_catch_up(100, 200.0)
    assert fixed.catch_up_price() == 0.5


def test_the_cost_table_keeps_its_catch_up_price_and_reads_tables_kept_without_one():
    table = _drafting_pays(catch_up=0.25)
    back = CostTable.from_dict(table.to_dict())
    assert back == table and back.catch_up == 0.25 and back.catch_up_ms() == 0.25
    old = table.to_dict()
    del old["catch_up"]
    legacy = CostTable.from_dict(old)
    assert legacy.catch_up is None and legacy.verify == table.verify and legacy.draft == table.draft
    assert legacy.catch_up_ms() == 0.5  # unmeasured: the cheapest drafter forward per owed token
    assert "catch_up" not in legacy.to_dict()
    assert CostTable({(1, 1): 1.0}).catch_up_ms() == 0.0  # no drafter model: nothing is owed a model
    with pytest.raises(ValueError):
        CostTable.from_dict({**old, "catch_up": -1.0})
    with pytest.raises(ValueError):
        CostTable.from_dict({**old, "catch_up": "fast"})


def test_measure_costs_prices_the_drafters_catch_up(setup):
    from specpilot.core.engine.batching import measure_catch_up

    engine, _, _, _, table = setup
    assert table.catch_up is not None and table.catch_up > 0
    assert measure_catch_up(engine.drafter_model, repeats=1) > 0
    assert measure_costs(engine.target, None, [1], repeats=1).catch_up is None  # prompt lookup owes nothing


def test_a_model_drafter_counts_what_each_row_owes(setup):
    """owed: the prompt beyond its root after admission, nothing after catch_up, the tokens of every step that
    drafted nothing for the row since; a row a drafting step leaves out is not fed, keeps owing, and drafts
    afterwards exactly as a row never left out."""
    from specpilot.core.engine.drafters import CATCH_UP, DraftMode, ModelDrafter

    engine, prompts, _, _, _ = setup
    long, short = prompts[6], prompts[1]
    assert len(long) - 1 > CATCH_UP
    spec = TreeSpec("static", chain_paths(3))

    def fresh():
        d = ModelDrafter(engine.drafter_model)
        d.open(2, 128)
        d.admit(long)
        d.admit(short)
        return d

    left_out, never = fresh(), fresh()
    assert [left_out.owed(0), left_out.owed(1)] == [len(long) - 1, len(short) - 1]
    left_out.commit([0, 1], [[], []], [[7], [8]])  # a step that drafted nothing
    assert [left_out.owed(0), left_out.owed(1)] == [len(long), len(short)]
    left_out.catch_up(active=[False, True])
    assert left_out.owed(0) == len(long) and left_out.owed(1) == len(short)  # short owes <= CATCH_UP: kept
    left_out.catch_up(least=1, active=[False, True])
    assert left_out.owed(0) == len(long) and left_out.owed(1) == 0
    trees = left_out.draft(spec, DraftMode(), [False, True])
    assert len(trees[0]) == 1 and len(trees[1]) > 1
    assert left_out.owed(0) == len(long)  # left out: not caught up
    left_out.commit([0, 1], [[], [1]], [[9], [trees[1].tokens[1], 5]])
    assert left_out.owed(0) == len(long) + 1 and left_out.owed(1) == 0
    never.commit([0, 1], [[], []], [[7], [8]])
    never.commit([0, 1], [[], []], [[9], [trees[1].tokens[1], 5]])
    assert left_out.pending[0] == never.pending[0]
    for d in (left_out, never):
        d.catch_up()
        assert d.owed(0) == 0
    a = left_out.draft(spec, DraftMode(), [True, False])[0]
    b = never.draft(spec, DraftMode(), [True, False])[0]
    assert a.tokens == b.tokens and a.parents == b.parents


def test_the_scheduler_tells_the_policy_what_rows_owe(setup, monkeypatch):
    """Served under prices where drafting pays but each owed token costs the drafter 1000 s, no row's catch-up
    ever pays: the drafter's model never runs. At 1 ns a token it drafts (and the tokens are AR's both ways)."""
    engine, prompts, limits, reference, _ = setup
    spec = TreeSpec("static", chain_paths(4))
    for price, drafts in ((1e6, False), (1e-6, True)):
        drafter = engine.drafter_for(engine_recipe())
        counting = _Counting(drafter.model)
        monkeypatch.setattr(drafter.model, "step", counting)
        table = _drafting_pays(rows=3, catch_up=price)
        out = serve(engine.target, drafter, prompts, limits, spec, Policy("budget", spec, table), max_batch=3)
        assert out.tokens == reference
        assert (counting.calls > 0) == drafts, price
        monkeypatch.undo()


def test_a_ragged_target_drafts_for_few_rows_where_a_padded_one_would_not():
    """One of four rows drafting: on a padded target the step costs as if all drafted, on a ragged one (q8, or
    the fused f32 backend) only that row's tokens, so drafting for it alone pays there."""
    from specpilot.core.engine.batching import best_uniform_depth, step_price

    table = CostTable({(4, 1): 100.0, (4, 2): 150.0, (4, 3): 200.0})
    assert step_price(table, 4, 2, drafting=1, ragged=True) == pytest.approx(125.0)
    assert step_price(table, 4, 2, drafting=1) == step_price(table, 4, 2) == 200.0
    assert best_uniform_depth(table, 4, 0.9, max_depth=2, drafting=1) == 0
    assert best_uniform_depth(table, 4, 0.9, max_depth=2, drafting=1, ragged=True) == 2


def test_the_first_drafted_token_of_a_wide_ragged_step_is_priced_as_measured():
    """The Xeon's q8 at 16 rows: a plain step 279 ms, every row drafting one 419, one row drafting one 306 (the
    kernel's tiles take 16 rows at a time). Interpolated by the mean, that token cost 9 ms; priced from the
    measured step it costs 27, and the policy no longer drafts for two rows at 0.9 beside 14 with nothing."""
    verify = {(16, t): 279.0 + 140.0 * (t - 1) for t in range(1, MAX_DEPTH + 2)}
    interpolated, measured = CostTable(dict(verify)), CostTable(dict(verify), first={16: 306.0})
    one = [1] + [0] * 15
    assert interpolated.step_ms(one, ragged=True) == pytest.approx(279.0 + 140.0 / 16)
    assert measured.step_ms(one, ragged=True) == 306.0
    assert measured.step_ms([1] * 4 + [0] * 12, ragged=True) == pytest.approx(306.0 + 3 * (419.0 - 306.0) / 15)
    assert measured.step_ms([1] * 16, ragged=True) == 419.0 and measured.step_ms([2] * 16, ragged=True) == 559.0
    assert measured.step_ms(one, ragged=False) == 419.0  # padded: every row pays the deepest
    assert measured.first_ms(12) == pytest.approx(verify[(16, 1)] * 12 / 16 + 27.0)  # the nearest one's extra
    assert measured.first_ms(1) is None and interpolated.first_ms(16) is None
    assert CostTable.from_dict(measured.to_dict()).first == {16: 306.0}
    alphas = [0.9] * 2 + [0.0] * 14
    assert Policy("budget", None, interpolated, ragged=True).depths(alphas)[:2] == [5, 5]
    assert Policy("budget", None, measured, ragged=True).depths(alphas) == [0] * 16


def test_a_drafter_forward_at_an_unmeasured_width_is_not_free():
    """The server measures steps at 1, 2, 4, 8 and 16 rows; at 7 rows a drafter forward costs about what it does
    between 4 and 8, not nothing. Priced free, the budget policy drafted (and caught up whole prompts) at 7 and 13
    rows on the Xeon, and served at 0.8x plain decoding."""
    verify = {(4, 1): 141.0, (4, 2): 174.0, (8, 1): 180.0, (8, 2): 257.0, (16, 1): 265.0, (16, 2): 393.0}
    table = CostTable({**verify, **{(r, t): verify[(r, 2)] + 60.0 * (t - 2) for r in (4, 8, 16) for t in range(3, 10)}},
                      {1: 36.0, 4: 67.0, 8: 114.0, 16: 202.0})
    assert table.draft_ms(8) == 114.0 and table.draft_ms(7) == pytest.approx(67.0 + 3 * (114.0 - 67.0) / 4)
    assert table.draft_ms(32) == pytest.approx(404.0) and table.draft_ms(2) == pytest.approx(36.0 + (67.0 - 36.0) / 3)
    assert CostTable({(1, 1): 1.0}).draft_ms(3) == 0.0  # no drafter forward measured: prompt lookup
    policy = Policy("budget", TreeSpec("static", chain_paths(4)), table)
    assert policy.depths([0.6] * 7) == [0] * 7
    assert policy.depths([0.6] * 4) == [0] * 4  # measured there: drafting does not pay at this acceptance either


def test_a_row_whose_acceptance_does_not_pay_is_not_drafted_for():
    """At 4 rows on a ragged target a drafted token costs half what a plain one does (break-even 0.5 at depth
    1): rows estimated at 0.9 draft, rows at 0.2, or with nothing to propose (0), decode plainly beside them.
    Priced at the four rows' mean (0.5), none would draft, or all."""
    table = CostTable({(4, t): 100.0 + 50.0 * (t - 1) for t in range(1, MAX_DEPTH + 2)})
    depths = Policy("budget", None, table, ragged=True).depths([0.9, 0.2, 0.9, 0.0])
    assert depths[0] == depths[2] > 0 and depths[1] == depths[3] == 0
    assert Policy("budget", None, table, ragged=True).depths([0.2] * 4) == [0] * 4


def test_prompt_lookup_classes_its_drafts_by_the_suffix_it_matched():
    """draft_class is the length of the suffix the next draft continues (at most max_n), 0 where nothing
    matches, and the draft it classes is the one draft() then gives."""
    from specpilot.core.engine.drafters import DraftMode, NgramDrafter

    d = NgramDrafter(max_n=3)
    d.open(3, 64)
    d.admit([5, 6, 7, 8, 9, 5, 6, 7])  # ends with 5 6 7, seen before: continues 8 9
    d.admit([1, 2, 3, 4, 9, 4])  # ends with 4, seen once, after 3 (so 3 4 is not): continues 9 4
    d.admit([1, 2, 3])  # nothing repeats
    assert [d.draft_class(r) for r in range(3)] == [3, 1, 0]
    trees = d.draft(TreeSpec("static", chain_paths(2)), DraftMode(), [True] * 3)
    assert trees[0].tokens[1:] == [8, 9] and trees[1].tokens[1:] == [9, 4] and len(trees[2]) == 1
    d.commit([2], [[]], [[1, 2]])  # 1 2 now follows 3 and repeats the start
    assert d.draft_class(2) == 2


def test_draft_classes_learn_their_own_acceptance_and_serve_ar_tokens(setup):
    """Prompt lookup under the budget policy: each row is priced by the acceptance learned for its draft class,
    learned from the rows drafted in it; the tokens are single-request AR's."""
    from specpilot.core.engine.batching import ClassAcceptance
    from specpilot.core.recipe import Recipe

    engine, prompts, limits, reference, _ = setup
    spec = TreeSpec("static", chain_paths(4))
    table = CostTable({(r, t): 10.0 for r in range(1, 5) for t in range(1, MAX_DEPTH + 2)})
    ngram = engine.drafter_for(Recipe.from_dict({"draft": {"method": "ngram"}}))
    sched = Scheduler(engine.target, ngram, spec, Policy("budget", spec, table), 4,
                      max(len(p) + n for p, n in zip(prompts, limits)))
    assert drive(sched, prompts, limits).tokens == reference
    assert sched.classes.alphas and set(sched.classes.alphas) <= {1, 2, 3}
    learned = ClassAcceptance()
    learned.observe(3, 1.0)
    learned.observe(1, 0.0)
    assert learned.estimate(3) > learned.estimate(4) > learned.estimate(1) > learned.estimate(0) == 0.0
