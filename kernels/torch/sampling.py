"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, and a counter-based random draw.

The draw is Gumbel-max over the kept tokens: `argmax(logit / temperature + G)` with `G = -log(-log(u))`, which
picks token i with probability softmax(logit / temperature) renormalised over the kept set. `u` is not read
from a generator: it is an integer hash of (row seed, output position, token id), so a row's token depends on
its own logits, seed and position only, never on the other rows of the batch, its place in the batch, or how
many steps ran before. Every tensor op here runs on the device; nothing reads device values back to the host.

Filters, in order (the kept set is a prefix of the tokens sorted by descending logit, ties in token id order):
top_k keeps the k most likely (0 = off; k >= V is off); top_p keeps, of the top-k renormalised distribution, the
smallest prefix whose mass reaches top_p (a token stays while the mass before it is below top_p); min_p keeps the
tokens whose probability is at least min_p times the most likely one's. The most likely token is always kept.
"""
from __future__ import annotations

import torch

from k3core.ops import GREEDY_TEMPERATURE

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that a 32-bit value times one stays below 2**63: int64 never overflows.
_MUL_A, _MUL_B = 0x21F0AAAD, 0x735A2D97
_ROW_SALT, _KEY_SALT = 0x9E3779B9, 0x85EBCA6B


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective integer mixer of 32-bit values held in int64 (all values in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 15)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u [R, V] float32 in (0, 1): a hash of (seeds[r], positions[r], token id), on the device of `seeds`.
    Values are the odd multiples of 2**-24 (exact in float32), so 0 and 1 never occur."""
    seeds = seeds.to(torch.int64)
    key = _mix32((seeds & _MASK32) ^ _ROW_SALT)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (positions.to(torch.int64) & _MASK32))                                  # [R]
    second_key = _mix32(key ^ _KEY_SALT)                                                      # [R]
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)              # [V]
    bits = _mix32(_mix32(key[:, None] ^ token_ids) ^ second_key[:, None])                    # [R, V]
    return ((bits >> 9) * 2 + 1).to(torch.float32) * 2.0 ** -24


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """G [R, V] float32: standard Gumbel variates from `uniform_noise`."""
    return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab_size)))


def _kept_tokens(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 width: int) -> torch.Tensor:
    """keep [R, V] bool: the tokens the filters keep. The kept set of a row is a prefix of its tokens in
    (logit descending, token id ascending) order; its length is found on the `width` largest values, then the
    prefix is rebuilt over the vocabulary as "above the last kept value, or equal to it and among the first
    ties by id", which depends on values only (not on the order a sort or top-k returns ties in)."""
    vocab = scaled.shape[-1]
    if width >= vocab:
        top = torch.sort(scaled, dim=-1, descending=True).values                   # [R, V]
    else:
        top = torch.topk(scaled, width, dim=-1, sorted=True).values                # [R, W]
    width = top.shape[-1]
    index = torch.arange(width, device=scaled.device)
    k = torch.where((top_k > 0) & (top_k < width), top_k, width)                   # [R]
    in_k = index[None, :] < k[:, None]                                             # [R, W]
    most = top[:, :1]
    most = torch.where(torch.isfinite(most), most, torch.zeros_like(most))
    relative = torch.exp(top - most).masked_fill(~in_k, 0.0)                       # p_i / p_max, [R, W]
    total = relative.sum(dim=-1, keepdim=True)
    mass_before = torch.cat([torch.zeros_like(total), relative.cumsum(dim=-1)[:, :-1]], dim=-1)
    in_p = (mass_before < top_p[:, None] * total) | (top_p[:, None] >= 1.0)
    in_min = relative >= min_p[:, None]
    num_kept = (in_k & in_p & in_min).to(torch.int64).cumprod(dim=-1).sum(dim=-1).clamp(min=1)   # [R]
    last = top.gather(1, (num_kept - 1)[:, None])                                  # [R, 1] the last kept value
    num_above = (top > last).sum(dim=-1, keepdim=True)                             # all of them lie in the prefix
    ties = scaled == last                                                          # [R, V]
    keep = (scaled > last) | (ties & (ties.cumsum(dim=-1) <= num_kept[:, None] - num_above))
    unfiltered = ((top_k <= 0) | (top_k >= vocab)) & (top_p >= 1.0) & (min_p <= 0.0)
    return keep | unfiltered[:, None]


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, filter_width: int) -> torch.Tensor:
    """logits [R, V] -> token_ids int64 [R], one independent draw per row, computed in float32 whatever the
    logits dtype (a draw is a decision; the same float32 arithmetic in every run dtype keeps it the same).
    temperature < GREEDY_TEMPERATURE: argmax of the logits (lowest index on ties). Otherwise Gumbel-max over the
    kept tokens with noise `gumbel_noise(seeds, positions)`. `filter_width` (host int): how many of each row's
    largest logits the filters look at (k3core.sampler.filter_width computes it; 0 = no row filters). A
    filtering row is cut to at most `filter_width` tokens, so pass at least the largest top_k, and V when a row
    filters by top_p or min_p without top_k. The caller validates the parameters (SamplingParams.validate)."""
    vocab = logits.shape[-1]
    x = logits.to(torch.float32)                                                   # [R, V]
    greedy = temperature < GREEDY_TEMPERATURE                                      # [R]
    greedy_ids = logits.argmax(dim=-1)                                            # first maximum on ties
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    scaled = x / scale[:, None]
    if filter_width > 0:
        keep = _kept_tokens(scaled, top_k.to(torch.int64), top_p.to(torch.float32), min_p.to(torch.float32),
                            min(filter_width, vocab))
        scaled = scaled.masked_fill(~keep, float("-inf"))
    drawn = (scaled + gumbel_noise(seeds, positions, vocab)).argmax(dim=-1)
    return torch.where(greedy, greedy_ids, drawn)
