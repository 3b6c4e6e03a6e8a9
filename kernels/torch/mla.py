"""Multi-head latent attention: causal varlen prefill (non-absorbed) and paged absorbed decode."""
from __future__ import annotations

import torch

from k3core.ops import MlaDecodeOut
from kernels.torch._dtypes import compute_dtype, float32_unless_float64


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv] -> o [Tq, H, Dv] (dtype of q).

    Per sequence, queries are aligned to the END of the keys (a cached prefix then the new tokens): query i of
    a sequence with Lq queries and Lk keys sees keys j <= Lk - Lq + i. Softmax in float32.
    """
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(bounds_q) != len(bounds_k) or bounds_q[-1] != q.shape[0] or bounds_k[-1] != k.shape[0]:
        raise ValueError(f"mla_prefill: cu_seqlens_q {bounds_q} / cu_seqlens_k {bounds_k} do not match "
                         f"{q.shape[0]} queries and {k.shape[0]} keys")
    dtype = compute_dtype(q, k, v)
    output = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    for b in range(len(bounds_q) - 1):
        q_start, q_end, k_start, k_end = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        num_q, num_k = q_end - q_start, k_end - k_start
        if num_q > num_k:
            raise ValueError(f"mla_prefill: sequence {b} has {num_q} queries but only {num_k} keys; the keys must "
                             f"include the new tokens")
        qs, ks, vs = q[q_start:q_end].to(dtype), k[k_start:k_end].to(dtype), v[k_start:k_end].to(dtype)
        scores = scale * torch.einsum("qhd,khd->hqk", qs, ks)                 # [H, Lq, Lk]
        rows = torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)
        visible = torch.arange(num_k, device=q.device)[None, :] <= rows      # [Lq, Lk]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        output[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, vs).to(q.dtype)
    return output


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, v_dim: int) -> MlaDecodeOut:
    """q [B, H, D_latent] (absorbed), kv_cache [pages, page_size, D_latent], page_table [B, max_pages],
    seq_lens [B] (>= 1) -> MlaDecodeOut(output [B, H, v_dim] dtype of q, lse [B, H] natural log).

    The lse is float32 (float64 for float64 inputs). Gathers every request to max_pages * page_size positions
    and masks the tail, so there is no host sync; entries past seq_lens[b] are never read into the result,
    even if they hold NaN.
    """
    latent = q.shape[-1]
    page_size = kv_cache.shape[1]
    if kv_cache.shape[2] != latent or not 0 < v_dim <= latent:
        raise ValueError(f"mla_decode: q is {latent} wide, kv_cache {tuple(kv_cache.shape)}, v_dim {v_dim}; the "
                         f"latent widths must match and 0 < v_dim <= D_latent")
    dtype = compute_dtype(q, kv_cache)
    positions = torch.arange(page_table.shape[1] * page_size, device=q.device)  # [L_pad]
    valid = positions[None, :] < seq_lens.to(q.device).long()[:, None]        # [B, L_pad]
    pages = page_table.long()[:, positions // page_size]                       # [B, L_pad]
    pages = torch.where(valid, pages, torch.zeros_like(pages))                 # unused entries may be garbage
    entries = kv_cache[pages, positions[None, :] % page_size].to(dtype)        # [B, L_pad, D_latent]
    entries = torch.where(valid[..., None], entries, torch.zeros_like(entries))
    scores = scale * torch.einsum("bhd,bld->bhl", q.to(dtype), entries)       # [B, H, L_pad]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                      # [B, H]
    probs = torch.exp(scores - lse[..., None])
    output = torch.einsum("bhl,bld->bhd", probs, entries[..., :v_dim])
    return MlaDecodeOut(output.to(q.dtype), lse.to(float32_unless_float64(dtype)))
