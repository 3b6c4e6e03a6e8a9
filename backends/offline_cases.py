"""The op calls a model makes on one GPU, as CPU tensors, for capturing its kernel launches offline.

Every op that a backend registers a Triton provider for has a case here that calls the provider's function with the
per-GPU shapes of a model config (the widths `k3core.model` passes: K3 at TP8 / EP8 holds 12 KDA and 12 MLA heads
and 112 of the 896 experts) at the token counts the engine schedules: prefill chunks of one long sequence, of an
odd length and of many short sequences, with and without cache checkpoints; decode batches from 1 to 256 at long
contexts; MLA pages of 16 (the engine's default) and 64 tokens. Tensors are `torch.empty`: the wrappers only read
shapes, strides, dtypes and the host-side tables, and under `backends.offline.capture` no kernel runs.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from k3core.config import ModelConfig
from k3core.ops import KdaGateParams

PREFILL_BATCHES = ((512,), (8192,), (1000,), (512,) * 16)      # sequence lengths of one prefill step
DECODE_BATCHES = ((1, 131072), (16, 32768), (64, 8192), (256, 4096))   # (sequences, context tokens)
PAGE_SIZES = (16, 64)
CHECKPOINT_INTERVAL = 64                                        # the engine's default cache checkpoint spacing


class ModelShape(NamedTuple):
    """The per-GPU widths of one model under a TP / EP split."""
    name: str
    hidden: int
    kda_heads: int
    head_dim: int
    conv_kernel: int
    mla_heads: int
    qk_dim: int                  # nope + rope
    v_dim: int
    kv_rank: int
    rope_dim: int
    q_lora_rank: int | None
    glu_widths: tuple[int, ...]  # intermediate widths of the dense MLP and the shared experts on this GPU
    num_experts: int             # router width (all experts)
    local_experts: int
    top_k: int
    expert_width: int            # moe_intermediate_size
    latent: int                  # moe_latent_size (or hidden)
    attn_res_slots: int
    lower_bound: float


def model_shape(config: ModelConfig, tp: int = 1, ep: int = 1) -> ModelShape:
    """`config` on one GPU of a tp-way attention split with its experts spread ep ways."""
    def split(n: int, ways: int, what: str) -> int:
        if n % ways:
            raise ValueError(f"{config.name}: {what} = {n} does not split {ways} ways")
        return n // ways
    shared = config.num_shared_experts * config.moe_intermediate_size
    glu = tuple(sorted({split(config.intermediate_size, tp, "intermediate_size")}
                       | ({split(shared, tp, "shared expert width")} if shared else set())))
    return ModelShape(
        name=f"{config.name}" + (f" tp{tp}" if tp > 1 else "") + (f" ep{ep}" if ep > 1 else ""),
        hidden=config.hidden_size, kda_heads=split(config.kda_num_heads, tp, "kda_num_heads"),
        head_dim=config.kda_head_dim, conv_kernel=config.conv_kernel_size,
        mla_heads=split(config.mla_num_heads, tp, "mla_num_heads"),
        qk_dim=config.qk_nope_head_dim + config.qk_rope_head_dim, v_dim=config.v_head_dim,
        kv_rank=config.kv_lora_rank, rope_dim=config.qk_rope_head_dim, q_lora_rank=config.q_lora_rank,
        glu_widths=glu, num_experts=config.num_experts,
        local_experts=split(config.num_experts, ep, "num_experts"), top_k=config.num_experts_per_token,
        expert_width=config.moe_intermediate_size, latent=config.moe_latent_size or config.hidden_size,
        attn_res_slots=config.num_attn_res_blocks if config.attn_res else 0,
        lower_bound=config.kda_gate_lower_bound)


class OpCall(NamedTuple):
    op: str
    label: str                   # the shape it runs at, for the report
    run: Callable[[], object]


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def _cu(lengths: tuple[int, ...]) -> torch.Tensor:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32)


def _batch_label(lengths: tuple[int, ...]) -> str:
    return f"{len(lengths)} x {lengths[0]}" if len(set(lengths)) == 1 and len(lengths) > 1 else f"T={lengths[0]}"


def _token_counts() -> list[tuple[int, str]]:
    prefill = [(sum(lengths), f"prefill {_batch_label(lengths)}") for lengths in PREFILL_BATCHES]
    return prefill + [(batch, f"decode B={batch}") for batch, _ in DECODE_BATCHES]


def op_calls(shape: ModelShape, dtype: torch.dtype, functions: dict[str, Callable]) -> Iterator[OpCall]:
    """One OpCall per (op, shape) for the ops in `functions` (op name -> the provider's function)."""
    builders = {"rms_norm": _rms_norm, "gated_rms_norm": _gated_rms_norm, "glu_activation": _glu,
                "kda_gate": _kda_gate, "short_conv_prefill": _conv_prefill, "short_conv_decode": _conv_decode,
                "kda_prefill": _kda_prefill, "kda_decode": _kda_decode, "mla_prefill": _mla_prefill,
                "mla_decode": _mla_decode, "moe_route": _moe_route, "moe_experts": _moe_experts,
                "moe_experts_mxfp4": _moe_experts_mxfp4, "attn_res_read": _attn_res}
    for op, fn in functions.items():
        if op not in builders:
            raise KeyError(f"no offline case for op {op!r}: add one to backends/offline_cases.py so its launches "
                           f"are compiled")
        yield from builders[op](op, fn, shape, dtype)


def _gate(shape: ModelShape) -> KdaGateParams:
    return KdaGateParams(A_log=torch.zeros(shape.kda_heads), dt_bias=torch.zeros(shape.kda_heads * shape.head_dim),
                         form="lower_bound", lower_bound=shape.lower_bound)


def _rms_norm(op, fn, s: ModelShape, dtype):
    widths = sorted({s.hidden, s.kv_rank, s.latent} | ({s.q_lora_rank} if s.q_lora_rank else set()))
    for tokens, label in _token_counts():
        for width in widths:
            # the latent norm reads kv_a[:, :kv_rank], a view with the wider row stride
            x = (_empty(tokens, s.kv_rank + s.rope_dim, dtype=dtype)[:, :s.kv_rank] if width == s.kv_rank
                 else _empty(tokens, width, dtype=dtype))
            yield OpCall(op, f"{label} D={width}", lambda x=x, width=width: fn(x, _empty(width, dtype=dtype), 1e-5))


def _gated_rms_norm(op, fn, s: ModelShape, dtype):
    for tokens, label in _token_counts():
        heads = (tokens, s.kda_heads, s.head_dim)
        yield OpCall(op, label, lambda heads=heads: fn(_empty(*heads, dtype=dtype), _empty(*heads, dtype=dtype),
                                                      _empty(s.head_dim, dtype=dtype), 1e-5))


def _glu(op, fn, s: ModelShape, dtype):
    for tokens, label in _token_counts():
        for width in s.glu_widths:
            yield OpCall(op, f"{label} I={width}",
                         lambda tokens=tokens, width=width: fn(_empty(tokens, 2 * width, dtype=dtype), "situ", 4.0,
                                                               25.0))


def _kda_gate(op, fn, s: ModelShape, dtype):
    for tokens, label in _token_counts():
        yield OpCall(op, label, lambda tokens=tokens: fn(_empty(tokens, s.kda_heads, s.head_dim, dtype=dtype),
                                                        _gate(s)))


def _channels(s: ModelShape) -> int:
    return 3 * s.kda_heads * s.head_dim


def _conv_prefill(op, fn, s: ModelShape, dtype):
    channels = _channels(s)
    for lengths in PREFILL_BATCHES:
        num_seqs = len(lengths)
        yield OpCall(op, f"prefill {_batch_label(lengths)}", lambda lengths=lengths, num_seqs=num_seqs: fn(
            _empty(sum(lengths), channels, dtype=dtype), torch.empty(channels, s.conv_kernel), _cu(lengths),
            _empty(num_seqs, s.conv_kernel - 1, channels, dtype=dtype), torch.arange(num_seqs),
            torch.ones(num_seqs, dtype=torch.bool)))


def _conv_decode(op, fn, s: ModelShape, dtype):
    channels = _channels(s)
    for batch, _ in DECODE_BATCHES:
        yield OpCall(op, f"decode B={batch}", lambda batch=batch: fn(
            _empty(batch, channels, dtype=dtype), torch.empty(channels, s.conv_kernel),
            _empty(batch, s.conv_kernel - 1, channels, dtype=dtype), torch.arange(batch)))


def _kda_prefill(op, fn, s: ModelShape, dtype):
    heads, dim = s.kda_heads, s.head_dim
    for lengths in PREFILL_BATCHES:
        for checkpoints in (False, True):
            num_seqs, tokens = len(lengths), sum(lengths)
            marks = ([list(range(CHECKPOINT_INTERVAL, n + 1, CHECKPOINT_INTERVAL)) for n in lengths] if checkpoints
                     else None)

            def run(lengths=lengths, num_seqs=num_seqs, tokens=tokens, marks=marks):
                qkv = _empty(tokens, 3 * heads * dim, dtype=dtype)                  # q, k, v: views of the conv out
                q, k, v = (t.reshape(tokens, heads, dim) for t in qkv.chunk(3, dim=-1))
                return fn(q, k, v, _empty(tokens, heads, dim, dtype=dtype), _empty(tokens, heads, dtype=dtype),
                          _gate(s), _cu(lengths), torch.empty(num_seqs, heads, dim, dim), torch.arange(num_seqs),
                          torch.ones(num_seqs, dtype=torch.bool), dim ** -0.5, checkpoint_lengths=marks)
            yield OpCall(op, f"prefill {_batch_label(lengths)}" + (" + checkpoints" if checkpoints else ""), run)


def _kda_decode(op, fn, s: ModelShape, dtype):
    heads, dim = s.kda_heads, s.head_dim
    for batch, _ in DECODE_BATCHES:
        yield OpCall(op, f"decode B={batch}", lambda batch=batch: fn(
            *(_empty(batch, heads, dim, dtype=dtype) for _ in range(4)), _empty(batch, heads, dtype=dtype),
            _gate(s), torch.empty(batch, heads, dim, dim), torch.arange(batch), dim ** -0.5))


def _mla_prefill(op, fn, s: ModelShape, dtype):
    for lengths in PREFILL_BATCHES:
        for prefix in (0, 8192):
            key_lengths = tuple(n + prefix for n in lengths)

            def run(lengths=lengths, key_lengths=key_lengths):
                keys = sum(key_lengths)
                return fn(_empty(sum(lengths), s.mla_heads, s.qk_dim, dtype=dtype),
                          _empty(keys, s.mla_heads, s.qk_dim, dtype=dtype),
                          _empty(keys, s.mla_heads, s.v_dim, dtype=dtype), _cu(lengths), _cu(key_lengths),
                          s.qk_dim ** -0.5)
            yield OpCall(op, f"prefill {_batch_label(lengths)}" + (f" after {prefix} cached" if prefix else ""), run)


def _mla_decode(op, fn, s: ModelShape, dtype):
    latent = s.kv_rank + s.rope_dim
    for batch, context in DECODE_BATCHES:
        for page in PAGE_SIZES:
            pages = -(-context // page)

            def run(batch=batch, context=context, page=page, pages=pages):
                return fn(_empty(batch, s.mla_heads, latent, dtype=dtype), _empty(batch * pages, page, latent,
                                                                                  dtype=dtype),
                          torch.zeros(batch, pages, dtype=torch.int32), torch.full((batch,), context, dtype=torch.int32),
                          s.qk_dim ** -0.5, s.kv_rank)
            yield OpCall(op, f"decode B={batch} ctx={context} page={page}", run)


def _moe_route(op, fn, s: ModelShape, dtype):
    for tokens, label in _token_counts():
        yield OpCall(op, label, lambda tokens=tokens: fn(torch.empty(tokens, s.num_experts),
                                                        torch.zeros(s.num_experts), s.top_k, "sigmoid", True, 1.0))


def _moe_experts(op, fn, s: ModelShape, dtype):
    generator = torch.Generator().manual_seed(0)
    w13 = _empty(s.local_experts, 2 * s.expert_width, s.latent, dtype=dtype)   # never touched: pages stay unmapped
    w2 = _empty(s.local_experts, s.latent, s.expert_width, dtype=dtype)
    for tokens, label in _token_counts():
        def run(tokens=tokens):
            return fn(_empty(tokens, s.latent, dtype=dtype), w13, w2, *_routed(tokens, s, generator), "situ", 4.0,
                      25.0)
        yield OpCall(op, f"{label} ({tokens * s.top_k} routed rows)", run)


def _routed(tokens: int, s: ModelShape, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert_ids) [T, top_k]: distinct local experts per token, spread as a router spreads them."""
    ids = torch.rand(tokens, s.local_experts, generator=generator).argsort(dim=1)[:, :s.top_k]
    return torch.full((tokens, s.top_k), 1.0 / s.top_k), ids


def _moe_experts_mxfp4(op, fn, s: ModelShape, dtype):
    generator = torch.Generator().manual_seed(0)
    experts, width, latent = s.local_experts, s.expert_width, s.latent
    packed = dict(dtype=torch.uint8)
    w13 = (torch.empty(experts, 2 * width, latent // 2, **packed), torch.empty(experts, 2 * width, latent // 32, **packed))
    w2 = (torch.empty(experts, latent, width // 2, **packed), torch.empty(experts, latent, width // 32, **packed))
    for tokens, label in _token_counts():
        def run(tokens=tokens):
            weights, ids = _routed(tokens, s, generator)
            return fn(_empty(tokens, latent, dtype=dtype), *w13, *w2, weights, ids, "situ", 4.0, 25.0)
        yield OpCall(op, f"{label} ({tokens * s.top_k} routed rows)", run)


def _attn_res(op, fn, s: ModelShape, dtype):
    if not s.attn_res_slots:
        return
    for tokens, label in _token_counts():
        for num_valid in sorted({1, s.attn_res_slots // 2, s.attn_res_slots}):
            yield OpCall(op, f"{label} sealed={num_valid}", lambda tokens=tokens, num_valid=num_valid: fn(
                _empty(tokens, s.attn_res_slots, s.hidden, dtype=dtype), num_valid, _empty(tokens, s.hidden, dtype=dtype),
                torch.empty(s.hidden), 1e-5))
