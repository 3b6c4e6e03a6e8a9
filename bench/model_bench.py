"""Whole-model benchmark: one model on one GPU, the cuda backend beside the torch backend.

    python -m bench.model_bench --model k3-mini [--out DIR]
    TRITON_INTERPRET=1 python -m bench.model_bench --smoke      # k3-tiny on the CPU, no graphs: plumbing only

Random bf16 weights from the preset, one model in one process; the op table is swapped between backends.
1. Correctness gate (nothing is timed unless it passes): logits of a 63-token prompt on each backend against a
   float32 torch-backend reference of the same weights, held to conformance/model_check.py's bf16 tolerance,
   with every expert selected (top-k = all) as model_check does, so rounding cannot flip a routing choice; then
   one decode step replayed from a CUDA graph against the same step run eagerly.
2. (a) BS=1 decode at 1K context, eager and graph-replayed, against its memory floor: the bytes one token reads
   (weights without the routed experts, top-k routed experts per MoE layer, the lm_head, KDA state and conv tail
   read and written, the MLA latents of the context) over the measured copy bandwidth (bench/timing.py).
   (b) prefill of one 8K prompt, chunked as the engine chunks it (k3core.engine.default_prefill_budget).
   (c) decode with 64 concurrent requests at 8K context, graph-replayed for cuda.
   They run (b), (c), (a): after (a)'s timings its graph's kernels are ranked by time (tools.tune.kernel_profile),
   and a profiler session slows what comes after it.
Decode cost does not depend on what the state holds, so (a) and (c) fill the KDA states and MLA pages with random
values instead of prefilling them. The torch backend runs eagerly only: its moe_experts reference reads the
per-expert counts on the host (`.tolist()`), which no graph can capture.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from bench.context import make_context
from bench.report import environment
from bench.timing import measure_ceilings
from conformance.model_check import BF16_FACTOR, BF16_FLOOR, TOLERANCE, relative_error
from k3core.backend import OpSpec, select_ops
from k3core.config import load_config
from k3core.engine import default_prefill_budget
from k3core.llm import scratch_forward
from k3core.memory import PoolLayout, UnifiedPool
from k3core.model.batch import SeqWork, build_forward_batch
from k3core.model.graph_decode import GraphDecode
from k3core.model.held import held_kind
from k3core.model.network import Network
from k3core.model.weights import expected_tensors, init_random_weights
from tools.tune.kernel_profile import markdown as kernel_profile_markdown
from tools.tune.kernel_profile import profile_kernels

PAGE_SIZE = 16
GRAPH_REPLAY_TOL = 1e-3       # same kernels on the same inputs; cuBLAS may pick another algorithm under capture
TORCH_PREFILL_BUDGET_S = 60   # the torch backend prefills 8K only if a 2K measurement projects under this
SIZES = {False: {"gate_prompt": 63, "short_context": 1024, "prefill_len": 8192, "torch_prefill_fallback": 2048,
                 "batch": 64, "batch_context": 8192},
         True: {"gate_prompt": 20, "short_context": 40, "prefill_len": 36, "torch_prefill_fallback": 18, "batch": 2,
                "batch_context": 36}}        # the Triton interpreter runs k3-tiny at a few tokens per second
START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_host(device: torch.device, fn, iters: int, warmup: int = 1) -> float:
    """Milliseconds per call on a host clock around device syncs (for calls far longer than launch jitter)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / iters


# ---- memory floor ------------------------------------------------------------------------------------------
def decode_bytes_per_token(config, dtype: torch.dtype, layout: PoolLayout, context_len: int) -> dict:
    """Bytes one decode token must move at BS=1: every weight it reads once, and its sequence state."""
    weights = 0
    for name, spec in expected_tensors(config).items():
        size = math.prod(spec.shape) * (4 if held_kind(name, spec) == "fp32" else dtype.itemsize)   # as held
        if name.endswith(("mlp.experts.w13", "mlp.experts.w2")):
            size = size // config.num_experts * config.num_experts_per_token     # top-k experts of this layer
        elif name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            size = size // config.vocab_size                                     # one embedding row
        weights += size
    state = sequence_state_bytes(layout, context_len)
    return {"weights": weights, **state, "total": weights + state["kda_state"] + state["mla_kv"]}


