"""Acceptance-adaptive draft length, written by the adaptive-length agent and fitted on the tuning
requests' replayed acceptance: draft the mean accepted tokens of the last WINDOW steps plus MARGIN, at
most the tree's depth, so a stretch the drafter gets wrong costs short drafts and an easy one keeps full
depth."""

from specpilot.core.mechanisms import register

WINDOW = 2
MARGIN = 1


def length(depth: int, recent: list[int]) -> int:
    """How far to draft this step, from the tokens each of the last steps accepted."""
    if not recent:
        return depth
    last = recent[-WINDOW:]
    return min(depth, round(sum(last) / len(last)) + MARGIN)


register("draft_length", "adaptive", length)
