"""How far a drafter's chain runs right from each position of a replayed request: what the code-writing
agents simulate their plugins on, read from the same engine drafters the plugins run."""

from __future__ import annotations


def ngram_matches(tokens: list[int], prompt_len: int, ngram_max: int) -> dict[int, bool]:
    """For each position a step can start from, whether the engine's n-gram drafter finds a match there."""
    from specpilot.core.engine.drafters import DraftMode, NgramDrafter, TreeSpec

    drafter = NgramDrafter(ngram_max)
    drafter.reset([tokens[:prompt_len]], len(tokens) + 8)
    spec, mode, out = TreeSpec("static", [[0]]), DraftMode(), {}
    for i in range(prompt_len - 1, len(tokens) - 1):
        out[i] = len(drafter.draft(spec, mode, [True])[0]) > 1
        drafter.commit([0], [[]], [[tokens[i + 1]]])
    return out


def ngram_runs(tokens: list[int], prompt_len: int, n_out: int, ngram_max: int,
               depth: int) -> tuple[dict[int, int], tuple[int, int, int]]:
    """For each position i a step can start from, how many tokens of the n-gram drafter's chain (drafted on
    the true context up to i, as the engine's NgramDrafter does) equal the target's next ones. A chain's
    continuation at a shorter depth is a prefix of the deeper one, so min(run, depth) is what it accepts."""
    from specpilot.core.engine.drafters import DraftMode, NgramDrafter, TreeSpec
    from specpilot.core.engine.tree import chain_paths

    last = len(tokens) - 1
    drafter = NgramDrafter(ngram_max)
    drafter.reset([tokens[:prompt_len]], len(tokens) + depth + 4)
    spec, mode = TreeSpec("static", chain_paths(depth)), DraftMode()
    run: dict[int, int] = {}
    for i in range(prompt_len - 1, last):
        drafted = drafter.draft(spec, mode, [True])[0].tokens[1:]
        k = 0
        while k < len(drafted) and i + k + 1 <= last and drafted[k] == tokens[i + k + 1]:
            k += 1
        run[i] = k
        drafter.commit([0], [[]], [[tokens[i + 1]]])
    return run, (prompt_len - 1, n_out, last)


def rank0_runs(ranks: list[int], prompt_len: int, n_out: int,
               last: int) -> tuple[dict[int, int], tuple[int, int, int]]:
    """For each position i a step can start from, how many of the next tokens the drafter ranks first (what
    a chain of unlimited depth would accept), and the walk's (start, n_out, last)."""
    run: dict[int, int] = {}
    count = 0
    for i in range(last - 1, prompt_len - 2, -1):
        count = count + 1 if i + 1 < len(ranks) and ranks[i + 1] == 0 else 0
        run[i] = count
    return run, (prompt_len - 1, n_out, last)