def sequence_state_bytes(layout: PoolLayout, context_len: int) -> dict:
    """Bytes of one request's state a decode token moves: its KDA state and conv tails read and written, its MLA
    context read and one latent written."""
    kda = layout.num_kda_layers * 2 * (layout.state_layer_bytes + layout.conv_layer_bytes)   # read + write
    latent_bytes = layout.latent_width * layout.kv_dtype.itemsize
    mla = layout.num_mla_layers * (context_len + 1) * latent_bytes               # read the context, write one
    return {"kda_state": kda, "mla_kv": mla}


# ---- pools filled with random state ------------------------------------------------------------------------
def make_pool(config, dtype: torch.dtype, device: torch.device, num_seqs: int, context_len: int):
    """A pool with `num_seqs` sequences of `context_len` cached tokens (room for the next one) and the decode
    graphs' scratch slot and page; returns (pool, [(slot handle, page positions)])."""
    layout = PoolLayout.from_config(config, page_size=PAGE_SIZE, kv_dtype=dtype, conv_dtype=dtype)
    pages_per_seq = -(-(context_len + 1) // PAGE_SIZE)
    slot_pages = -(-(num_seqs + 1) * layout.slot_bytes // layout.page_bytes)
    pool = UnifiedPool(layout, (slot_pages + num_seqs * pages_per_seq + 1) * layout.page_bytes, device=device)
    sequences = []
    for _ in range(num_seqs):
        slot = pool.alloc_slot()
        sequences.append((slot, pool.page_positions(pool.alloc_pages(pages_per_seq))))
    return pool, sequences


def fill_random(pool, sequences, generator: torch.Generator) -> None:
    """Random KDA states, conv tails and MLA latents for every sequence (decode cost does not depend on them)."""
    device = pool.device
    slots = torch.tensor([pool.slot_position(s) for s, _ in sequences], device=device)
    pages = torch.cat([p for _, p in sequences]).long().to(device)
    for layer in range(pool.layout.num_kda_layers):
        for view, scale in ((pool.kda_state(layer), 0.05), (pool.conv_state(layer), 1.0)):
            values = torch.randn((len(slots), *view.shape[1:]), generator=generator, device=device) * scale
            view[slots] = values.to(view.dtype)
    for layer in range(pool.layout.num_mla_layers):
        view = pool.mla_kv(layer)
        view[pages] = torch.randn((len(pages), *view.shape[1:]), generator=generator, device=device).to(view.dtype)


def decode_work(pool, sequences, context_len: int, token_id: int = 1) -> list[SeqWork]:
    return [SeqWork([token_id], context_len, pool.slot_position(slot), pages) for slot, pages in sequences]


def graph_runner_of(backend: str):
    return importlib.import_module(f"backends.{backend}").graph_runner


# ---- 1. correctness gate -----------------------------------------------------------------------------------
def correctness_gate(config, weights: dict, ops: dict, dtype: torch.dtype, device: torch.device, smoke: bool,
                     generator: torch.Generator, prompt_len: int) -> dict:
    """Both backends against a float32 reference of the same weights (cast in place to `dtype` afterwards)."""
    smooth = dataclasses.replace(config, num_experts_per_token=config.num_experts)
    prompt = torch.randint(0, config.vocab_size, (prompt_len,),
                           generator=torch.Generator().manual_seed(int(generator.initial_seed()))).tolist()
    reference_ops = select_ops("torch", OpSpec(config, torch.float32, device))
    network = Network(smooth, weights, reference_ops)
    reference = network.forward(*scratch_forward(smooth, prompt, torch.float32, device)).clone()
    del network
    kinds = expected_tensors(config)
    for name, value in weights.items():                  # the bf16 model holds exactly the rounded fp32 weights
        if kinds[name].kind != "fp32":
            weights[name] = value.to(dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    network = Network(smooth, weights, ops["torch"])
    errors = {}
    for backend in ("torch", "cuda"):
        network.ops = ops[backend]
        errors[backend] = relative_error(network.forward(*scratch_forward(smooth, prompt, dtype, device)), reference)
    dtype_name = str(dtype).removeprefix("torch.")
    tolerance = TOLERANCE.get(dtype_name) or BF16_FACTOR * errors["torch"] + BF16_FLOOR
    gate = {"prompt_len": prompt_len, "routing": f"top-k = all {config.num_experts} experts (model_check)",
            "cuda_error_vs_fp32": errors["cuda"], "torch_error_vs_fp32": errors["torch"], "tolerance": tolerance,
            "logits_passed": errors["cuda"] <= tolerance}
    progress(f"gate: cuda {errors['cuda']:.2e}, torch {errors['torch']:.2e} vs float32 (tolerance "
             f"{tolerance:.2e}): {'passed' if gate['logits_passed'] else 'FAILED'}")
    network.ops = ops["cuda"]
    gate.update(_graph_replay_check(smooth, network, prompt, dtype, device, smoke))
    gate["passed"] = gate["logits_passed"] and gate["graph_passed"] is not False
    del network
    return gate


def _graph_replay_check(config, network, prompt: list[int], dtype, device, smoke: bool) -> dict:
    """One decode step after the prompt: graph replay against the same step run eagerly (cuda backend)."""
    if smoke:
        return {"graph_passed": None, "graph_note": "no CUDA graphs on the CPU (smoke run)"}
    pool, sequences = make_pool(config, dtype, device, 1, len(prompt) + 1)
    (slot, pages), = sequences
    pool.zero_slot(slot)
    network.forward(build_forward_batch([SeqWork(prompt, 0, pool.slot_position(slot), pages)], PAGE_SIZE, device),
                    pool)
    work = [SeqWork([prompt[0]], len(prompt), pool.slot_position(slot), pages)]
    graph = GraphDecode(network, pool, max_context=len(prompt) + 1, buckets=[1, 4])
    after_prompt = pool.arena.clone()
    eager = graph.run_eager(work).clone()
    pool.arena.copy_(after_prompt)
    graph.capture(graph_runner_of("cuda"))
    pool.arena.copy_(after_prompt)
    replayed = graph.run(work).clone()
    error = relative_error(replayed, eager)
    progress(f"gate: graph replay vs eager decode step {error:.2e} (tolerance {GRAPH_REPLAY_TOL:.0e})")
    graph.close()
    return {"graph_error_vs_eager": error, "graph_tolerance": GRAPH_REPLAY_TOL,
            "graph_passed": error <= GRAPH_REPLAY_TOL}


# ---- 2. timings --------------------------------------------------------------------------------------------
def bench_decode(ctx, network, ops: dict, config, num_seqs: int, context_len: int, generator, rows: list,
                 floor_ms: float | None = None, profiles: dict | None = None) -> None:
    """Eager and graph-replayed decode steps of `num_seqs` sequences; with `profiles`, the replayed step's kernels
    are also ranked by time (tools.tune.kernel_profile) under the row's label."""
    pool, sequences = make_pool(config, ctx.dtype, ctx.device, num_seqs, context_len)
    fill_random(pool, sequences, generator)
    work = decode_work(pool, sequences, context_len)
    graph = GraphDecode(network, pool, max_context=context_len + 1, buckets=[num_seqs])
    inputs = [t.to(ctx.device) for t in graph.pack(work, num_seqs)]
    label = f"decode BS={num_seqs} at {context_len} context"
    for backend in ("cuda", "torch"):
        network.ops = ops[backend]
        modes = ["eager"] + (["graph"] if backend == "cuda" and not ctx.smoke else [])
        for mode in modes:
            if mode == "eager" and ctx.smoke:
                ms = time_host(ctx.device, lambda: graph.step(*inputs), iters=1, warmup=0)
            elif mode == "eager":
                ms = ctx.timer.time(lambda: graph.step(*inputs)).ms
            else:
                graph.capture(graph_runner_of(backend))
                graph.run(work)                                   # loads the static inputs once
                replay = graph.runner.graphs[num_seqs].graph.replay
                ms = ctx.timer.time(replay).ms
            row = {"what": label, "backend": backend, "mode": mode, "ms": ms, "tokens_per_s": num_seqs / ms * 1e3}
            if floor_ms is not None:
                row["floor_ms"], row["percent_of_floor"] = floor_ms, 100 * floor_ms / ms
            rows.append(row)
            progress(f"{label}: {backend} {mode} {ms:.3f} ms/step ({row['tokens_per_s']:.1f} tok/s)")
    if ctx.smoke:
        rows.append({"what": label, "backend": "cuda", "mode": "graph", "ms": None,
                     "note": "not run: no CUDA graphs on the CPU (smoke run)"})
    elif profiles is not None:
        # after every timing: a profiler session leaves CUPTI hooks that slow later host-bound launches (on the
        # H200, eager steps and prefill ran ~1.5x slower after it)
        graph_ms = next(r["ms"] for r in rows if r["what"] == label and r["mode"] == "graph")
        profiles[f"{label}, cuda graph"] = profile_kernels(graph.runner.graphs[num_seqs].graph.replay, ctx.device,
                                                           steps=20, step_ms=graph_ms, top=40)
    graph.close()


def bench_prefill(ctx, network, ops: dict, config, sizes: dict, rows: list) -> None:
    chunk = default_prefill_budget(ctx.device)
    for backend in ("cuda", "torch"):
        network.ops = ops[backend]
        length, note = sizes["prefill_len"], f"chunks of {chunk} tokens, as the engine schedules them"
        if backend == "torch":
            probe = _prefill_ms(ctx, network, config, sizes["torch_prefill_fallback"], chunk, iters=1)
            projected_s = probe * (length / sizes["torch_prefill_fallback"]) ** 2 / 1e3  # attention grows ~T^2
            if projected_s > TORCH_PREFILL_BUDGET_S:
                length = sizes["torch_prefill_fallback"]
                note += f"; {sizes['prefill_len']} tokens projected {projected_s:.0f} s, so {length} tokens instead"
        iters = 1 if (backend == "torch" or ctx.smoke) else 3
        ms = _prefill_ms(ctx, network, config, length, chunk, iters)
        rows.append({"what": f"prefill one {length}-token prompt", "backend": backend, "mode": "eager", "ms": ms,
                     "tokens_per_s": length / ms * 1e3, "note": note})
        progress(f"prefill {length}: {backend} {ms:.1f} ms ({length / ms * 1e3:.0f} tok/s)")


def _prefill_ms(ctx, network, config, length: int, chunk: int, iters: int) -> float:
    pool, ((slot, pages),) = make_pool(config, ctx.dtype, ctx.device, 1, length)
    prompt = torch.randint(0, config.vocab_size, (length,), generator=ctx.generator).tolist()

    def prefill() -> None:
        pool.zero_slot(slot)
        position = pool.slot_position(slot)
        for start in range(0, length, chunk):
            end = min(length, start + chunk)
            work = SeqWork(prompt[start:end], start, position, pages, "last" if end == length else "none")
            network.forward(build_forward_batch([work], PAGE_SIZE, ctx.device), pool)

    return time_host(ctx.device, prefill, iters, warmup=0 if ctx.smoke else 1)


# ---- report ------------------------------------------------------------------------------------------------
def speedups(rows: list) -> list[dict]:
    """cuda (best mode) over torch eager for each measurement."""
    out = []
    for what in dict.fromkeys(r["what"] for r in rows):
        cuda = [r for r in rows if r["what"] == what and r["backend"] == "cuda" and r.get("ms")]
        torch_rows = [r for r in rows if r["what"] == what and r["backend"] == "torch" and r.get("ms")]
        if cuda and torch_rows:      # prefill rows of different lengths have different `what`: no ratio
            best = min(cuda, key=lambda r: r["ms"])
            out.append({"what": what, "cuda_mode": best["mode"], "speedup": torch_rows[0]["ms"] / best["ms"]})
    return out


def write_results(result: dict, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"model-{result['model']}-{result['environment']['device_slug']}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=1))
    md_path.write_text(markdown(result) + "\n")
    return json_path, md_path


def markdown(result: dict) -> str:
    env, gate = result["environment"], result["gate"]
    header = (f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, "
              f"{env['date']}; copy ceiling {result['ceilings']['copy_tbps']:.2f} TB/s")
    gate_line = (f"Gate ({gate['routing']}, {gate['prompt_len']}-token prompt): cuda {gate['cuda_error_vs_fp32']:.2e}, "
                 f"torch {gate['torch_error_vs_fp32']:.2e} vs float32, tolerance {gate['tolerance']:.2e}; graph "
                 f"replay vs eager: {gate.get('graph_error_vs_eager', gate.get('graph_note'))}; "
                 f"{'PASSED' if gate['passed'] else 'FAILED: no timings'}")
    lines = [f"# Whole-model benchmark: {result['model']} ({result['dtype']}, random weights)", "", header, "",
             gate_line, ""]
    if result["rows"]:
        lines += ["| measurement | backend | mode | ms | tok/s | % of memory floor | note |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            ms = "-" if r.get("ms") is None else f"{r['ms']:.3f}"
            rate = "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.1f}"
            floor = "-" if r.get("percent_of_floor") is None else f"{r['percent_of_floor']:.0f}%"
            lines.append(f"| {r['what']} | {r['backend']} | {r['mode']} | {ms} | {rate} | {floor} | "
                         f"{r.get('note', '')} |")
        lines += ["", "| measurement | cuda over torch |", "|---|---|"]
        lines += [f"| {s['what']} | {s['speedup']:.1f}x ({s['cuda_mode']}) |" for s in result["speedups"]]
    for title, profile in result.get("profiles", {}).items():
        lines += ["", *kernel_profile_markdown(profile, f"Where the time goes, {title}")]
    lines += ["", "Notes: " + " ".join(result["notes"])]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.model_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="k3-mini")
    parser.add_argument("--smoke", action="store_true", help="k3-tiny in float32 on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--out", default="", help="results folder (default $OUT, else bench/results)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke runs the Triton kernels on the CPU and needs TRITON_INTERPRET=1 set before Python "
                         "starts: run `TRITON_INTERPRET=1 python -m bench.model_bench --smoke`")
    ctx = make_context(args.smoke, args.seed)
    model = "k3-tiny" if args.smoke else args.model
    sizes = SIZES[args.smoke]
    env = environment(ctx.device, args.smoke)
    progress(f"model bench: {model} on {env['device']}, torch {env['torch']}, triton {env['triton']}, "
             f"commit {env['commit']}")
    config = load_config(model)
    device_generator = torch.Generator(device=ctx.device).manual_seed(args.seed)
    notes = [("Decode rows fill KDA states and MLA pages with random values instead of prefilling (decode cost "
              "does not depend on content)."),
             ("The torch backend runs eagerly only: its moe_experts reference reads per-expert counts on the host, "
              "which a graph cannot capture."),
             "Graph rows time the replay alone (inputs already in the static buffers)."]
    if args.smoke:
        notes.append("Smoke run: k3-tiny, float32, CPU, Triton interpreter, no CUDA graphs; times mean nothing.")
    result = {"model": model, "dtype": str(ctx.dtype).removeprefix("torch."), "environment": env, "rows": [],
              "speedups": [], "notes": notes}
    out_dir = Path(args.out or os.environ.get("OUT") or Path(__file__).parent / "results")
    with torch.inference_mode():
        ceilings = measure_ceilings(ctx.timer, ctx.dtype, args.smoke)
        result["ceilings"] = dataclasses.asdict(ceilings)
        progress(f"copy ceiling {ceilings.copy_tbps:.2f} TB/s")
        weights = init_random_weights(config, seed=args.seed, dtype=torch.float32, device=ctx.device)
        ops = {b: select_ops(b, OpSpec(config, ctx.dtype, ctx.device)) for b in ("cuda", "torch")}
        result["providers"] = {b: {op: c.provider for op, c in table.choices.items()} for b, table in ops.items()}
        progress("weights built (float32 for the gate's reference)")
        result["gate"] = correctness_gate(config, weights, ops, ctx.dtype, ctx.device, args.smoke, device_generator,
                                           sizes["gate_prompt"])
        if not result["gate"]["passed"]:
            write_results(result, out_dir)
            print(markdown(result))
            return result
        network = Network(config, weights, ops["cuda"])
        rows = result["rows"]
        layout = PoolLayout.from_config(config, page_size=PAGE_SIZE, kv_dtype=ctx.dtype, conv_dtype=ctx.dtype)
        floor_bytes = decode_bytes_per_token(config, ctx.dtype, layout, sizes["short_context"])
        floor_ms = floor_bytes["total"] / (ceilings.copy_tbps * 1e12) * 1e3
        result["memory_floor"] = {**floor_bytes, "ms": floor_ms, "context": sizes["short_context"]}
        progress(f"BS=1 memory floor: {floor_bytes['total'] / 1e9:.2f} GB per token -> {floor_ms:.3f} ms")
        result["profiles"] = {}
        bench_prefill(ctx, network, ops, config, sizes, rows)
        write_results(result, out_dir)
        bench_decode(ctx, network, ops, config, sizes["batch"], sizes["batch_context"], device_generator, rows)
        write_results(result, out_dir)
        # last, because its kernel profile (after its timings) slows whatever runs after it
        bench_decode(ctx, network, ops, config, 1, sizes["short_context"], device_generator, rows, floor_ms,
                     profiles=result["profiles"])
        result["speedups"] = speedups(rows)
    json_path, md_path = write_results(result, out_dir)
    print(f"wrote {json_path} and {md_path}")
    print(markdown(result))
    return result


def main(argv: list[str] | None = None) -> int:
    return 0 if run(argv)["gate"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
