"""The Attention Residuals read (K3_ARCHITECTURE.md section 3.1): a softmax over depth, per token."""
from __future__ import annotations

import torch

from kernels.torch._dtypes import compute_dtype


def attn_res_read(bank: torch.Tensor, num_valid: int, live: torch.Tensor, query: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """bank [T, S_max, D] (sealed snapshots), live [T, D] (running sum), query [D] -> mix [T, D] (dtype of live).

    Candidates are bank[:, :num_valid] then live. Keys are RMS-normalised, values are the RAW candidates:
    score_j = rsqrt(mean(v_j^2) + eps) * (v_j . query); softmax over j in float32; mix in float32.
    With num_valid = 0 the read is the identity.
    """
    if not 0 <= num_valid <= bank.shape[1]:
        raise ValueError(f"attn_res_read: num_valid={num_valid} must be between 0 and the bank's {bank.shape[1]} rows")
    if bank.shape[0] != live.shape[0] or bank.shape[2] != live.shape[1] or query.shape != (live.shape[1],):
        raise ValueError(f"attn_res_read: bank {tuple(bank.shape)}, live {tuple(live.shape)} and query "
                         f"{tuple(query.shape)} must be [T, S_max, D], [T, D] and [D]")
    dtype = compute_dtype(bank, live, query)
    candidates = torch.cat([bank[:, :num_valid], live[:, None, :]], dim=1).to(dtype)  # [T, S+1, D]
    inv_rms = torch.rsqrt(candidates.pow(2).mean(dim=-1) + eps)                     # [T, S+1]
    scores = inv_rms * (candidates @ query.to(dtype))                                 # [T, S+1]
    weights = torch.softmax(scores, dim=-1)                                           # [T, S+1]
    return torch.einsum("ts,tsd->td", weights, candidates).to(live.dtype)
