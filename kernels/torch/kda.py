"""Kimi Delta Attention (KDA): the gate, the per-token recurrence (the oracle), its chunked form, and the
varlen prefill / single-token decode ops of `k3core.ops` that read and write states by slot.

The recurrence, per head, with state S [V, K] (S maps keys to values, the decay acts on the K axis):

    S <- S diag(exp g_t);   S <- S + beta_t (v_t - S k_t) k_t^T;   o_t = scale * S q_t

q and k arrive L2-normalised and g, beta already activated in `kda_recurrent` / `kda_chunked`; the ops
`kda_prefill` / `kda_decode` take the raw projections and do that themselves.

Chunked form (derivation, for a chunk of C tokens starting from state S0; G_i = sum_{j<=i} g_j inside the chunk):
the state after token i is S_i = S0 diag(exp G_i) + sum_{j<=i} u_j (k_j * exp(G_i - G_j))^T with the "new values"
u_i = beta_i (v_i - S_{i-1} diag(exp g_i) k_i). Substituting S_{i-1} gives a unit lower-triangular system

    (I + A) U = diag(beta) (V - Kdec S0^T),   A_ij = beta_i sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])  (j < i)

with Kdec_i = k_i * exp(G_i). Then O = scale (Qdec S0^T + M U) where M_ij = sum_c q_i[c] k_j[c] exp(G_i - G_j)[c]
(j <= i) and Qdec_i = q_i * exp(G_i), and the chunk's final state is S0 diag(exp G_C) + U^T (K * exp(G_C - G)).
Every exponent is a difference G_i - G_j with j <= i, so nothing overflows however strong the decay.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch

from k3core.ops import KdaGateParams, KdaPrefillOut
from kernels.torch._dtypes import compute_dtype, float32_unless_float64

L2_EPS = 1e-6
GATE_FORMS = ("softplus", "lower_bound")


class KdaSequenceOut(NamedTuple):
    output: torch.Tensor              # [T, H, V] in the compute dtype
    final_state: torch.Tensor         # [H, V, K] in the compute dtype
    checkpoint_states: torch.Tensor   # [N, H, V, K]: after each checkpoint's token count, in order


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis, in float32 (float64 for float64 x)."""
    xc = x.to(compute_dtype(x))
    return xc / torch.sqrt(xc.pow(2).sum(dim=-1, keepdim=True) + L2_EPS)


def _safe_softplus(x: torch.Tensor) -> torch.Tensor:
    # log1p(exp(x)) overflows for large x; above 20 softplus(x) equals x to float32 precision.
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))


def kda_gate(f: torch.Tensor, params: KdaGateParams) -> torch.Tensor:
    """f [T, H, K] (raw forget-gate projection) -> g [T, H, K] log-decay <= 0.

    float32 (float64 when f is float64). A_log is per head, dt_bias per channel (h * K + c).
    """
    if f.dim() != 3:
        raise ValueError(f"kda_gate: f must be [T, H, K], got shape {tuple(f.shape)}")
    _, num_heads, head_dim = f.shape
    if params.A_log.numel() < num_heads or params.dt_bias.numel() != num_heads * head_dim:
        raise ValueError(f"kda_gate: need A_log with >= {num_heads} entries and dt_bias with {num_heads * head_dim}, "
                         f"got {params.A_log.numel()} and {params.dt_bias.numel()}")
    dtype = float32_unless_float64(f.dtype)
    # A checkpoint may store A_log padded to head_dim entries: the first H are the per-head values.
    decay_rate = torch.exp(params.A_log.reshape(-1)[:num_heads].to(device=f.device, dtype=dtype))  # [H]
    x = f.to(dtype) + params.dt_bias.to(device=f.device, dtype=dtype).view(num_heads, head_dim)  # [T, H, K]
    if params.form == "softplus":
        return -decay_rate[:, None] * _safe_softplus(x)
    if params.form == "lower_bound":
        return params.lower_bound * torch.sigmoid(decay_rate[:, None] * x)
    raise ValueError(f"kda_gate: unknown gate form {params.form!r}; choose one of {', '.join(GATE_FORMS)}")


