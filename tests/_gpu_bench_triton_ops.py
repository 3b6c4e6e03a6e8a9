"""Temporary GPU check (not collected by pytest): bf16 speed and accuracy of the Triton ops on one GPU."""
import math, sys, time
import torch, triton
from triton.testing import do_bench
from kernels.triton import attn_res, mla_decode, mla_prefill, moe_experts, moe_route, norm
from kernels.torch import mla as ref_mla, moe as ref_moe, attn_res as ref_attn_res

torch.manual_seed(0)
dev = "cuda"
bf = torch.bfloat16
def bw(nbytes, ms): return nbytes / ms / 1e9  # TB/s
x = torch.empty(2 * 1024**3 // 2, dtype=bf, device=dev)
copy_ms = do_bench(lambda: x.clone()); copy_bw = bw(2 * x.numel() * 2, copy_ms); del x
print(f"copy bandwidth {copy_bw:.2f} TB/s", flush=True)

which = sys.argv[1:] or ["norm", "attn_res", "prefill", "decode", "route", "moe"]
if "norm" in which:
    t = torch.randn(8192, 7168, device=dev, dtype=bf); w = torch.randn(7168, device=dev, dtype=bf)
    ms = do_bench(lambda: norm.rms_norm(t, w, 1e-5))
    print(f"rms_norm 8192x7168: {ms*1e3:.1f} us, {bw(2*t.numel()*2, ms):.2f} TB/s = {bw(2*t.numel()*2, ms)/copy_bw:.0%} of copy", flush=True)
if "attn_res" in which:
    T, D = 8192, 7168
    bank = torch.randn(T, 8, D, device=dev, dtype=bf); live = torch.randn(T, D, device=dev, dtype=bf)
    q = torch.randn(D, device=dev) * 0.05
    out = attn_res.attn_res_read(bank, 8, live, q, 1e-5)
    ref = ref_attn_res.attn_res_read(bank, 8, live, q, 1e-5)
    ms = do_bench(lambda: attn_res.attn_res_read(bank, 8, live, q, 1e-5))
    nbytes = T * D * 2 * 10
    print(f"attn_res T={T} D={D} 9 cand: err {(out.float()-ref.float()).abs().max():.3e}, {ms*1e3:.1f} us, "
          f"{bw(nbytes, ms):.2f} TB/s = {bw(nbytes, ms)/copy_bw:.0%} of copy", flush=True)
if "prefill" in which:
    H, Dqk, Dv = 96, 192, 128
    for B, L in [(1, 8192), (4, 4096)]:
        q = torch.randn(B * L, H, Dqk, device=dev, dtype=bf); k = torch.randn_like(q); v = torch.randn(B * L, H, Dv, device=dev, dtype=bf)
        cu = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * L
        scale = Dqk ** -0.5
        out = mla_prefill.mla_prefill(q, k, v, cu, cu, scale)
        qs, ks, vs = (t.view(B, L, H, -1).transpose(1, 2) for t in (q, k, v))
        from torch.nn.attention import sdpa_kernel, SDPBackend
        res = {}
        for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
            try:
                with sdpa_kernel(backend):
                    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
                    res[name] = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
                    err = (out.view(B, L, H, Dv).transpose(1, 2).float() - ref.float()).abs().max().item()
            except Exception as e:
                res[name] = f"n/a ({str(e)[:60]})"
        ms = do_bench(lambda: mla_prefill.mla_prefill(q, k, v, cu, cu, scale))
        flops = B * H * (L * L / 2) * 2 * (Dqk + Dv)
        print(f"mla_prefill B={B} L={L} H={H}: err vs sdpa {err:.3e}; triton {ms:.3f} ms {flops/ms/1e9:.0f} TFLOP/s; sdpa {res}", flush=True)
        for name, t in res.items():
            if isinstance(t, float): print(f"   ratio vs {name}: {t/ms:.0%}")
if "decode" in which:
    latent, vdim, page = 576, 512, 64
    for B, L, H in [(1, 131072, 96), (1, 131072, 16), (64, 4096, 96), (128, 2048, 16)]:
        pages = B * L // page
        kv = torch.randn(pages, page, latent, device=dev, dtype=bf)
        table = torch.randperm(pages, device=dev).to(torch.int32).view(B, L // page)
        seq = torch.full((B,), L, device=dev, dtype=torch.int32)
        q = torch.randn(B, H, latent, device=dev, dtype=bf)
        scale = 192 ** -0.5
        r = mla_decode.mla_decode(q, kv, table, seq, scale, vdim)
        if B * L <= 262144:
            e = ref_mla.mla_decode(q, kv, table, seq, scale, vdim)
            err = ((r.output.float() - e.output.float()).abs().max().item(), (r.lse - e.lse).abs().max().item())
        else:
            err = None
        ms = do_bench(lambda: mla_decode.mla_decode(q, kv, table, seq, scale, vdim))
        nbytes = B * L * latent * 2
        print(f"mla_decode B={B} L={L} H={H}: err(out, lse) {err}; {ms*1e3:.1f} us, {bw(nbytes, ms):.2f} TB/s = {bw(nbytes, ms)/copy_bw:.0%} of copy", flush=True)
if "route" in which:
    logits = torch.randn(4096, 896, device=dev); bias = torch.randn(896, device=dev) * 0.1
    r = moe_route.moe_route(logits, bias, 16, "sigmoid", True, 1.0); e = ref_moe.moe_route(logits, bias, 16, "sigmoid", True, 1.0)
    print(f"moe_route ids equal: {torch.equal(r.expert_ids, e.expert_ids)}, w err {(r.weights-e.weights).abs().max():.2e}, "
          f"{do_bench(lambda: moe_route.moe_route(logits, bias, 16, 'sigmoid', True, 1.0))*1e3:.1f} us (torch {do_bench(lambda: ref_moe.moe_route(logits, bias, 16, 'sigmoid', True, 1.0))*1e3:.1f} us)", flush=True)
if "moe" in which:
    D, I, E, k = 3584, 3072, 64, 8
    w13 = torch.randn(E, 2 * I, D, device=dev, dtype=bf) * D ** -0.5; w2 = torch.randn(E, D, I, device=dev, dtype=bf) * I ** -0.5
    for T in [64, 4096]:
        x = torch.randn(T, D, device=dev, dtype=bf)
        ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices; wts = torch.rand(T, k, device=dev)
        out = moe_experts.moe_experts(x, w13, w2, wts, ids, "situ", 4.0, 25.0)
        ref = ref_moe.moe_experts(x, w13, w2, wts, ids, "situ", 4.0, 25.0)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        ms = do_bench(lambda: moe_experts.moe_experts(x, w13, w2, wts, ids, "situ", 4.0, 25.0))
        ms_ref = do_bench(lambda: ref_moe.moe_experts(x, w13, w2, wts, ids, "situ", 4.0, 25.0))
        flops = 2 * T * k * 3 * D * I
        wbytes = min(E, T * k) * 3 * D * I * 2
        print(f"moe_experts T={T} E={E} k={k}: rel err {err:.2e}; triton {ms:.3f} ms {flops/ms/1e9:.0f} TFLOP/s "
              f"{bw(wbytes, ms):.2f} TB/s weights; torch loop {ms_ref:.3f} ms", flush=True)
