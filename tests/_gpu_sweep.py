import sys, torch, triton
from triton.testing import do_bench
from kernels.triton import attn_res, mla_decode
from kernels.triton.tuning_ops import AttentionConfig
dev = "cuda"; bf = torch.bfloat16
# attn_res identity debug
live = torch.randn(1, 64, device=dev); bank = torch.randn(1, 9, 64, device=dev); q = torch.randn(64, device=dev) * 0.3
o = attn_res.attn_res_read(bank, 0, live, q, 1e-5)
print("attn_res identity ratio", (o / live).flatten()[:4].tolist(), flush=True)
T, D = 8192, 7168
bank = torch.randn(T, 8, D, device=dev, dtype=bf); live = torch.randn(T, D, device=dev, dtype=bf); q = torch.randn(D, device=dev) * 0.05
ms = do_bench(lambda: attn_res.attn_res_read(bank, 8, live, q, 1e-5)); print(f"attn_res {T*D*2*10/ms/1e9:.2f} TB/s", flush=True)
latent, vdim, page = 576, 512, 64
for B, L, H in [(1, 131072, 96), (1, 131072, 16), (64, 4096, 96), (128, 2048, 16)]:
    pages = B * L // page
    kv = torch.randn(pages, page, latent, device=dev, dtype=bf)
    table = torch.randperm(pages, device=dev).to(torch.int32).view(B, L // page)
    seq = torch.full((B,), L, device=dev, dtype=torch.int32)
    qd = torch.randn(B, H, latent, device=dev, dtype=bf)
    base = mla_decode.mla_decode_with_splits(qd, kv, table, seq, 0.07, vdim, 1, AttentionConfig(16, 32, 4, 1)).output.float()
    best = []
    for bh, bn, nw, ns in [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 8, 2), (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 1), (16, 32, 4, 3), (32, 32, 4, 2), (16, 16, 4, 3)]:
        for per_sm in [2, 4, 8]:
            hb = triton.cdiv(H, bh)
            splits = max(1, min(triton.cdiv(per_sm * 132, B * hb), triton.cdiv(L, 4 * bn)))
            cfg = AttentionConfig(bh, bn, nw, ns)
            try:
                out = mla_decode.mla_decode_with_splits(qd, kv, table, seq, 0.07, vdim, splits, cfg).output.float()
                err = (out - base).abs().max().item()
                ms = do_bench(lambda: mla_decode.mla_decode_with_splits(qd, kv, table, seq, 0.07, vdim, splits, cfg), warmup=10, rep=30)
                best.append((B * L * latent * 2 / ms / 1e9, cfg, per_sm, splits, err))
            except Exception as e:
                print("fail", cfg, str(e)[:80], flush=True)
    best.sort(key=lambda r: -r[0])
    print(f"decode B={B} L={L} H={H}", flush=True)
    for r in best[:5]: print(f"   {r[0]:.2f} TB/s {r[1]} per_sm={r[2]} splits={r[3]} err={r[4]:.1e}", flush=True)
