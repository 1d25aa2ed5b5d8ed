"""A prefix cache: the KV blocks of prompts already prefilled, reused by the next prompt that starts the same way.

As vLLM's automatic prefix caching does, a prompt is cut into blocks of `BLOCK` tokens and each full block is
keyed by the tokens that lead to it: its parent block and its own tokens. Chat requests share their template
and system prompt, so the next one finds those blocks and prefills only the rest. A key holds the block's
tokens themselves, not a digest of them, so two different prefixes can never share an entry.

Reuse is exact only where a position's keys and values do not depend on how the prompt was cut: the q8
numerics are row-invariant (a position computes the same bits in a prompt's prefill, a chunk of it, or one
token at a time), so there a prompt served from the cache gives bit for bit the output it gives alone. Under
f32 a chunk's products may round differently from the whole prompt's, which the f32 contract's near-tie
policy already covers (the server's `--prefix-cache off` turns it off).

Blocks live under a byte budget with least-recently-used eviction. A lookup touches a prefix's blocks leaf
first, so a parent is always more recent than its children and eviction takes leaves first: a block that
stays is always reachable from the root.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from specpilot.core.engine.model import KVCache

BLOCK = 16  # tokens per block, vLLM's default


@dataclass
class Stats:
    """Tokens looked up and tokens found, since the cache was made (the hit rate is hits / queries)."""

    queries: int = 0
    hits: int = 0
    evicted: int = 0


class PrefixCache:
    """Full KV blocks of past prompts, for one model's cache layout, within `budget_bytes`."""

    def __init__(self, budget_bytes: int, block: int = BLOCK) -> None:
        self.budget, self.block = budget_bytes, block
        self.blocks: OrderedDict[tuple[int, tuple[int, ...]], tuple[int, torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.stats = Stats()
        self._next = 1  # block ids; 0 is the root, the parent of every first block

    def match(self, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached blocks that `tokens` starts with, in order (their count times BLOCK tokens are found)."""
        found = self._walk(tokens)
        self.stats.queries += len(tokens)
        self.stats.hits += len(found) * self.block
        return found

    def _walk(self, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The blocks `tokens` starts with, touched leaf first so the root end stays the most recent."""
        found, keys, parent, b = [], [], 0, self.block
        for i in range(len(tokens) // b):
            key = (parent, tuple(tokens[i * b:(i + 1) * b]))
            entry = self.blocks.get(key)
            if entry is None:
                break
            keys.append(key)
            found.append((entry[1], entry[2]))
            parent = entry[0]
        for key in reversed(keys):
            self.blocks.move_to_end(key)
        return found

    def load(self, cache: KVCache, row: int, found: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write matched blocks into `row` from slot 0 and set its length; returns the tokens written."""
        n = len(found) * self.block
        if found:
            cache.k[:, row, :, :n] = torch.cat([k for k, _ in found], dim=2)
            cache.v[:, row, :, :n] = torch.cat([v for _, v in found], dim=2)
        cache.lengths[row] = n
        return n

    def store(self, cache: KVCache, row: int, tokens: list[int]) -> None:
        """Keep the full blocks of `tokens`, whose keys and values row `row` holds from slot 0 (as many as the
        budget holds: a path longer than the budget keeps its first blocks)."""
        parent, b = 0, self.block
        size = 2 * cache.k[:, row, :, :b].numel() * cache.k.element_size()
        for i in range(min(len(tokens) // b, self.budget // size)):
            key = (parent, tuple(tokens[i * b:(i + 1) * b]))
            entry = self.blocks.get(key)
            if entry is None:
                while self.bytes + size > self.budget:
                    self._evict()
                entry = (self._next, cache.k[:, row, :, i * b:(i + 1) * b].clone(),
                         cache.v[:, row, :, i * b:(i + 1) * b].clone())
                self._next += 1
                self.blocks[key] = entry
                self.bytes += size
            self.blocks.move_to_end(key)  # this path's blocks are the last to go while it is stored
            parent = entry[0]
        self._walk(tokens)  # then leaf first, so eviction takes leaves before their parents

    def _evict(self) -> None:
        _, (_, k, v) = self.blocks.popitem(last=False)
        self.bytes -= 2 * k.numel() * k.element_size()
        self.stats.evicted += 1

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes = 0
