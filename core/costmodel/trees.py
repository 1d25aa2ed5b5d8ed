"""Tree shapes from a rank histogram: greedy growth and the Sequoia dynamic programme.

Both assume the drafter's rank of the target's token is independent across depths, so a node's chance of
lying on the accepted path is the product of rank frequencies along its path and a tree's expected
accepted length is 1 + the sum of those products. Replay (replay.py) then scores the candidate shapes on
the real guesses, so the independence assumption only decides which shapes get tried, never the answer.

A tree is a list of rank tuples (every prefix of a member is a member), as `tree.static_prefixes` builds.
"""

from __future__ import annotations

import heapq

import numpy as np

Node = tuple[int, ...]
MAX_SLOTS = 16


def slots(freq: list[float], limit: int = MAX_SLOTS) -> list[int]:
    """Ranks worth drafting, most frequent first (ties: lower rank first)."""
    ranked = sorted((r for r, f in enumerate(freq) if f > 0), key=lambda r: (-freq[r], r))
    return ranked[:limit]


def expected_length(freq: list[float], nodes: list[Node]) -> float:
    """1 + sum over nodes of the product of rank frequencies along the node's path."""
    total = 1.0
    for node in nodes:
        p = 1.0
        for r in node:
            p *= freq[r] if r < len(freq) else 0.0
        total += p
    return total


def grow_greedy(freq: list[float], budget: int, max_depth: int) -> list[Node]:
    """Nodes in the order greedy growth adds them; the first n form the greedy tree of n nodes.

    Each step adds the frontier node with the highest path probability; a node's first child and next
    sibling join the frontier when it is added, so every prefix of the order is a valid tree.
    """
    order = slots(freq, limit=max(budget, 1))
    if not order or max_depth < 1:
        return []
    nxt = {r: order[i + 1] for i, r in enumerate(order[:-1])}
    heap: list[tuple[float, Node]] = [(-freq[order[0]], (order[0],))]
    out: list[Node] = []
    while heap and len(out) < budget:
        neg, node = heapq.heappop(heap)
        out.append(node)
        p = -neg
        if len(node) < max_depth:
            heapq.heappush(heap, (-(p * freq[order[0]]), node + (order[0],)))
        sib = nxt.get(node[-1])
        if sib is not None:
            parent_p = p / freq[node[-1]]
            heapq.heappush(heap, (-(parent_p * freq[sib]), node[:-1] + (sib,)))
    return out


def sequoia(freq: list[float], budget: int, max_depth: int) -> dict[int, list[Node]]:
    """The optimal tree of at most n nodes and depth <= max_depth for every n <= budget (Sequoia's DP).

    G[l][n] is the best expected number of accepted nodes below a node with n nodes and depth l to spend;
    H[l][j][n] the same spread over sibling slots j, j+1, ... (slot j = j-th most frequent rank):
    H[l][j][n] = max(0, max_y q_j * (1 + G[l-1][y-1]) + H[l][j+1][n-y]). Skipping a more frequent slot for
    a less frequent one never helps, so siblings take slots in order.
    """
    order = slots(freq, limit=min(MAX_SLOTS, max(budget, 1)))
    S, D = len(order), max_depth
    q = np.array([freq[r] for r in order], dtype=np.float64)
    G = np.zeros((D + 1, budget + 1))
    choice = np.zeros((D + 1, S + 1, budget + 1), dtype=np.int64)
    for level in range(1, D + 1):
        H = np.zeros((S + 1, budget + 1))
        for j in range(S - 1, -1, -1):
            for n in range(1, budget + 1):
                y = np.arange(1, n + 1)
                vals = q[j] * (1.0 + G[level - 1][y - 1]) + H[j + 1][n - y]
                best = int(np.argmax(vals))
                if vals[best] > 0.0:
                    H[j][n] = vals[best]
                    choice[level, j, n] = best + 1
        G[level] = H[0]

    def build(prefix: Node, level: int, n: int, out: list[Node]) -> None:
        j = 0
        while j < S and n > 0:
            y = int(choice[level, j, n])
            if y == 0:
                return
            node = prefix + (order[j],)
            out.append(node)
            build(node, level - 1, y - 1, out)
            n -= y
            j += 1

    trees: dict[int, list[Node]] = {}
    for n in range(1, budget + 1):
        nodes: list[Node] = []
        if S and D:
            build((), D, n, nodes)
        trees[n] = sorted(nodes, key=lambda p: (len(p), p))
    return trees


def leaves(nodes: list[Node]) -> list[list[int]]:
    """Rank paths (the tree's leaves) whose prefixes are exactly `nodes`."""
    members = set(nodes)
    inner = {n[:-1] for n in members}
    return [list(n) for n in sorted(members - inner, key=lambda p: (len(p), p))]
