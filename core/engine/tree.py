"""Draft trees: a parents array over nodes (node 0 is the root, the last committed-but-unverified token), and
the walks over them: the acceptance rules' `accept` (a path through the tree and the bonus token) and the cut
of a drafted tree to a depth."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch


@dataclass
class DraftTree:
    """One row's draft. Nodes are ordered parents before children; a chain is a tree."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    q: list[torch.Tensor | None] = field(default_factory=list)

    @classmethod
    def root(cls, token: int) -> "DraftTree":
        return cls([token], [-1], [0], [None])

    def add(self, token: int, parent: int, q: torch.Tensor | None = None) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.q.append(q)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)


@lru_cache(maxsize=4096)
def _ancestors(parents: tuple[int, ...], size: int) -> torch.Tensor:
    anc = torch.zeros(size, size, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    for i in range(len(parents), size):
        anc[i, i] = True
    return anc


def ancestors(parents: list[int], size: int | None = None) -> torch.Tensor:
    """Ancestor-or-self matrix [size, size]; padding nodes beyond the tree see only themselves."""
    return _ancestors(tuple(parents), size or len(parents))


def batch_tensors(trees: list[DraftTree], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded tokens [B, T], depths [B, T] and ancestor masks [B, T, T] for one verification forward."""
    T = max(len(t) for t in trees)
    tokens = [t.tokens + [0] * (T - len(t)) for t in trees]
    depths = [t.depths + [0] * (T - len(t)) for t in trees]
    anc = torch.stack([ancestors(t.parents, T) for t in trees])
    return (torch.tensor(tokens, device=device), torch.tensor(depths, device=device), anc.to(device))


def static_prefixes(paths: list[list[int]]) -> list[tuple[int, ...]]:
    """All prefixes of the given rank paths, ordered by depth then rank (parents before children)."""
    prefixes = {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
    return sorted(prefixes, key=lambda p: (len(p), p))


def chain_paths(depth: int) -> list[list[int]]:
    return [[0] * depth]


def accept_path(tree: DraftTree, choice: list[int], gen: torch.Generator | None = None) -> tuple[list[int], int]:
    """Greedy walk: follow children whose token equals the target's choice; return path and bonus."""
    children = {(tree.parents[i], tree.tokens[i]): i for i in range(1, len(tree))}
    path, node = [], 0
    while (node, choice[node]) in children:
        node = children[(node, choice[node])]
        path.append(node)
    return path, choice[node]


def accept_rejection(tree: DraftTree, p: torch.Tensor, gen: torch.Generator) -> tuple[list[int], int]:
    """Speculative sampling on a chain: p [T, V] target probabilities at each node."""
    path, node = [], 0
    for child in range(1, len(tree)):
        q = tree.q[child]
        x = tree.tokens[child]
        if torch.rand((), generator=gen).item() * q[x].item() < p[node, x].item():
            path.append(child)
            node = child
            continue
        residual = (p[node] - q).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[node]
        return path, int(torch.multinomial(dist, 1, generator=gen).item())
    return path, int(torch.multinomial(p[node], 1, generator=gen).item())


def truncate_tree(tree: DraftTree, depth: int) -> DraftTree:
    """Keep only the nodes of a drafted tree within `depth` (parents precede children, so a prefix)."""
    if max(tree.depths) <= depth:
        return tree
    keep = [i for i in range(len(tree)) if tree.depths[i] <= depth]
    new = {old: j for j, old in enumerate(keep)}
    return DraftTree([tree.tokens[i] for i in keep], [new.get(tree.parents[i], -1) for i in keep],
                     [tree.depths[i] for i in keep], [tree.q[i] for i in keep])
