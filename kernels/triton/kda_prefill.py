"""`kda_prefill` (see `k3core.ops`): chunked KDA over a variable-length batch, states by slot, checkpoints.

Two Triton passes (`kda_chunk_intra`: parallel over chunks and heads; `kda_chunk_state`: sequential over the
chunks of a sequence, parallel over value blocks, heads and sequences). This wrapper only does bookkeeping:
it reads cu_seqlens once on the host (one sync per call), cuts every sequence into chunks that end at every
checkpoint asked for, and lays out the checkpoint rows (by sequence, then position) with the table that tells the
state pass which chunk ends fill which row.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton

from k3core.ops import KdaGateParams, KdaPrefillOut
from kernels.triton.host_index import index_tables
from kernels.triton.kda_chunk_intra import kda_chunk_intra_kernel, kda_chunk_intra_two_block_kernel
from kernels.triton.kda_chunk_segments import kda_segment_map_kernel, kda_segment_scan_kernel
from kernels.triton.kda_chunk_state import kda_chunk_state_kernel
from kernels.triton.kda_gate import gate_form_id, gate_tensors
from kernels.triton.tuning import (KernelConfig, dot_precision, fit_chunk_size, fit_state_config, is_interpreted,
                                    kernel_config, pow2_at_least, shared_memory_limit)
from kernels.triton.tuning_ops import compute_units
from kernels.torch.kda import checkpoint_marks

# kda_state (block_v 16, 4 warps: 235 registers per thread in ncu on an H200, 255 offline) fits two programs per SM;
# past that many programs the state pass would run in waves, and the wide value blocks win (PrefillLaunch.state_config).
NARROW_STATE_PROGRAMS_PER_UNIT = 2
# The dense intra-chunk path multiplies factors up to exp((sub_chunk - 1) * |lower_bound|); keep that below
# exp(80) so a 128-channel sum of them stays finite in float32/bfloat16 (max ~3.4e38 ~ exp(88.7)).
MAX_DENSE_EXPONENT = 80.0
# The prefetching state kernel with value blocks of <= 32 is right at 32-token chunks and wrong past them on the H200
# under Triton 3.6.0: the whole op at 64-token chunks gave a relative error of 0.90, merged 64-token
# chunks NaN or relative errors of 0.03-1.06, 128-token chunks illegal memory accesses; block_v 64 / 128 and the
# same kernel without prefetch were right, and the interpreter is right in every form
# (bench/results/archive/tune-prefill-merge-nvidia-h200.md). Past this chunk size such a config runs without prefetch.
PREFETCH_CHECKED_CHUNK = 32


def prefetch_unchecked(config: KernelConfig, chunk_size: int) -> bool:
    """Whether `config` is the prefetching narrow state form on chunks longer than it was found right on
    (PREFETCH_CHECKED_CHUNK)."""
    return config.prefetch and chunk_size > PREFETCH_CHECKED_CHUNK and config.block_v <= 32


NO_CHECKPOINT = -1      # chunk_ckpt of a chunk whose end is no checkpoint


class ChunkPlan(NamedTuple):
    """Host-side description of how the batch is cut (int32 views of one device tensor unless noted)."""
    chunk_start: torch.Tensor        # [num_chunks] first token (global index) of each chunk
    chunk_len: torch.Tensor          # [num_chunks] tokens in each chunk (1..chunk_size)
    seq_chunk: torch.Tensor          # [B + 1] chunks of sequence b are seq_chunk[b] .. seq_chunk[b + 1] - 1
    chunk_ckpt: torch.Tensor         # [num_chunks] checkpoint row the state after each chunk fills, or
                                     # NO_CHECKPOINT; empty when the call asks for no checkpoint
    slots: torch.Tensor              # [B] state slot of each sequence
    ckpt_seq_ids: torch.Tensor       # [num_ckpts] sequence of each checkpoint row
    ckpt_lengths: torch.Tensor       # [num_ckpts] tokens consumed at each checkpoint row


class HostChunkPlan(NamedTuple):
    """`ChunkPlan`'s cut tables as host lists (see there)."""
    starts: list[int]
    lengths: list[int]
    seq_chunk: list[int]
    chunk_ckpt: list[int]
    ckpt_seq_ids: list[int]
    ckpt_lengths: list[int]