def _initial(initial_state: torch.Tensor | None, num_heads: int, v_dim: int, k_dim: int,
             like: torch.Tensor) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(num_heads, v_dim, k_dim, dtype=like.dtype, device=like.device)
    if tuple(initial_state.shape) != (num_heads, v_dim, k_dim):
        raise ValueError(f"KDA initial_state must be [H, V, K] = {(num_heads, v_dim, k_dim)}, "
                         f"got {tuple(initial_state.shape)}")
    return initial_state.to(like.dtype).clone()


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None, scale: float) -> KdaSequenceOut:
    """One sequence, one token at a time: the oracle.

    q, k [T, H, K] (already L2-normalised), v [T, H, V], g [T, H, K] (log-decay), beta [T, H] (activated),
    initial_state [H, V, K] or None (zeros). Returns (output [T, H, V], final_state [H, V, K]) in the compute dtype.
    """
    dtype = compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    state = _initial(initial_state, num_heads, v_dim, k_dim, v)  # [H, V, K]
    output = torch.empty(seq_len, num_heads, v_dim, dtype=dtype, device=v.device)
    for t in range(seq_len):
        state = state * torch.exp(g[t])[:, None, :]                           # decay the K axis
        predicted = torch.einsum("hvk,hk->hv", state, k[t])                   # [H, V]
        delta = beta[t][:, None] * (v[t] - predicted)                         # [H, V]
        state = state + delta[:, :, None] * k[t][:, None, :]                  # rank-1 update
        output[t] = scale * torch.einsum("hvk,hk->hv", state, q[t])
    empty = state.new_empty(0, num_heads, v_dim, k_dim)
    return KdaSequenceOut(output, state, empty)


