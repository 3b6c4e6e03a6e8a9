"""KDA chunked prefill with both passes in one launch: the state recurrence starts while the intra pass still runs.

For one long sequence the state pass (`kda_chunk_state`) has a program per (value block, head): 96 at K3's shape,
fewer than the GPU's SMs, stepping 1024 chunks one after another at 32K tokens. Run after the intra pass it adds
its whole length to the call. Here one 1-D grid holds both roles:

    programs [0, n_state)          the state programs (value block fastest, then head, then sequence)
    programs [n_state, n_state + chunks * H)   the intra programs, chunk-major (chunk c of head h at c * H + h)

Each intra program writes its (chunk, head) workspace, then publishes flag[c * H + h] (a barrier orders every
thread's stores before one thread's release). A state program reads a chunk only after seeing its flag set
(acquire; `state_program`'s WAIT), so it trails the intra programs by a few chunks instead of waiting for all.

Why it cannot deadlock: intra programs wait for nothing, so as long as one of them can be resident they all
finish, and the state programs then find every flag set. The host launches the fused form only when the state
programs fill at most one of the two program slots an SM offers (`kda_prefill.PrefillLaunch.fused_applies`), so
half of every SM stays for intra programs whatever order the hardware starts blocks in. A flag that never comes
(a bug, not a schedule) ends in NaN outputs after `max_spins` polls, not in a hung GPU.

STATE_FIRST puts the state programs at the low program ids, where GPUs start blocks first. The CPU interpreter runs
programs one after another in id order, so it takes the intra programs first (every flag is set before any state
program reads one): the same kernels and flags, without the concurrency.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.kda_chunk_intra import two_block_chunk
from kernels.triton.kda_chunk_state import state_program


@triton.jit
def _publish(flag_ptr, i_chunk, i_h, H: tl.constexpr):
    """Mark (chunk, head) written: every thread's workspace stores are ordered before the one release."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr + i_chunk * H + i_h, 1, sem="release", scope="gpu")


@triton.jit
def kda_chunk_fused_kernel(
        q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, lower_bound,     # intra inputs
        w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr,                               # workspace
        o_ptr, state_ptr, state_stride, slot_ptr, has_init_ptr,
        cu_seqlens_ptr, seq_chunk_ptr, chunk_start_ptr, chunk_len_ptr,
        ckpt_ptr, seq_ckpt_ptr, ckpt_interval, scale,
        flag_ptr, n_state, n_intra, max_spins,                                          # int32 [chunks * H] zeroed
        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, SUB: tl.constexpr,
        BK: tl.constexpr, BV: tl.constexpr, BVF: tl.constexpr, FORM: tl.constexpr,
        INTRA_PRECISION: tl.constexpr, STATE_PRECISION: tl.constexpr, CHECKPOINTS: tl.constexpr,
        INTERPRETED: tl.constexpr, STATE_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    if STATE_FIRST:
        state_pid = pid
        intra_pid = pid - n_state
    else:
        state_pid = pid - n_intra
        intra_pid = pid
    if (state_pid >= 0) & (state_pid < n_state):
        NV: tl.constexpr = (V + BV - 1) // BV
        state_program(state_pid % NV, (state_pid // NV) % H, state_pid // (NV * H), w_ptr, u_ptr, qg_ptr, kd_ptr,
                      aqk_ptr, decay_ptr, o_ptr, state_ptr, state_stride, slot_ptr, has_init_ptr, cu_seqlens_ptr,
                      seq_chunk_ptr, chunk_start_ptr, chunk_len_ptr, ckpt_ptr, seq_ckpt_ptr, ckpt_interval, scale,
                      flag_ptr, max_spins, H, K, V, BT, BK, BV, CHECKPOINTS, INTERPRETED, STATE_PRECISION, True,
                      True)
    else:
        i_chunk = intra_pid // H
        i_h = intra_pid % H
        two_block_chunk(i_chunk, i_h, q_ptr, k_ptr, v_ptr, f_ptr, beta_ptr, a_log_ptr, dt_bias_ptr,
                        chunk_start_ptr, chunk_len_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, aqk_ptr, decay_ptr,
                        lower_bound, H, K, V, BT, SUB, BK, BVF, FORM, INTRA_PRECISION)
        _publish(flag_ptr, i_chunk, i_h, H)
