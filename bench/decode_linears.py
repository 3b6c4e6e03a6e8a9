"""k3-mini's decode projections that read the same input, one GEMM each (as the model ran them before they were
fused) against the one GEMM of their rows the model runs, at BS=1 and BS=64: what the fusion takes off a decode step.

    python -m bench.decode_linears [--model k3-mini] [--out DIR]        (GPU; --smoke: k3-tiny on the CPU)

Per layer type, the projections of one input (KDA: q, k, v, the gate's f_a, beta's b and the output gate g; MLA:
q_a, kv_a and the output gate; MoE: the LatentMoE down projection and the shared experts' gate/up) get random bf16
weights of the model's shapes, one set per layer, so that a graph over all layers reads every weight from DRAM as the
decode step does. Each variant's graph is timed; fused outputs are checked against the separate GEMMs' (the same
products, summed in an order cuBLAS may choose differently) before any time is printed. A third variant pads the
fused rows with zero rows to a multiple of PAD_ROWS (its "of copy" counts the unpadded bytes): whether cuBLAS's
choice for an awkward row count (KDA's 6284 ran as a gemv kernel at 66% of copy) is worth padding away.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.report import environment
from bench.timing import Timer, measure_ceilings
from k3core.config import load_config
from k3core.model.held import FUSED_ROW_MULTIPLE

BATCHES = (1, 64)
PAD_ROWS = FUSED_ROW_MULTIPLE     # the padded variant rounds the fused rows up to a multiple of the model's


def groups(config) -> dict[str, tuple[int, list[int]]]:
    """Layer type -> (layers of that type, output rows of each projection reading the layer's input)."""
    kda = config.kda_num_heads * config.kda_head_dim
    mla_q = config.q_lora_rank or config.mla_num_heads * config.qk_head_dim
    mla = [mla_q, config.mla_latent_width] + ([config.mla_num_heads * config.v_head_dim]
                                              if config.mla_output_gate else [])
    moe = []
    if config.moe_latent_size is not None:
        moe.append(config.expert_width)
    if config.num_shared_experts:
        moe.append(2 * config.moe_intermediate_size * config.num_shared_experts)
    gate = [kda] if config.kda_output_gate == "full_rank" else [config.kda_head_dim]
    return {"kda": (len(config.kda_layer_ids), [3 * kda, config.kda_head_dim, config.kda_num_heads, *gate]),
            "mla": (len(config.mla_layer_ids), mla),
            "moe": (config.mlp_types.count("moe"), moe)}


def measure(config, device: torch.device, timer: Timer, copy_tbps: float) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(0)
    hidden, rows_out = config.hidden_size, []
    for kind, (layers, outs) in groups(config).items():
        if layers == 0 or len(outs) < 2:
            continue
        fused = [torch.randn(sum(outs), hidden, generator=generator, device=device).to(torch.bfloat16) * 0.02
                 for _ in range(layers)]
        parts = [list(w.split(outs)) for w in fused]                  # views: the same bytes, read separately
        pad = -sum(outs) % PAD_ROWS
        padded = [torch.cat([w, w.new_zeros(pad, hidden)]) for w in fused] if pad else fused
        weight_bytes = sum(outs) * hidden * 2 * layers
        for batch in BATCHES:
            x = torch.randn(batch, hidden, generator=generator, device=device).to(torch.bfloat16)
            separate = [torch.cat([F.linear(x, p) for p in layer], dim=-1) for layer in parts]
            joined = [F.linear(x, w) for w in fused]
            joined_padded = [F.linear(x, w)[:, : sum(outs)] for w in padded]
            error = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                        for a, b in zip(separate + separate, joined + joined_padded))
            row = {"layer": kind, "layers": layers, "rows": outs, "batch": batch, "weight_bytes": weight_bytes,
                   "max_relative_difference": error, "checked": error < 2e-2}
            if row["checked"]:
                variants = {"separate": [p for layer in parts for p in layer], "fused": fused, "padded": padded}
                for name, matrices in variants.items():
                    def run(matrices=matrices, x=x):
                        for w in matrices:
                            F.linear(x, w)
                    timing = timer.time_graph([run], min_calls=1)
                    row[f"{name}_ms"] = timing.ms
                    row[f"{name}_of_copy"] = weight_bytes / (timing.ms * 1e-3) / (copy_tbps * 1e12)
                row["padded_rows"] = sum(outs) + pad
                row["timing"] = timing.method
                row["saved_ms"] = row["separate_ms"] - row["fused_ms"]
            rows_out.append(row)
            print(_line(row), flush=True)
    return rows_out


def _line(row: dict) -> str:
    head = f"{row['layer']:4s} x{row['layers']:<3d} rows {row['rows']} BS={row['batch']:<3d}"
    if not row["checked"]:
        return f"{head} CHECK FAILED: fused differs by {row['max_relative_difference']:.2e}; not timed"
    return (f"{head} separate {row['separate_ms']:.3f} ms ({100 * row['separate_of_copy']:.0f}% of copy)  fused "
            f"{row['fused_ms']:.3f} ms ({100 * row['fused_of_copy']:.0f}%)  saved {row['saved_ms']:.3f} ms; fused with "
            f"rows padded to {row['padded_rows']}: {row['padded_ms']:.3f} ms ({100 * row['padded_of_copy']:.0f}%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_linears", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="k3-mini")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--smoke", action="store_true", help="k3-tiny on the CPU (host clock: not a measurement)")
    args = parser.parse_args(argv)
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    model = "k3-tiny" if smoke else args.model
    config, timer = load_config(model), Timer(device)
    env = environment(device, smoke)
    ceilings = measure_ceilings(timer, torch.bfloat16, smoke)
    with torch.inference_mode():
        rows = measure(config, device, timer, ceilings.copy_tbps)
    result = {"model": model, "environment": env, "copy_tbps": ceilings.copy_tbps, "rows": rows}
    for batch in BATCHES:
        done = [r for r in rows if r["batch"] == batch and r["checked"]]
        result[f"saved_ms_bs{batch}"] = sum(r["saved_ms"] for r in done)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode-linears-{model}-{env['device_slug']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"per decode step, fusing saves {result['saved_ms_bs1']:.3f} ms at BS=1 and "
          f"{result['saved_ms_bs64']:.3f} ms at BS=64 ({path})")
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
