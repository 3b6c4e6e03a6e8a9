"""k3-mini's graph-replayed decode with MXFP4 routed experts against bf16 experts and against its memory floor.

    python -m bench.moe_mxfp4_model --out bench/results        (GPU; --smoke: k3-tiny on the CPU, eager)

For each expert format the same preset (same seed, so the same weights up to MXFP4 rounding) is built, its decode
step at BS=1 and BS=N (--concurrency) at --context tokens is replayed from a CUDA graph (bench.serving.ceiling's
measurement), and the step is compared with its memory floor: the bytes one decode step must read (every weight but
the routed experts, top-k routed experts per MoE layer in the format held, the lm_head, and at BS=1 one request's
KDA state and MLA pages) over the copy bandwidth measured in the same process. The correctness gate: each format's
model on the measured backend against the torch backend (the reference ops; for MXFP4 the per-call dequantising
reference) on the same weights, one 37-token prompt, relative logit error under conformance.model_check's bf16
tolerance (model_check's bound; its own check routes to all experts, here top-k, so a routing flip fails the gate
rather than passing quietly); a failed gate prints no speed-up.

Where the step goes: the routed-expert op of every MoE layer is also graph-timed alone at each batch size, on that
layer's weights and a random top-k routing (`expert_share`), so each format's step splits into its experts and the
rest (router, attention, shared experts, lm_head, launches). The two rests must agree (the same weights but the
experts); the BS=1 step of MXFP4 with its experts at their packed-byte floor and its rest as measured is what no
expert kernel can beat, and its ratio to the bf16 step is what expert work alone can give k3-mini.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROUTED = ("mlp.experts.w13", "mlp.experts.w2")


def is_routed(name: str) -> bool:
    """A routed expert's weight (the part of the model the expert format changes)."""
    return any(part in name for part in ROUTED)


def decode_weight_bytes(network, config) -> dict:
    """Bytes of the weights one decode token reads: all but the routed experts, plus top_k / num_experts of them,
    and of an untied embedding table the token's one row (the lm_head is read whole)."""
    routed = other = 0
    for name, tensor in network.weights.items():
        size = tensor.numel() * tensor.element_size()
        if is_routed(name):
            routed += size
        elif name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            other += size // config.vocab_size
        else:
            other += size
    per_token_routed = routed * config.num_experts_per_token // max(1, config.num_experts)
    return {"other": other, "routed_all": routed, "routed_top_k": per_token_routed, "total": other + per_token_routed}


def reference_weights(weights: dict) -> dict:
    """The float32 reference's weights: every floating weight in float32 but the routed experts, which stay as held
    (bf16, or packed MXFP4) because the torch reference upcasts (or dequantises) them expert by expert, and a
    bf16-to-float32 upcast is exact, so the reference is the same; a float32 copy of bf16 k3-mini's experts alone is
    63 GB, which with the model itself does not fit an 80 GB GPU."""
    return {name: tensor.float() if tensor.is_floating_point() and not is_routed(name)
            else tensor for name, tensor in weights.items()}


def correctness_gate(llm, prompt: list[int], backend: str, device: torch.device) -> tuple[float, float]:
    """(error, tolerance) of the measured backend's logits against a float32 torch-backend reference on the same
    weights, as conformance.model_check holds them: every expert routed (no top-k flip can move a logit by O(1)),
    and in bf16 a bound of BF16_FACTOR x the torch backend's own bf16 error + BF16_FLOOR."""
    import dataclasses

    from conformance.model_check import BF16_FACTOR, BF16_FLOOR, TOLERANCE, relative_error
    from k3core.backend import OpSpec, select_ops
    from k3core.llm import scratch_forward
    from k3core.model.network import Network
    smooth = dataclasses.replace(llm.config, num_experts_per_token=llm.config.num_experts)

    def logits(ops_backend: str, dtype: torch.dtype, weights: dict) -> torch.Tensor:
        network = Network(smooth, weights, select_ops(ops_backend, OpSpec(smooth, dtype, device)))
        return network.forward(*scratch_forward(smooth, prompt, dtype, device)).float()

    weights = llm.network.weights
    measured = logits(backend, llm.dtype, weights)
    reference = logits("torch", torch.float32, reference_weights(weights))
    error = relative_error(measured, reference)
    if llm.dtype == torch.float32:
        return error, TOLERANCE["float32"]
    return error, BF16_FACTOR * relative_error(logits("torch", llm.dtype, weights), reference) + BF16_FLOOR


def expert_share(llm, batch_sizes: list[int], device: torch.device) -> dict:
    """ms of one decode step's routed-expert ops (every MoE layer's `RoutedExperts.forward` on its own weights, a
    random top-k routing of distinct experts, the latent-width x) at each batch size, graph-timed alone: the part
    of the step the expert format changes. CPU (smoke): a host-clock plumbing check, not a measurement."""
    from bench.timing import Timer
    config, network = llm.config, llm.network
    layers = [layer.mlp.experts for layer in network.layers if hasattr(layer.mlp, "experts")]
    width = config.moe_latent_size or config.hidden_size
    top_k = config.num_experts_per_token
    generator = torch.Generator().manual_seed(1)
    timer = Timer(device)
    out = {}
    for rows in batch_sizes:
        inputs = []
        for experts in layers:
            x = torch.randn(rows, width, generator=generator).to(device, llm.dtype)
            ids = torch.rand(rows, experts.num_experts, generator=generator).topk(top_k, dim=-1).indices
            weights = torch.rand(rows, top_k, generator=generator)
            inputs.append((experts, x, weights.to(device), ids.to(device)))

        def step(inputs=inputs):
            for experts, x, weights, ids in inputs:
                experts.forward(network.ops, x, weights, ids, 0)
        timing = timer.time_graph([step])
        out[f"experts_ms_bs{rows}"] = timing.ms
    out["moe_layers"] = len(layers)
    out["timing"] = timing.method
    return out