def _chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk, heads first: q, k, g [H, C, K], v [H, C, V], beta [H, C], state [H, V, K] (before the chunk).
    Returns (output [H, C, V], state after the chunk [H, V, K])."""
    chunk = k.shape[1]
    cum = torch.cumsum(g, dim=1)                                              # G_i [H, C, K]
    diff = cum[:, :, None, :] - cum[:, None, :, :]                            # G_i - G_j [H, C, C, K]
    inclusive = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    # exp only where j <= i; above the diagonal the difference is positive and may overflow.
    pair_decay = torch.exp(diff.masked_fill(~inclusive[None, :, :, None], float("-inf")))  # [H, C, C, K]
    kk = torch.einsum("hik,hjk,hijk->hij", k, k, pair_decay)                  # [H, C, C]
    a = (beta[:, :, None] * kk).tril(diagonal=-1)                             # strictly lower
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    k_dec = k * torch.exp(cum)                                                # [H, C, K]
    rhs = beta[:, :, None] * (v - torch.einsum("hck,hvk->hcv", k_dec, state))  # [H, C, V]
    new_values = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)  # U [H, C, V]
    qk = torch.einsum("hik,hjk,hijk->hij", q, k, pair_decay)                  # M [H, C, C], zero above diagonal
    q_dec = q * torch.exp(cum)                                                # [H, C, K]
    output = scale * (torch.einsum("hck,hvk->hcv", q_dec, state) + qk @ new_values)  # [H, C, V]
    last = cum[:, -1:, :]                                                     # G_C [H, 1, K]
    k_to_end = k * torch.exp(last - cum)                                      # [H, C, K]
    state = state * torch.exp(last) + torch.einsum("hcv,hck->hvk", new_values, k_to_end)
    return output, state


def checkpoint_marks(seq_lens: Sequence[int], checkpoint_interval: int,
                     checkpoint_lengths: Sequence[Sequence[int]] | None) -> list[list[int]] | None:
    """The token counts (from the start of the call) after which `kda_prefill` returns each sequence's state,
    one strictly increasing list per sequence; None when no checkpoint is asked for.

    checkpoint_interval > 0: every multiple of it, and the sequence's last token (none for an empty sequence).
    checkpoint_lengths: the lists as given, checked (one per sequence, 1 <= n <= its length, increasing).
    Every provider of kda_prefill reads its arguments through this one rule.
    """
    if checkpoint_interval < 0:
        raise ValueError(f"kda_prefill: checkpoint_interval must be >= 0, got {checkpoint_interval}")
    if checkpoint_lengths is None:
        if checkpoint_interval == 0:
            return None
        marks = []
        for seq_len in seq_lens:
            every = list(range(checkpoint_interval, seq_len + 1, checkpoint_interval))
            if seq_len > 0 and (not every or every[-1] != seq_len):
                every.append(seq_len)
            marks.append(every)
        return marks
    if checkpoint_interval > 0:
        raise ValueError(f"kda_prefill: pass checkpoint_interval ({checkpoint_interval}) or checkpoint_lengths, "
                         f"not both")
    if isinstance(checkpoint_lengths, torch.Tensor) or len(checkpoint_lengths) != len(seq_lens):
        count = "a tensor" if isinstance(checkpoint_lengths, torch.Tensor) else f"{len(checkpoint_lengths)} lists"
        raise ValueError(f"kda_prefill: checkpoint_lengths must be {len(seq_lens)} host lists of ints (one per "
                         f"sequence of the batch), got {count}")
    marks = []
    for b, (seq_len, wanted) in enumerate(zip(seq_lens, checkpoint_lengths)):
        if isinstance(wanted, torch.Tensor) or not all(isinstance(n, numbers.Integral) for n in wanted):
            raise ValueError(f"kda_prefill: checkpoint_lengths[{b}] must be a host list of ints, got {wanted!r}")
        wanted = [int(n) for n in wanted]
        outside = [n for n in wanted if not 1 <= n <= seq_len]
        if outside:
            raise ValueError(f"kda_prefill: checkpoint_lengths[{b}] = {wanted} has {outside[0]}, outside "
                             f"1..{seq_len} (sequence {b} has {seq_len} tokens in this call)")
        if any(later <= earlier for earlier, later in zip(wanted, wanted[1:])):
            raise ValueError(f"kda_prefill: checkpoint_lengths[{b}] = {wanted} must be strictly increasing")
        marks.append(wanted)
    return marks


def _boundaries(seq_len: int, chunk_size: int, marks: Sequence[int]) -> list[int]:
    cuts = set(range(chunk_size, seq_len, chunk_size)) | {n for n in marks if n < seq_len}
    return [0, *sorted(cuts), seq_len] if seq_len > 0 else [0]


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None, scale: float, chunk_size: int = 64,
                checkpoint_every: int = 0, checkpoint_lengths: Sequence[int] | None = None) -> KdaSequenceOut:
    """One sequence, chunk by chunk with matrix products; the same result as `kda_recurrent`.

    Same arguments as `kda_recurrent`. checkpoint_states holds the state after every multiple of
    checkpoint_every tokens up to and including T, or after exactly the token counts of checkpoint_lengths
    (strictly increasing, in 1..T); none when neither is given. Chunks are cut at multiples of chunk_size and
    also at every checkpoint (so any position works).
    """
    if chunk_size <= 0 or checkpoint_every < 0:
        raise ValueError(f"kda_chunked: chunk_size must be > 0 and checkpoint_every >= 0, "
                         f"got {chunk_size} and {checkpoint_every}")
    seq_len, num_heads, k_dim = k.shape
    if checkpoint_lengths is None:
        marks = list(range(checkpoint_every, seq_len + 1, checkpoint_every)) if checkpoint_every else []
    else:
        if checkpoint_every:
            raise ValueError("kda_chunked: pass checkpoint_every or checkpoint_lengths, not both")
        marks = checkpoint_marks([seq_len], 0, [checkpoint_lengths])[0]
    dtype = compute_dtype(q, k, v, g, beta)
    qh, kh, vh, gh = (t.to(dtype).transpose(0, 1) for t in (q, k, v, g))     # heads first: [H, T, *]
    bh = beta.to(dtype).transpose(0, 1)                                       # [H, T]
    v_dim = v.shape[-1]
    state = _initial(initial_state, num_heads, v_dim, k_dim, vh)              # [H, V, K]
    output = torch.empty(num_heads, seq_len, v_dim, dtype=dtype, device=v.device)
    checkpoints = []
    wanted = set(marks)
    cuts = _boundaries(seq_len, chunk_size, marks)
    for start, end in zip(cuts[:-1], cuts[1:]):
        output[:, start:end], state = _chunk_step(qh[:, start:end], kh[:, start:end], vh[:, start:end],
                                                  gh[:, start:end], bh[:, start:end], state, scale)
        if end in wanted:
            checkpoints.append(state)
    stacked = torch.stack(checkpoints) if checkpoints else state.new_empty(0, num_heads, v_dim, k_dim)
    return KdaSequenceOut(output.transpose(0, 1), state, stacked)


def _check_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
                   state: torch.Tensor, num_seqs: int, slots: list[int]) -> None:
    num_tokens, num_heads, k_dim = q.shape
    if k.shape != q.shape or f.shape != q.shape:
        raise ValueError(f"kda: q, k, f must share the shape [T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(f.shape)}")
    if v.shape[:2] != (num_tokens, num_heads) or tuple(beta_logits.shape) != (num_tokens, num_heads):
        raise ValueError(f"kda: v must be [T, H, V] and beta_logits [T, H] with T={num_tokens}, H={num_heads}; "
                         f"got {tuple(v.shape)} and {tuple(beta_logits.shape)}")
    if tuple(state.shape[1:]) != (num_heads, v.shape[-1], k_dim):
        raise ValueError(f"kda: state must be [slots, H, V, K] = [*, {num_heads}, {v.shape[-1]}, {k_dim}], "
                         f"got {tuple(state.shape)}")
    if len(slots) != num_seqs or len(set(slots)) != len(slots):
        raise ValueError(f"kda: slot_ids must name {num_seqs} distinct slots, got {slots}")
    bad = [s for s in slots if not 0 <= s < state.shape[0]]
    if bad:
        raise ValueError(f"kda: slot_ids {bad} are outside the state's {state.shape[0]} slots")


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
                gate: KdaGateParams, cu_seqlens: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
                has_initial_state: torch.Tensor, scale: float, checkpoint_interval: int = 0, *,
                checkpoint_lengths: Sequence[Sequence[int]] | None = None) -> KdaPrefillOut:
    """Varlen KDA prefill (see `k3core.ops`): q, k, f [T, H, K], v [T, H, V], beta_logits [T, H].

    Each sequence starts from state[slot] (or zeros) and its final state is written back to state[slot] in
    state.dtype. Checkpoints (`checkpoint_marks`): with checkpoint_interval > 0 the states after every multiple
    of checkpoint_interval tokens of each sequence and after its last token; with checkpoint_lengths (host lists,
    one per sequence) the states after exactly those token counts. Rows are ordered by sequence then position, in
    state.dtype (float32 in production). A sequence of length 0 writes its (initial) state back.
    """
    bounds = cu_seqlens.tolist()                       # one host sync per call, not per token
    slots = slot_ids.tolist()
    has_init = has_initial_state.tolist()
    num_seqs = len(bounds) - 1
    _check_prefill(q, k, v, f, beta_logits, state, num_seqs, slots)
    if bounds[-1] != q.shape[0]:
        raise ValueError(f"kda_prefill: cu_seqlens ends at {bounds[-1]} but there are {q.shape[0]} tokens")
    marks = checkpoint_marks([end - start for start, end in zip(bounds[:-1], bounds[1:])], checkpoint_interval,
                             checkpoint_lengths)
    num_heads, v_dim, k_dim = state.shape[1:]
    qn, kn = l2_normalize(q), l2_normalize(k)                                 # [T, H, K]
    g = kda_gate(f, gate)                                                     # [T, H, K]
    beta = torch.sigmoid(beta_logits.to(compute_dtype(beta_logits, v)))      # [T, H]
    output = torch.empty_like(v)
    ckpt_states, ckpt_seqs, ckpt_lens = [], [], []
    for b in range(num_seqs):
        start, end = bounds[b], bounds[b + 1]
        initial = state[slots[b]] if has_init[b] else None                   # [H, V, K] (a view: read before write)
        seq_marks = marks[b] if marks is not None else []
        result = kda_chunked(qn[start:end], kn[start:end], v[start:end], g[start:end], beta[start:end],
                             initial, scale, checkpoint_lengths=seq_marks)
        output[start:end] = result.output.to(v.dtype)
        state[slots[b]] = result.final_state.to(state.dtype)
        ckpt_states.append(result.checkpoint_states.to(state.dtype))       # [len(seq_marks), H, V, K]
        ckpt_seqs += [b] * len(seq_marks)
        ckpt_lens += seq_marks
    if ckpt_lens:
        checkpoint_states = torch.cat(ckpt_states)                            # [N, H, V, K]
    else:
        checkpoint_states = state.new_empty(0, num_heads, v_dim, k_dim)
    as_index = dict(dtype=torch.int64, device=q.device)
    return KdaPrefillOut(output, checkpoint_states, torch.tensor(ckpt_seqs, **as_index),
                         torch.tensor(ckpt_lens, **as_index))


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
               gate: KdaGateParams, state: torch.Tensor, slot_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """One token per sequence: q, k, f [B, H, K], v [B, H, V], beta_logits [B, H] -> o [B, H, V] (dtype of v).

    Vectorised over the batch with no host sync; state[slot_ids] is updated in place (slot ids must be distinct).
    """
    num_seqs, num_heads, k_dim = q.shape
    if tuple(state.shape[1:]) != (num_heads, v.shape[-1], k_dim) or slot_ids.shape != (num_seqs,):
        raise ValueError(f"kda_decode: state must be [slots, {num_heads}, {v.shape[-1]}, {k_dim}] and slot_ids "
                         f"[{num_seqs}], got {tuple(state.shape)} and {tuple(slot_ids.shape)}")
    dtype = compute_dtype(q, k, v, f, beta_logits)
    qn, kn = l2_normalize(q).to(dtype), l2_normalize(k).to(dtype)             # [B, H, K]
    g = kda_gate(f, gate).to(dtype)                                           # [B, H, K]
    beta = torch.sigmoid(beta_logits.to(dtype))                               # [B, H]
    vc = v.to(dtype)
    current = state[slot_ids].to(dtype)                                       # gathered copy [B, H, V, K]
    current = current * torch.exp(g)[:, :, None, :]
    predicted = torch.einsum("bhvk,bhk->bhv", current, kn)                    # [B, H, V]
    delta = beta[:, :, None] * (vc - predicted)                               # [B, H, V]
    current = current + delta[..., None] * kn[:, :, None, :]
    output = scale * torch.einsum("bhvk,bhk->bhv", current, qn)               # [B, H, V]
    state[slot_ids] = current.to(state.dtype)
    return output.to(v.dtype)
