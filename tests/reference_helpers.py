"""Inputs and oracles shared by the reference-op test files (not a test module)."""
from __future__ import annotations

import torch

from k3core.ops import KdaGateParams
from kernels.torch.kda import kda_gate, kda_recurrent


F64 = torch.float64
# float64 chunked vs recurrent: the two differ only in summation order and a unit-triangular solve (~1e-14 seen).
KDA_F64_ATOL = 1e-10


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def independent_l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def random_gate(num_heads: int, head_dim: int, form: str, gen: torch.Generator) -> KdaGateParams:
    a_log = torch.randn(num_heads, generator=gen) * 0.5
    dt_bias = torch.randn(num_heads * head_dim, generator=gen) * 0.5
    return KdaGateParams(A_log=a_log, dt_bias=dt_bias, form=form, lower_bound=-5.0)


def kda_inputs(seq_len, num_heads, head_dim, form, gen, dtype=F64):
    q = independent_l2(torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=F64))
    k = independent_l2(torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=F64))
    v = torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=F64)
    f = torch.randn(seq_len, num_heads, head_dim, generator=gen, dtype=F64) * 2
    g = kda_gate(f, random_gate(num_heads, head_dim, form, gen))
    beta = torch.rand(seq_len, num_heads, generator=gen, dtype=F64)
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def recurrent_states_at(q, k, v, g, beta, state, scale, lengths):
    """The recurrent oracle's state after each of `lengths` tokens (segment by segment: the recurrence is Markov)."""
    states, start = [], 0
    for end in lengths:
        state = kda_recurrent(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], state,
                              scale).final_state
        states.append(state)
        start = end
    return states

def make_state_view(num_slots, num_heads, v_dim, k_dim, gen, dtype=F64):
    """A state whose slot axis is strided (a view into a bigger arena), as the unified pool hands it out."""
    arena = torch.randn(num_slots, 3, num_heads, v_dim, k_dim, generator=gen, dtype=dtype)
    return arena, arena[:, 1]
