"""Draft trees: a parents array over nodes (node 0 is the root, the last committed-but-unverified token)."""

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