def copy_bandwidth(device: torch.device) -> float:
    """Read + write bytes per second of a 1 GiB device copy (the roofline's memory ceiling)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * src.numel() * src.element_size() * 20 / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    from bench import serving
    from bench.model_bench import sequence_state_bytes
    from k3core import LLM
    parser = argparse.ArgumentParser(prog="python -m bench.moe_mxfp4_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="k3-mini")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.model, args.concurrency, args.context = "k3-tiny", 2, 24
    backend, dtype = ("cuda", "bfloat16") if device.type == "cuda" else ("torch", "float32")
    bandwidth = copy_bandwidth(device)
    prompt = list(range(3, 40))
    import triton

    from bench.report import device_slug
    from k3core.provenance import commit_under_test, tuning_overrides
    meta = {"torch": torch.__version__, "triton": triton.__version__, "commit": commit_under_test(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **tuning_overrides()}
    result = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "meta": meta, "copy_bytes_per_s": bandwidth, "formats": {}}
    tokens = {}
    batch_sizes = sorted({1, args.concurrency})         # serving.ceiling's too
    for fmt in ("bf16", "mxfp4"):
        options = dict(memory_fraction=0.05) if device.type == "cuda" else dict(memory_bytes=128 << 20)
        llm = LLM(args.model, backend=backend, device=str(device), dtype=dtype, seed=0, expert_format=fmt,
                  **options)
        from k3core.sampling_params import SamplingParams
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        tokens[fmt] = llm.generate([prompt], greedy)[0].token_ids
        error, tolerance = correctness_gate(llm, prompt, backend, device)
        ns = SimpleNamespace(concurrency=args.concurrency, input_len=args.context, backend=backend,
                             long_prompt=64 if args.smoke else 1024, chunk=64 if args.smoke else 1024,
                             smoke=args.smoke)
        ceiling = serving.ceiling(llm, ns, device)
        weights = decode_weight_bytes(llm.network, llm.config)
        state = sequence_state_bytes(llm.engine.pool.layout, args.context)
        share = expert_share(llm, batch_sizes, device)
        row = {"decode_step_ms_bs1": ceiling["decode_step_ms_bs1"],
               f"decode_step_ms_bs{args.concurrency}": ceiling[f"decode_step_ms_bs{args.concurrency}"],
               "weight_bytes": weights, "state_bytes_bs1": state,
               "gate": {"relative_logit_error": error, "tolerance": tolerance, "passed": error < tolerance},
               "experts": share}
        for rows in batch_sizes:
            share[f"rest_ms_bs{rows}"] = ceiling[f"decode_step_ms_bs{rows}"] - share[f"experts_ms_bs{rows}"]
        if device.type == "cuda":
            floor_bytes = weights["total"] + state["kda_state"] + state["mla_kv"]
            floor_ms = floor_bytes / bandwidth * 1e3          # read at the copy's DRAM rate (its reads + writes)
            row["floor_ms_bs1"] = floor_ms
            row["floor_share_bs1"] = floor_ms / ceiling["decode_step_ms_bs1"]
            share["floor_ms_bs1"] = weights["routed_top_k"] / bandwidth * 1e3
        result["formats"][fmt] = row
        llm.engine.close()                  # its pool and graphs go before the next format's model is built
        del llm
        import gc
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bf16, mx = result["formats"]["bf16"], result["formats"]["mxfp4"]
    result["greedy_tokens"] = tokens       # for the record: MXFP4 rounding may flip near-ties of random weights
    key = f"decode_step_ms_bs{args.concurrency}"
    if bf16["gate"]["passed"] and mx["gate"]["passed"]:
        result["speedup_bs1"] = bf16["decode_step_ms_bs1"] / mx["decode_step_ms_bs1"]
        result[f"speedup_bs{args.concurrency}"] = bf16[key] / mx[key]
        if "floor_ms_bs1" in mx["experts"]:     # what expert kernels alone could give: MXFP4's rest as measured
            best = mx["experts"]["rest_ms_bs1"] + mx["experts"]["floor_ms_bs1"]
            result["speedup_bs1_experts_at_floor"] = bf16["decode_step_ms_bs1"] / best
    else:
        result["speedup"] = "not reported: a correctness gate failed (see formats.*.gate)"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "moe-mxfp4-model-" + ("smoke" if args.smoke else device_slug(device, smoke=False))
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "formats"}, indent=1, default=str))
    for fmt, row in result["formats"].items():
        print(fmt, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                    if k not in ("weight_bytes", "state_bytes_bs1", "experts")},
              "weights read per token:", row["weight_bytes"]["total"])
        print(f"  {fmt} experts:", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row["experts"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
