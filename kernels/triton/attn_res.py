"""AttnRes read (K3_ARCHITECTURE.md §3.1) in one pass: each candidate row is read exactly once.

One program per token holds the whole D-wide row in registers and walks the candidates (num_valid sealed bank rows,
then the live sum) with an online softmax: the running max and denominator are rescaled as in flash attention, so the
raw candidates are mixed as they stream by and never re-read. Memory bound: (S + 2) * D elements per token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.tuning_ops import attn_res_config


@triton.jit
def _mix_candidate(row, query, width, eps, running_max, denominator, acc):
    sum_squares = tl.sum(row * row, axis=0)
    score = tl.sum(row * query, axis=0) / tl.sqrt(sum_squares / width + eps)
    new_max = tl.maximum(running_max, score)
    rescale = tl.exp(running_max - new_max)
    weight = tl.exp(score - new_max)
    return new_max, denominator * rescale + weight, acc * rescale + weight * row


@triton.jit
def _load_candidate(bank_row, live_row, mask, next_slot, num_valid):
    """The bank row at bank_row while next_slot < num_valid, else the live row at live_row, as float32."""
    bank = tl.load(bank_row, mask=mask & (next_slot < num_valid), other=0.0).to(tl.float32)
    live = tl.load(live_row, mask=mask & (next_slot >= num_valid), other=0.0).to(tl.float32)
    return bank + live


@triton.jit
def _attn_res_read_kernel(bank_ptr, live_ptr, query_ptr, out_ptr, bank_token_stride, bank_slot_stride,
                          live_row_stride, out_row_stride, num_valid, width, eps, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < width
    query = tl.load(query_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # a finite start keeps exp(running_max - new_max) at 0 for the first candidate without inf - inf
    running_max = tl.full((), -3.0e38, tl.float32)
    denominator = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    bank_row = bank_ptr + token * bank_token_stride + cols
    live_row = live_ptr + token * live_row_stride + cols
    # The next candidate is loaded before the current one is reduced, so its memory latency hides behind the math.
    # It is the bank row or, after the last one, the live row: two loads with complementary masks, never a select
    # between pointers of two arguments (which Triton 3.6's AMD buffer-ops pass rejects); a masked-off load reads
    # nothing and contributes its 0.
    upcoming = _load_candidate(bank_row, live_row, mask, 0, num_valid)
    for slot in range(0, num_valid):
        row = upcoming
        upcoming = _load_candidate(bank_row + (slot + 1) * bank_slot_stride, live_row, mask, slot + 1, num_valid)
        running_max, denominator, acc = _mix_candidate(row, query, width, eps, running_max, denominator, acc)
    running_max, denominator, acc = _mix_candidate(upcoming, query, width, eps, running_max, denominator, acc)
    tl.store(out_ptr + token * out_row_stride + cols, (acc / denominator).to(out_ptr.dtype.element_ty), mask=mask)


def attn_res_read(bank: torch.Tensor, num_valid: int, live: torch.Tensor, query: torch.Tensor,
                  eps: float) -> torch.Tensor:
    num_tokens, width = live.shape
    if bank.dim() != 3 or bank.shape[0] != num_tokens or bank.shape[2] != width:
        raise ValueError(f"attn_res_read needs bank [T, S_max, D] = [{num_tokens}, S_max, {width}] to match live, "
                         f"got {tuple(bank.shape)}")
    if not 0 <= num_valid <= bank.shape[1]:
        raise ValueError(f"attn_res_read num_valid={num_valid} is outside the bank's 0..{bank.shape[1]} slots")
    if bank.dtype != live.dtype:
        raise ValueError(f"attn_res_read needs bank and live of one dtype, got {bank.dtype} and {live.dtype}; "
                         f"store the sealed snapshots in the live sum's dtype")
    if bank.stride(2) != 1:
        bank = bank.contiguous()
    if live.stride(1) != 1:
        live = live.contiguous()
    out = torch.empty(num_tokens, width, dtype=live.dtype, device=live.device)     # [T, D]
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(width)
    _attn_res_read_kernel[(num_tokens,)](bank, live, query.contiguous(), out, bank.stride(0), bank.stride(1),
                                         live.stride(0), out.stride(0), num_valid, width, eps, BLOCK_D=block,
                                         num_warps=attn_res_config(live.device, block).num_warps)
    return out
