"""Choice rules shared by drafting and verification: greedy, seeded Gumbel-max, and filtered sampling.

Seeded sampling makes every position's sample a pure function of (seed, request, absolute position,
logits): argmax(logits / T + gumbel). Speculative and autoregressive decoding then emit the same tokens
for the same seed, and token forcing can re-derive each choice from the reference model's logits.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) computed in int64 so products never overflow."""
    h = h & _M32
    h = ((h ^ (h >> 16)) * 0x7FEB352D) & _M32
    h = ((h ^ (h >> 15)) * 0x846CA68B) & _M32
    return h ^ (h >> 16)


def gumbel(seed: int, requests: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [N, vocab] keyed by (seed, request id, absolute position) for N positions."""
    dev = positions.device
    key = _mix(torch.full_like(positions, seed & _M32) ^ _mix(requests.to(torch.int64) + 0x9E3779B9))
    key = _mix(key ^ _mix(positions.to(torch.int64) * 2 + 1))
    h = _mix(key[:, None] ^ _mix(torch.arange(vocab, device=dev, dtype=torch.int64)[None, :] + 0x632BE5AB))
    u = (h.to(torch.float64) + 0.5) / 4294967296.0
    return -torch.log(-torch.log(u))


def filtered(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits / T in float32 with tokens outside the top-p nucleus set to -inf."""
    scaled = logits.float() / temperature
    if top_p >= 1.0:
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum - sorted_logits.softmax(dim=-1) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf"))


def seeded_scores(logits: torch.Tensor, temperature: float, top_p: float, seed: int,
                  requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Perturbed scores whose argmax is the seeded sample at each of N positions (logits [N, V])."""
    noise = gumbel(seed, requests, positions, logits.shape[-1])
    return filtered(logits, temperature, top_p) + noise.to(torch.float32)