def plan_chunks(host: HostChunkPlan, slots: list[int], device: torch.device) -> ChunkPlan:
    """`host_chunk_plan`'s tables on the device, in one non-blocking copy (`index_tables`)."""
    return ChunkPlan(*index_tables([host.starts, host.lengths, host.seq_chunk, host.chunk_ckpt, slots,
                                    host.ckpt_seq_ids, host.ckpt_lengths], device))


def host_chunk_plan(bounds: list[int], chunk_size: int, marks: Sequence[Sequence[int]] | None) -> HostChunkPlan:
    """Cut each sequence at multiples of chunk_size and at each of its checkpoint token counts (`marks`, one
    strictly increasing list per sequence as `checkpoint_marks` gives them, or None for no checkpoint), so that
    every checkpoint falls on a chunk end; chunk_ckpt names the row each such chunk end fills."""
    starts: list[int] = []
    lengths: list[int] = []
    seq_chunk = [0]
    chunk_ckpt: list[int] = []
    ckpt_seq_ids: list[int] = []
    ckpt_lengths: list[int] = []
    for b in range(len(bounds) - 1):
        bos, seq_len = bounds[b], bounds[b + 1] - bounds[b]
        cuts = set(range(chunk_size, seq_len, chunk_size))
        if marks is not None:
            cuts.update(marks[b])
            cuts.discard(seq_len)
        edges = [0, *sorted(cuts), seq_len] if seq_len > 0 else [0]
        for lo, hi in zip(edges[:-1], edges[1:]):
            starts.append(bos + lo)
            lengths.append(hi - lo)
        if marks is not None:
            row_at = {n: len(ckpt_lengths) + i for i, n in enumerate(marks[b])}     # every mark is an edge
            chunk_ckpt += [row_at.get(hi, NO_CHECKPOINT) for hi in edges[1:]]
            ckpt_seq_ids += [b] * len(marks[b])
            ckpt_lengths += marks[b]
        seq_chunk.append(len(starts))
    return HostChunkPlan(starts, lengths, seq_chunk, chunk_ckpt, ckpt_seq_ids, ckpt_lengths)


class SegmentPlan(NamedTuple):
    """The batch's chunks grouped into segments for the segmented state pass (`kda_chunk_segments`): each
    segment is a run of whole chunks of one sequence (checkpoints come from the chunk plan's per-chunk rows, so a
    segment may end anywhere). int32 device tensors of one copy; num_segments on the host."""
    seg_chunk: torch.Tensor          # [S + 1] chunks of segment s are seg_chunk[s] .. seg_chunk[s + 1] - 1
    seg_slots: torch.Tensor          # [S] 0 .. S - 1: the segment's row of the segment-state scratch
    seg_has_init: torch.Tensor       # [S] all 1: every segment starts from the state the scan stored
    seq_seg: torch.Tensor            # [B + 1] segments of sequence b are seq_seg[b] .. seq_seg[b + 1] - 1
    last_seg: torch.Tensor           # [B] the last segment of each sequence (its final state is the sequence's)
    num_segments: int


