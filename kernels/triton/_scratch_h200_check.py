"""TEMPORARY (deleted before the report): bf16 correctness and timing of the Triton KDA kernels on one GPU."""
import sys, time
import torch, triton
from k3core.ops import KdaGateParams
import kernels.torch.kda as ref
from kernels.triton.kda_prefill import kda_prefill
from kernels.triton.kda_decode import kda_decode
torch.manual_seed(0)
dev = "cuda"
H, K, V = 12, 128, 128

def make(T, dtype):
    q, k, f = (torch.randn(T, H, K, device=dev, dtype=dtype) for _ in range(3))
    v = torch.randn(T, H, V, device=dev, dtype=dtype)
    bl = torch.randn(T, H, device=dev, dtype=dtype)
    return q, k, v, f, bl

for form in ("lower_bound", "softplus"):
    gate = KdaGateParams(torch.randn(H, device=dev) * 0.5, torch.randn(H * K, device=dev), form)
    lens = [1, 15, 63, 64, 65, 1000, 3000]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    T = sum(lens)
    q, k, v, f, bl = make(T, torch.bfloat16)
    st = torch.randn(10, H, V, K, device=dev) * 0.1
    st2 = st.double()
    slots = torch.tensor([1, 3, 5, 7, 9, 0, 2], device=dev)
    hi = torch.tensor([1, 0, 1, 0, 1, 0, 1], dtype=torch.bool, device=dev)
    out = kda_prefill(q, k, v, f, bl, gate, cu, st, slots, hi, K ** -0.5, 128)
    r = ref.kda_prefill(q.double(), k.double(), v.double(), f.double(), bl.double(), gate, cu, st2, slots, hi,
                        K ** -0.5, 128)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    print(f"bf16 {form}: out rel err {rel(out.output, r.output):.2e} max abs {(out.output.double()-r.output).abs().max().item():.2e}"
          f" state rel {rel(st[slots], st2[slots]):.2e} ckpt rel {rel(out.checkpoint_states, r.checkpoint_states):.2e}"
          f" nan {torch.isnan(out.output).any().item()}", flush=True)

gate = KdaGateParams(torch.randn(H, device=dev) * 0.5, torch.randn(H * K, device=dev), "lower_bound")
for T in (32768, 131072):
    q, k, v, f, bl = make(T, torch.bfloat16)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    st = torch.zeros(2, H, V, K, device=dev)
    slots = torch.tensor([0], device=dev); hi = torch.tensor([False], device=dev)
    fn = lambda: kda_prefill(q, k, v, f, bl, gate, cu, st, slots, hi, K ** -0.5, 0)
    ms = triton.testing.do_bench(fn, warmup=3, rep=20)
    print(f"prefill T={T}: {ms:.3f} ms total", flush=True)
    try:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
        for e in prof.key_averages():
            if "kernel" in e.key:
                print(f"   {e.key[:40]:40s} {e.device_time_total/1000:.3f} ms")
    except Exception as exc:
        print("profiler failed", exc)

for B in (64, 512):
    q, k, v, f, bl = make(B, torch.bfloat16)
    st = torch.randn(B + 3, H, V, K, device=dev)
    slots = torch.randperm(B + 3, device=dev)[:B]
    ms = triton.testing.do_bench(lambda: kda_decode(q, k, v, f, bl, gate, st, slots, K ** -0.5), warmup=5, rep=50)
    gbytes = 2 * B * H * V * K * 4 / 1e9
    print(f"decode B={B}: {ms*1000:.1f} us, state traffic {gbytes/ms*1e3:.0f} GB/s", flush=True)
