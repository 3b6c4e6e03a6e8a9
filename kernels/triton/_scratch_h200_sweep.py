"""TEMPORARY (deleted before the report): precision/warps sweep of the KDA intra kernel, bf16 accuracy, timing."""
import dataclasses
import torch, triton
from torch.profiler import profile, ProfilerActivity
from k3core.ops import KdaGateParams
import kernels.torch.kda as ref
import kernels.triton.tuning as tuning
from kernels.triton.kda_prefill import kda_prefill
torch.manual_seed(0)
dev = "cuda"; H, K, V = 12, 128, 128
def make(T, scale_k=1.0):
    q, k, f = (torch.randn(T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(3))
    # correlated keys (a shared direction) make the triangular system ill-conditioned, like real conv'd keys
    k = (k + scale_k * torch.randn(1, H, K, device=dev, dtype=torch.bfloat16) * 3).to(torch.bfloat16)
    v = torch.randn(T, H, V, device=dev, dtype=torch.bfloat16); bl = torch.randn(T, H, device=dev, dtype=torch.bfloat16) + 2
    return q, k, v, f, bl
gate = KdaGateParams(torch.randn(H, device=dev) * 0.5 - 2, torch.randn(H * K, device=dev), "lower_bound")
base_i = tuning._NVIDIA["kda_intra"]
lens = [1, 63, 65, 3000]; Tacc = sum(lens)
cu_acc = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
acc_in = make(Tacc)
slots_a = torch.tensor([0, 1, 2, 3], device=dev); hi_a = torch.tensor([0, 1, 0, 1], dtype=torch.bool, device=dev)
st0 = torch.randn(4, H, V, K, device=dev) * 0.1
st_ref = st0.double()
r = ref.kda_prefill(*(t.double() for t in acc_in), gate, cu_acc, st_ref, slots_a, hi_a, K ** -0.5, 0)
T = 32768; cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
big = make(T)
st = torch.zeros(2, H, V, K, device=dev); slots = torch.tensor([0], device=dev); hi = torch.tensor([False], device=dev)
fn = lambda: kda_prefill(*big, gate, cu, st, slots, hi, K ** -0.5, 0)
def kernel_times():
    fn(); fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3): fn()
        torch.cuda.synchronize()
    return {e.key[:16]: round(e.device_time_total / 3000, 3) for e in prof.key_averages() if "kda_chunk" in e.key}
st_a = st0.clone()
out = kda_prefill(*acc_in, gate, cu_acc, st_a, slots_a, hi_a, K ** -0.5, 0)
print("default config bf16 out rel", ((out.output.double() - r.output).norm() / r.output.norm()).item(),
      "state rel", ((st_a.double() - st_ref).norm() / st_ref.norm()).item(), "kernels", kernel_times(), flush=True)
try:
    from fla.ops.kda import chunk_kda
    A_log = gate.A_log.float(); dt_bias = gate.dt_bias.float()
    for T3 in (32768, 131072):
        q, k, v, f, bl = make(T3)
        cu = torch.tensor([0, T3], dtype=torch.int32, device=dev)
        st = torch.zeros(2, H, V, K, device=dev)
        ours = lambda: kda_prefill(q, k, v, f, bl, gate, cu, st, slots, hi, K ** -0.5, 0)
        with torch.inference_mode():
            theirs = lambda: chunk_kda(q[None], k[None], v[None], f[None], bl[None], scale=K ** -0.5,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                       use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                       A_log=A_log, dt_bias=dt_bias, state_v_first=True)
            o_fla, s_fla = theirs()
            o_ours = ours().output
            d = ((o_fla[0].float() - o_ours.float()).norm() / o_fla.float().norm()).item()
            sd = ((s_fla[0].float() - st[0]).norm() / s_fla.float().norm()).item()
            t_fla = triton.testing.do_bench(theirs, warmup=3, rep=20)
        t_ours = triton.testing.do_bench(ours, warmup=3, rep=20)
        print(f"T={T3}: fla chunk_kda {t_fla:.3f} ms, k3core {t_ours:.3f} ms, ratio fla/ours {t_fla/t_ours:.2f}; "
              f"out rel diff {d:.2e} state rel diff {sd:.2e}", flush=True)
except Exception as exc:
    import traceback; traceback.print_exc()