def plan_segments(host: HostChunkPlan, segment_chunks: int, device: torch.device) -> SegmentPlan:
    """Cut each sequence's chunks into segments of segment_chunks chunks (its last segment may be shorter);
    every sequence, even an empty one, gets at least one segment."""
    if segment_chunks < 1:
        raise ValueError(f"kda_prefill: segment_chunks must be >= 1, got {segment_chunks}")
    seg_chunk, seq_seg, last_seg = [0], [0], []
    for b in range(len(host.seq_chunk) - 1):
        first, end = host.seq_chunk[b], host.seq_chunk[b + 1]
        seg_chunk += range(first + segment_chunks, end, segment_chunks)
        seg_chunk.append(end)
        seq_seg.append(len(seg_chunk) - 1)
        last_seg.append(len(seg_chunk) - 2)
    num_segments = len(seg_chunk) - 1
    tables = index_tables([seg_chunk, list(range(num_segments)), [1] * num_segments, seq_seg, last_seg], device)
    return SegmentPlan(*tables, num_segments)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
                  state: torch.Tensor, slots: list[int], num_seqs: int, num_tokens: int) -> None:
    if k.shape != q.shape or f.shape != q.shape or q.dim() != 3:
        raise ValueError(f"kda_prefill: q, k, f must share the shape [T, H, K]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(f.shape)}")
    num_heads, k_dim = q.shape[1:]
    if v.shape[:2] != q.shape[:2] or tuple(beta_logits.shape) != tuple(q.shape[:2]):
        raise ValueError(f"kda_prefill: v must be [T, H, V] and beta_logits [T, H] with T, H = {tuple(q.shape[:2])}; "
                         f"got {tuple(v.shape)} and {tuple(beta_logits.shape)}")
    if tuple(state.shape[1:]) != (num_heads, v.shape[-1], k_dim) or state.dtype != torch.float32:
        raise ValueError(f"kda_prefill: state must be float32 [slots, {num_heads}, {v.shape[-1]}, {k_dim}], "
                         f"got {state.dtype} {tuple(state.shape)}")
    if state.stride()[1:] != (v.shape[-1] * k_dim, k_dim, 1):
        raise ValueError("kda_prefill: the inner [H, V, K] dims of state must be contiguous; pass a view that "
                         "only strides dimension 0")
    if len(slots) != num_seqs or len(set(slots)) != num_seqs or any(not 0 <= s < state.shape[0] for s in slots):
        raise ValueError(f"kda_prefill: slot_ids must be {num_seqs} distinct slots in [0, {state.shape[0]}), "
                         f"got {slots}")
    if num_tokens != q.shape[0]:
        raise ValueError(f"kda_prefill: cu_seqlens ends at {num_tokens} but q has {q.shape[0]} tokens")


def kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
                gate: KdaGateParams, cu_seqlens: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor,
                has_initial_state: torch.Tensor, scale: float, checkpoint_interval: int = 0, *,
                checkpoint_lengths: Sequence[Sequence[int]] | None = None,
                chunk_size: int | None = None) -> KdaPrefillOut:
    """q, k, f [T, H, K], v [T, H, V], beta_logits [T, H] -> KdaPrefillOut; state[slot_ids] updated in place.

    chunk_size (keyword only, a power of two >= 16): tokens per chunk, by default the vendor table's
    `kda_intra` block_t (32 on NVIDIA, 64 on AMD; `tools.tune.tune_prefill --chunk-sizes` compares others). Any
    checkpoint_interval >= 0 or checkpoint_lengths works: chunks are also cut at every checkpoint.
    """
    launch, result = prepare_kda_prefill(q, k, v, f, beta_logits, gate, cu_seqlens, state, slot_ids,
                                         has_initial_state, scale, checkpoint_interval,
                                         checkpoint_lengths=checkpoint_lengths, chunk_size=chunk_size)
    if launch is not None:
        launch.intra()
        launch.state()
    return result


def prepare_kda_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor,
                        beta_logits: torch.Tensor, gate: KdaGateParams, cu_seqlens: torch.Tensor,
                        state: torch.Tensor, slot_ids: torch.Tensor, has_initial_state: torch.Tensor, scale: float,
                        checkpoint_interval: int = 0, *, checkpoint_lengths: Sequence[Sequence[int]] | None = None,
                        chunk_size: int | None = None) -> tuple[PrefillLaunch | None, KdaPrefillOut]:
    """Check the inputs, cut the batch and allocate everything; launch nothing. The result's tensors are filled
    once the launch (None for an empty batch) has run intra() then state()."""
    if chunk_size is None:
        # the table's chunk, halved until the state pass fits this GPU's shared memory (float32 on an MI300X)
        element_size = 2 if q.dtype in (torch.bfloat16, torch.float16) else 4
        chunk_size = fit_chunk_size(kernel_config("kda_intra").block_t, pow2_at_least(q.shape[-1]), element_size,
                                    (kernel_config("kda_state"), kernel_config("kda_state_wide")))
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"kda_prefill: chunk_size must be a power of two >= 16, got {chunk_size}")
    form = gate_form_id(gate)
    bounds = cu_seqlens.tolist()                     # the one host sync (none when cu_seqlens is on the host)
    slots = slot_ids.tolist()
    num_seqs = len(bounds) - 1
    _check_inputs(q, k, v, f, beta_logits, state, slots, num_seqs, bounds[-1])
    num_tokens, num_heads, k_dim = q.shape
    device = q.device
    a_log, dt_bias = gate_tensors(gate, num_heads, k_dim, device)
    marks = checkpoint_marks([end - start for start, end in zip(bounds[:-1], bounds[1:])], checkpoint_interval,
                             checkpoint_lengths)
    host_plan = host_chunk_plan(bounds, chunk_size, marks)
    plan = plan_chunks(host_plan, slots, device)
    output = torch.empty(num_tokens, num_heads, v.shape[-1], dtype=v.dtype, device=device)
    ckpt_states = torch.empty(plan.ckpt_lengths.numel(), num_heads, v.shape[-1], k_dim, dtype=torch.float32,
                              device=device)
    result = KdaPrefillOut(output, ckpt_states, plan.ckpt_seq_ids.long(), plan.ckpt_lengths.long())
    if num_seqs == 0:
        return None, result
    return PrefillLaunch(q, k, v, f, beta_logits, gate, form, a_log, dt_bias, plan, has_initial_state, state,
                         output, ckpt_states, float(scale), chunk_size, bounds, host_plan), result


