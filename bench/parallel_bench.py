"""Parallel plans on several GPUs over NCCL: tokens identical to one GPU, then prefill and decode speed.

    python -m bench.parallel_bench --out DIR                 # on a 2-GPU machine (scripts/gpu.sh parallel)
    python -m bench.parallel_bench --smoke --out DIR         # CPU processes over gloo, k3-tiny: plumbing only

Sections, each written to DIR as soon as it finishes (a later timeout keeps the earlier ones):
1. correctness: k3-tiny, float32, the cuda backend. Every 2-rank plan (tp2, pp2, tp2+dcp2, dcp2 alone, tp2+ep2,
   dcp2+ep2) generates greedily from prompts that cross pages, chunks and checkpoints; tokens must equal one GPU's
   and logits agree within LOGIT_RTOL. The same again in bfloat16 is reported (token agreement, logit error) but
   not gated: bf16 sums in another order can flip a near-tie of a random model.
2. speed (only when 1 passed): k3-mini, bfloat16, the cuda backend, on 1 GPU and under tp2, pp2 and tp2+dcp2.
   * prefill tokens/s of one 8K and one 32K prompt (time to the first token, prefix cache off);
   * exposed communication per 1K prefill tokens: the same 8K prefill with the plan's collectives replaced by
     no-ops of the same shapes (outputs meaningless, used only for this timing); for PP the difference also holds
     the pipeline's fill and drain, since without the receive a stage no longer waits for the one before;
   * decode tokens/s of DECODE_BATCH requests at DECODE_CONTEXT tokens of context, and how many tokens of MLA KV
     one GiB holds per GPU under the plan (DCP splits it; TP replicates the latent).
Random preset weights are drawn on each rank's GPU with the same seed, so every rank and the 1-GPU reference hold
the same numbers before sharding.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.parallel_speed import SMOKE, dist_setup, random_prompts, speed
from k3core.parallel.launch import spawn
from k3core.parallel.plan import ParallelPlan

LOGIT_RTOL = 1e-4       # float32 under a plan vs one GPU: reduction order only (tests/test_parallel.py argues it)
CORRECTNESS_PLANS = {
    "tp2": ParallelPlan(tp=2), "pp2": ParallelPlan(pp=2), "tp2+dcp2": ParallelPlan(tp=2, dcp=2),
    "dcp2": ParallelPlan(dcp=2), "tp2+ep2": ParallelPlan(tp=2, ep=2), "dcp2+ep2": ParallelPlan(dcp=2, ep=2),
}
# prefix cache on (its pages and checkpoints are part of what a plan must get right); flushed before the leak check
CORRECTNESS_ENGINE = dict(page_size=16, checkpoint_interval=32, chunked_prefill_tokens=96, memory_bytes=256 << 20)


# ---- 1. correctness ----------------------------------------------------------------------------------------------
def _generate_with_logits(llm, prompts, max_tokens: int):
    from k3core import SamplingParams
    seen: dict[str, list[torch.Tensor]] = {}
    original = llm.engine._append_token

    def spy(request, token_id, logits):
        if logits is not None:
            seen.setdefault(request.request_id, []).append(logits.float().cpu())
        return original(request, token_id, logits)

    llm.engine._append_token = spy
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs], [torch.stack(seen[o.request_id]) if o.request_id in seen else None
                                         for o in outs]


def _correctness_world(rank: int, plan: ParallelPlan, device, model: str, backend: str, dtypes: list[str],
                       plans: dict, engine: dict):
    """Every plan of the 2-rank world in one process per rank (one CUDA/NCCL start-up, not one per plan); rank 0
    also runs the 1-GPU reference. Returns {dtype: (reference, {plan: this rank's result or error})}."""
    from k3core import LLM
    out = {}
    for dtype in dtypes:
        reference = None
        if rank == 0:
            single = LLM(model, backend=backend, device=str(device), dtype=dtype, seed=7, **engine)
            reference = _run(single)
            del single
        results = {}
        for name, each in plans.items():
            llm = LLM(model, backend=backend, device=str(device), dtype=dtype, seed=7, plan=each, rank=rank, **engine)
            results[name] = _run(llm)
            del llm
        out[dtype] = (reference, results)
    return out


def _run(llm):
    prompts = random_prompts((300, 1, 17, 97), llm.config.vocab_size, seed=3)
    tokens, logits = _generate_with_logits(llm, prompts, max_tokens=8)
    llm.flush_cache()                        # what the radix cache still holds is not a leak; anything else is
    usage = llm.memory_usage()
    return tokens, logits, usage.kda_bytes + usage.mla_bytes


def _compare(results, reference) -> dict:
    ref_tokens, ref_logits, _ = reference
    same_tokens, worst, leaked = True, 0.0, 0
    for tokens, logits, bytes_in_use in results:
        same_tokens &= tokens == ref_tokens
        leaked = max(leaked, bytes_in_use)
        for got, expected, seq, ref in zip(logits, ref_logits, tokens, ref_tokens):
            if got is None:
                continue                         # earlier pipeline stages have no logits
            # row i of the logits chose token i; rows after the first differing token see other inputs
            first_diff = next((i for i, (a, b) in enumerate(zip(seq, ref)) if a != b), len(ref))
            rows = min(len(got), len(expected), first_diff + 1)
            error = ((got[:rows] - expected[:rows]).abs().max() / expected[:rows].abs().max()).item()
            worst = max(worst, error)
    last_tokens = results[-1][0]                 # the last rank is on the last stage: it has every token
    agree = sum(a == b for seq, ref in zip(last_tokens, ref_tokens) for a, b in zip(seq, ref))
    total = sum(len(ref) for ref in ref_tokens)
    return dict(tokens_identical=same_tokens, token_agreement=f"{agree}/{total}", worst_logit_rel_err=worst,
                leaked_bytes=leaked)


def correctness(setup_device: str, backend: str, smoke: bool, log) -> dict:
    model = "k3-tiny"
    dtypes = ["float32"] if smoke else ["float32", "bfloat16"]
    plans = dict(list(CORRECTNESS_PLANS.items())[:2]) if smoke else CORRECTNESS_PLANS
    engine = {**SMOKE["engine"], "prefix_cache": True} if smoke else CORRECTNESS_ENGINE
    section: dict = {"model": model, "backend": backend, "gate_dtype": "float32", "logit_rtol": LOGIT_RTOL,
                     "plans": {}}
    started = time.perf_counter()
    try:
        ranks = spawn(_correctness_world, ParallelPlan(tp=2), args=(model, backend, dtypes, plans, engine),
                      setup=dist_setup(setup_device), timeout_s=400)
    except Exception as exc:
        section["error"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
        section["all_passed"] = False
        log(f"correctness FAILED to run: {section['error']}")
        return section
    for dtype in dtypes:
        reference = ranks[0][dtype][0]
        for name in plans:
            row = _compare([r[dtype][1][name] for r in ranks], reference)
            gated = dtype == "float32"
            row["passed"] = (row["tokens_identical"] and row["worst_logit_rel_err"] <= LOGIT_RTOL
                             and row["leaked_bytes"] == 0) if gated else None
            section["plans"][f"{name} {dtype}"] = row
            log(f"correctness {name:9s} {dtype:9s} " + ", ".join(f"{k}={v}" for k, v in row.items()))
    section["seconds"] = round(time.perf_counter() - started, 1)
    section["all_passed"] = all(row["passed"] for row in section["plans"].values() if row["passed"] is not None)
    return section


# ---- driver -----------------------------------------------------------------------------------------------------
def _environment(smoke: bool) -> dict:
    from bench.report import environment
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    env = environment(device, smoke)
    env["gpus"] = str(torch.cuda.device_count()) if torch.cuda.is_available() else "0"
    env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    return env


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Parallel plans over {'gloo (smoke)' if env.get('smoke') == 'True' else 'NCCL'} "
             f"({env.get('device', '?')}, {env.get('gpus')} GPUs)", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}, NCCL {env.get('nccl')}, commit "
             f"{env.get('commit')}, {env.get('date')}.", ""]
    corr = report.get("correctness")
    if corr and corr.get("commit") and corr["commit"] != env.get("commit"):
        lines += [f"The correctness section is from an earlier run at commit {corr['commit']} ({corr.get('date')}), "
                  "on the same kind of machine; the speed section is from the run above.", ""]
    if corr and "error" in corr:
        lines += ["## Tokens and logits against one GPU: FAILED to run", "", "```", corr["error"], "```", ""]
    elif corr:
        lines += [f"## Tokens and logits against one GPU ({corr['model']}, {corr['backend']} backend)", "",
                  f"float32 is gated: tokens identical, logits within {corr['logit_rtol']:.0e} relative, no state "
                  "left in the pool after the radix cache is flushed; bfloat16 is reported only (a random k3-tiny has "
                  "near-flat logits, so bf16 rounding in another order can flip a greedy token). Logit errors cover "
                  "the rows up to the first differing token.", "",
                  "| plan | dtype | tokens identical | token agreement | worst logit rel err | passed | note |",
                  "|---|---|---|---|---|---|---|"]
        for key, row in corr["plans"].items():
            name, dtype = key.split(" ")
            lines.append(f"| {name} | {dtype} | {row.get('tokens_identical')} | {row.get('token_agreement', '-')} | "
                         f"{row.get('worst_logit_rel_err', float('nan')):.2e} | "
                         f"{'-' if row['passed'] is None else row['passed']} | {row.get('error', '')[:120]} |")
        lines.append("")
    spd = report.get("speed")
    if spd:
        lens = [k.split("_")[1] for k in next((r for r in spd["plans"].values() if "error" not in r), {})
                if k.startswith("prefill_") and k.endswith("_tok_s")]
        d = spd["decode"]
        lines += [f"## Speed ({spd['model']}, {spd['dtype']}, {spd['backend']} backend)", "",
                  "| plan | GPUs | " + " | ".join(f"prefill {n} tok/s" for n in lens)
                  + f" | exposed comm ms / 1K prefill tok | decode tok/s ({d['batch']} x {d['context']}) | "
                  "MLA KV tokens per GiB per GPU | weights GiB per GPU |",
                  "|---|---|" + "---|" * len(lens) + "---|---|---|---|"]
        for name, row in spd["plans"].items():
            if "error" in row:
                lines.append(f"| {name} | - | " + " | ".join("-" for _ in lens) + f" | FAILED: {row['error'][:150]} |"
                             " | | |")
                continue
            exposed = row.get("exposed_comm_ms_per_1k_prefill_tokens")
            decode = f"{row['decode_tok_s']:.0f}" + (f" ({row['decode_note']})" if "decode_note" in row else "")
            lines.append(f"| {name} | {row['gpus']} | " + " | ".join(f"{row[f'prefill_{n}_tok_s']:.0f}" for n in lens)
                         + f" | {'-' if exposed is None else f'{exposed:.2f}'} | {decode} | "
                         f"{row.get('kv_tokens_per_gib', '-')} | {row.get('weights_gib', '-')} |")
        lines += ["", "Exposed communication = prefill time with the plan's collectives minus the same prefill with "
                  "them replaced by no-ops of the same shapes; for pp2 it includes the pipeline's fill and drain. "
                  "Decode tok/s = requests / seconds per all-decode engine step (host scheduling included). "
                  "Prefill = time to the first token of one prompt (prefix cache off), best of 2 at 8K, 1 at 32K.", ""]
        for name, row in spd["plans"].items():
            if "tp2" in spd["plans"] and name != "tp2" and "error" not in row and "error" not in spd["plans"]["tp2"]:
                tp = spd["plans"]["tp2"]
                ratios = ", ".join(f"prefill {n}: {row[f'prefill_{n}_tok_s'] / tp[f'prefill_{n}_tok_s']:.2f}x"
                                   for n in lens)
                decode = (f"{row['decode_tok_s'] / tp['decode_tok_s']:.2f}x" if tp["decode_tok_s"] > 0
                          else "- (tp2 decoded nothing in the timed steps)")
                lines.append(f"- {name} vs tp2: {ratios}, decode {decode}")
    if report.get("notes"):
        lines += ["", "## Reading the numbers", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--smoke", action="store_true", help="CPU processes over gloo, k3-tiny, tiny lengths")
    parser.add_argument("--sections", default="correctness,speed")
    parser.add_argument("--plans", default="", help="speed plans to run (default all): 1gpu,tp2,pp2,tp2+dcp2")
    parser.add_argument("--force-speed", action="store_true", help="time even when correctness failed")
    args = parser.parse_args(argv)
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)    # never NVLink multicast on shared hosts (children inherit this)
    if not args.smoke and torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 GPUs, {torch.cuda.device_count()} visible; pass --smoke for the CPU plumbing run")
    setup_device, backend = ("cpu", "torch") if args.smoke else ("cuda", "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "parallel-smoke" if args.smoke else "parallel-nvidia-h200x2"
    report: dict = {"environment": _environment(args.smoke)}

    def log(line: str) -> None:
        print(line, flush=True)

    def write() -> None:
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
        (out / f"{stem}.md").write_text(markdown(report))

    sections = args.sections.split(",")
    if "correctness" in sections:
        report["correctness"] = correctness(setup_device, backend, args.smoke, log)
        write()
    if "speed" in sections:
        if report.get("correctness", {"all_passed": True})["all_passed"] or args.force_speed:
            report["speed"] = {}
            for _ in speed(setup_device, backend, args.smoke, log, [p for p in args.plans.split(",") if p] or None,
                           report["speed"]):
                write()
        else:
            log("speed skipped: the correctness section failed (pass --force-speed to time anyway)")
        write()
    print(markdown(report))
    print(f"wrote {out / stem}.json and .md")
    return 0 if report.get("correctness", {"all_passed": True})["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
