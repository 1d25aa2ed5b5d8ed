"""Test-only lossy mechanism: an acceptance rule that accepts a draft token anywhere in the target's top 2.
It is not part of the product (no recipe can name it unless a test registers it); token forcing and the
judge must reject it."""

from specpilot.core.engine.decode import AcceptanceRule
from specpilot.core.mechanisms import register


def choices(logits, trees, ver, req, lengths):
    return logits.topk(2, dim=-1).indices.tolist()


def accept(tree, top2, gen):
    children: dict[int, list[int]] = {}
    for i in range(1, len(tree)):
        children.setdefault(tree.parents[i], []).append(i)
    path, node = [], 0
    while True:
        nxt = next((c for c in children.get(node, []) if tree.tokens[c] in top2[node]), None)
        if nxt is None:
            return path, top2[node][0]
        node = nxt
        path.append(node)


register("acceptance", "lossy_top2", AcceptanceRule(choices, accept))