class PrefillLaunch:
    """The two passes of one kda_prefill call with their workspace, launchable one at a time.

    kda_prefill runs intra() then state() with the vendor's table configs. A tuning sweep
    (`tools.tune.tune_prefill`) times each pass on its own with other configs; state() reads the workspace
    intra() wrote, so run intra() once first.
    """

    def __init__(self, q, k, v, f, beta_logits, gate: KdaGateParams, form: int, a_log, dt_bias, plan: ChunkPlan,
                 has_initial_state, state, output, ckpt_states, scale: float, chunk_size: int, bounds: list[int],
                 host_plan: HostChunkPlan):
        self.q, self.k, self.v, self.f, self.beta_logits = (t.contiguous() for t in (q, k, v, f, beta_logits))
        self.gate, self.form, self.a_log, self.dt_bias, self.plan = gate, form, a_log, dt_bias, plan
        self.state_tensor, self.output, self.ckpt_states = state, output, ckpt_states
        self.bounds, self.host_plan = bounds, host_plan            # the cut on the host (segmented pass)
        self.scale, self.chunk_size = scale, chunk_size
        num_tokens, self.num_heads, self.k_dim = q.shape
        self.v_dim = v.shape[-1]
        self.num_seqs = plan.slots.numel()
        device = q.device
        # Intermediates in the input precision when it is 16-bit (tensor-core operands), float32 otherwise.
        self.work_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
        self.num_chunks = plan.chunk_len.numel()
        work = dict(dtype=self.work_dtype, device=device)
        self.w = torch.empty(num_tokens, self.num_heads, self.k_dim, **work)   # T (beta k exp G)
        self.qg = torch.empty_like(self.w)                                     # q exp G
        self.kd = torch.empty_like(self.w)                                     # k exp(G_last - G)
        self.u0 = torch.empty(num_tokens, self.num_heads, self.v_dim, **work)  # T (beta v)
        self.aqk = torch.empty(num_tokens, self.num_heads, chunk_size, **work)
        self.decay = torch.empty(self.num_chunks, self.num_heads, self.k_dim, dtype=torch.float32,
                                 device=device)                                # exp(G_last)
        # the kernels test it with `!= 0`: a bool or int32 tensor already on the device is passed as it is, so a
        # prefill launches no conversion kernel for it (the engine passes bool)
        self.has_init = has_initial_state.to(device=device)
        if self.has_init.dtype not in (torch.bool, torch.int32):
            self.has_init = self.has_init.to(torch.int32)

    def _precision(self, config: KernelConfig) -> str:
        # float32 inputs ask for float32 results: exact products; 16-bit inputs use the vendor's fast setting.
        return dot_precision(config.solve_precision) if self.work_dtype != torch.float32 else "ieee"

    def intra(self, config: KernelConfig | None = None) -> None:
        """Pass 1 (parallel over chunks and heads): W, U0, Qg, Kd, Aqk and exp(G_last) into the workspace."""
        if self.num_chunks == 0:
            return
        config = config or kernel_config("kda_intra")
        sub_chunk = min(config.sub_chunk, self.chunk_size)
        if self.uses_two_block(config):
            kda_chunk_intra_two_block_kernel[(self.num_chunks, self.num_heads)](
                self.q, self.k, self.v, self.f, self.beta_logits, self.a_log, self.dt_bias, self.plan.chunk_start,
                self.plan.chunk_len, self.w, self.u0, self.qg, self.kd, self.aqk, self.decay,
                float(self.gate.lower_bound),
                H=self.num_heads, K=self.k_dim, V=self.v_dim, BT=self.chunk_size, SUB=sub_chunk,
                BK=pow2_at_least(self.k_dim), BVF=pow2_at_least(self.v_dim), FORM=self.form,
                PRECISION=self._precision(config), num_warps=config.num_warps, num_stages=config.num_stages)
            return
        dense = self.form == 1 and (sub_chunk - 1) * abs(self.gate.lower_bound) <= MAX_DENSE_EXPONENT
        kda_chunk_intra_kernel[(self.num_chunks, self.num_heads)](
            self.q, self.k, self.v, self.f, self.beta_logits, self.a_log, self.dt_bias, self.plan.chunk_start,
            self.plan.chunk_len, self.w, self.u0, self.qg, self.kd, self.aqk, self.decay,
            float(self.gate.lower_bound),
            H=self.num_heads, K=self.k_dim, V=self.v_dim, BT=self.chunk_size, BK=pow2_at_least(self.k_dim),
            BVF=pow2_at_least(self.v_dim), SUB=sub_chunk, FORM=self.form, DENSE=dense,
            PRECISION=self._precision(config), num_warps=config.num_warps, num_stages=config.num_stages)

    def uses_two_block(self, config: KernelConfig) -> bool:
        """config.two_block applies to chunks of exactly two sub-chunks with the lower-bounded gate, where every
        factor inside a half stays <= exp(sub_chunk |lower_bound|) <= exp(MAX_DENSE_EXPONENT)."""
        sub_chunk = min(config.sub_chunk, self.chunk_size)
        return (config.two_block and self.form == 1 and self.chunk_size == 2 * sub_chunk
                and sub_chunk * abs(self.gate.lower_bound) <= MAX_DENSE_EXPONENT)

    def state_config(self) -> KernelConfig:
        """The table's config for pass 2: `kda_state` (narrow value blocks: many sequential programs for few long
        sequences) while all of its programs can be resident at once (NARROW_STATE_PROGRAMS_PER_UNIT per SM/CU),
        else `kda_state_wide`. On an H200 at 32-token chunks
        (bench/results/archive/tune-prefill-wide128-nvidia-h200.md) the wide blocks won at 8 x 4K (0.31 ms against
        0.72) and 64 x 512 (0.26 against 0.73), and lost at B=1 (2.60 against 1.47), where the narrow config's 96
        programs all run at once.

        16-bit inputs only: the wide config was swept and checked in bf16, and its float32 tiles would ask for
        more shared memory (the failure class of the fp32 MoE and MLA prefill tiles); float32 keeps kda_state.

        A table entry with segment_chunks keeps it only when some sequence spans at least two segments of that
        many chunks; otherwise the segmented pass would add its map and scan for one segment per sequence. Past
        PREFETCH_CHECKED_CHUNK-token chunks, narrow blocks run without prefetch (see there).
        """
        narrow = kernel_config("kda_state")
        programs = self.num_seqs * self.num_heads * triton.cdiv(self.v_dim, narrow.block_v)
        if self.work_dtype == torch.float32 and not is_interpreted():
            config = narrow
        elif programs > NARROW_STATE_PROGRAMS_PER_UNIT * compute_units(self.q.device):
            config = kernel_config("kda_state_wide")
        else:
            config = narrow
        longest = max((end - start for start, end in zip(self.bounds[:-1], self.bounds[1:])), default=0)
        if config.segment_chunks and triton.cdiv(longest, self.chunk_size) < 2 * config.segment_chunks:
            config = dataclasses.replace(config, segment_chunks=0)
        if prefetch_unchecked(config, self.chunk_size):
            config = dataclasses.replace(config, prefetch=False)
        limit = shared_memory_limit()
        fitted = fit_state_config(config, self.chunk_size, pow2_at_least(self.k_dim), self.work_dtype.itemsize, limit)
        if fitted is None:
            raise ValueError(f"kda_prefill: chunk_size={self.chunk_size} needs more than this GPU's "
                             f"{limit // 1024} KiB of shared memory at any block_v; pass a smaller chunk_size")
        return fitted

    def state(self, config: KernelConfig | None = None) -> None:
        """Pass 2 (sequential over each sequence's chunks): outputs, final states in place, checkpoints.

        config.segment_chunks: the chunks run as segments of at least that many, in parallel
        (`kda_chunk_segments`), each from the state entering it."""
        config = config or self.state_config()
        block_v = min(pow2_at_least(config.block_v), pow2_at_least(self.v_dim))
        if config.segment_chunks:
            self._state_segmented(config, block_v)
        else:
            self._state_kernel(config, block_v, self.num_seqs, self.state_tensor, self.plan.slots, self.has_init,
                               self.plan.seq_chunk)

    def _state_kernel(self, config: KernelConfig, block_v: int, num_seqs: int, state, slots, has_init,
                      seq_chunk) -> None:
        """kda_chunk_state_kernel over `num_seqs` runs of chunks (the sequences, or segments of them)."""
        kda_chunk_state_kernel[(triton.cdiv(self.v_dim, block_v), self.num_heads, num_seqs)](
            self.w, self.u0, self.qg, self.kd, self.aqk, self.decay, self.output, state, state.stride(0), slots,
            has_init, seq_chunk, self.plan.chunk_start, self.plan.chunk_len, self.ckpt_states, self.plan.chunk_ckpt,
            self.scale,
            H=self.num_heads, K=self.k_dim, V=self.v_dim, BT=self.chunk_size, BK=pow2_at_least(self.k_dim),
            BV=block_v, CHECKPOINTS=self.ckpt_states.shape[0] > 0, INTERPRETED=is_interpreted(),
            PRECISION=self._precision(config), PREFETCH=config.prefetch, num_warps=config.num_warps,
            num_stages=config.num_stages)

    def _state_segmented(self, config: KernelConfig, block_v: int) -> None:
        """The three steps of `kda_chunk_segments`: every segment's affine map, the scan over each sequence's
        segments, then the state pass per segment; each sequence's final state is its last segment's."""
        segments = plan_segments(self.host_plan, config.segment_chunks, self.w.device)
        k_dim, v_dim, heads = self.k_dim, self.v_dim, self.num_heads
        block_k = pow2_at_least(k_dim)
        seg_map = torch.empty(segments.num_segments, heads, k_dim, k_dim + v_dim, dtype=torch.float32,
                              device=self.w.device)                       # [T | b] of every segment
        seg_state = torch.empty(segments.num_segments, heads, v_dim, k_dim, dtype=torch.float32,
                                device=self.w.device)                     # the state entering / leaving each
        block_c = min(pow2_at_least(config.block_v), pow2_at_least(k_dim + v_dim))
        kda_segment_map_kernel[(triton.cdiv(k_dim + v_dim, block_c), heads, segments.num_segments)](
            self.w, self.u0, self.kd, self.decay, self.plan.chunk_start, self.plan.chunk_len, segments.seg_chunk,
            seg_map, H=heads, K=k_dim, V=v_dim, BT=self.chunk_size, BK=block_k, BC=block_c,
            INTERPRETED=is_interpreted(), PRECISION=self._precision(config), num_warps=config.num_warps,
            num_stages=config.num_stages)
        kda_segment_scan_kernel[(triton.cdiv(v_dim, block_v), heads, self.num_seqs)](
            seg_map, self.state_tensor, self.state_tensor.stride(0), self.plan.slots, self.has_init,
            segments.seq_seg, seg_state, H=heads, K=k_dim, V=v_dim, BK=block_k, BV=block_v,
            INTERPRETED=is_interpreted(), PRECISION=self._precision(config), num_warps=8)
        self._state_kernel(config, block_v, segments.num_segments, seg_state, segments.seg_slots,
                           segments.seg_has_init, segments.seg_chunk)
        self.state_tensor[self.plan.slots.long()] = seg_state[segments.last_seg.long()]

