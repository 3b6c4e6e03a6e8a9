"""Model-level conformance: the whole network through a backend vs the torch references.

`python -m conformance.model_check --backend cuda --device cuda --report PATH` builds k3-tiny twice with the same
random weights, once on the torch backend in float32 on the CPU (the reference) and once on the chosen backend
and device in each dtype, and compares full-sequence logits (prompts of 1, 63 and 200 tokens) and 16-token
greedy continuations through the engine (chunked prefill, recurrent decode, paged MLA). Writes PATH.json/.md.

`--expert-format mxfp4` runs the same check on a K3-format checkpoint whose routed experts are stored as the
published K3 stores them (MXFP4 `weight_packed` + `weight_scale`, compressed-tensors `quantization_config`): the
loader keeps them packed, the backend runs its MXFP4 expert kernels, and the torch reference dequantises per call.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone

import torch



def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |got - expected| over the largest |expected| logit, in float64 on the CPU."""
    got, expected = got.double().cpu(), expected.double().cpu()
    return float((got - expected).abs().max() / expected.abs().max())

# Relative max logit error allowed, per dtype of the backend run, against the float32 CPU reference:
TOLERANCE = {
    # float32 kernels: Triton's float32 tl.dot may run as tf32 (10-bit mantissa) on NVIDIA; through 10 layers
    # that stays around 1e-3 of the largest logit, while a wrong kernel is off by O(1).
    "float32": 5e-3,
}
# On a random tiny MoE a rounding difference flips top-k expert choices and the logits jump by O(1) (measured on
# k3-tiny in bf16 on the torch backend: 1 % off float32 after layer 0, 36 % after layer 2). The check therefore
# runs k3-tiny with every expert selected (top-k = num_experts): routing weights stay continuous, nothing flips.
# bfloat16 is then held to the torch backend's own bf16 run: its error against the float32 reference may be at
# most twice the torch bf16 error (measured 4-32 % on this model: it grows with the prompt length), plus 1e-2;
# a wrong kernel is off by O(1).
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-2


def smooth_routing_model(preset: str, directory: str) -> str:
    """A YAML copy of the preset with every expert selected, so that rounding cannot flip expert choices."""
    import os

    import yaml

    from k3core.config import PRESET_DIR
    with open(PRESET_DIR / f"{preset}.yaml") as handle:
        data = yaml.safe_load(handle)
    data["num_experts_per_token"] = data["num_experts"]
    path = os.path.join(directory, f"{preset}-all-experts.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(data, handle)
    return path


PROMPT_LENGTHS = (1, 63, 200)
GREEDY_TOKENS = 16
EXPERT_FORMATS = ("bf16", "mxfp4")


def mxfp4_checkpoint(model: str, directory: str) -> str:
    """`model` (a YAML config) written to `directory` as a K3-format checkpoint with MXFP4 routed experts (random
    weights, seed 11, drawn on the CPU): both sides of the check load the same bytes from the files."""
    from k3core.config import ModelConfig
    from k3core.model.checkpoint_writer import save_k3_checkpoint
    from k3core.model.weights import init_random_weights
    config = ModelConfig.from_yaml(model)
    save_k3_checkpoint(init_random_weights(config, seed=11), config, directory, mxfp4_experts=True)
    return directory


def _versions() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.now(timezone.utc).isoformat()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    from k3core.provenance import commit_under_test, tuning_overrides
    info["commit"] = commit_under_test()
    info.update(tuning_overrides())
    return info


def run(backend: str, device: str, dtypes: list[str], preset: str = "k3-tiny", expert_format: str = "bf16") -> dict:
    import os
    import tempfile

    from k3core import LLM, SamplingParams
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, got {expert_format!r}")
    model = smooth_routing_model(preset, tempfile.mkdtemp())
    if expert_format == "mxfp4":
        model = mxfp4_checkpoint(model, os.path.join(os.path.dirname(model), "mxfp4-checkpoint"))
    generator = torch.Generator().manual_seed(int(time.time()))
    # The reference runs the torch references on the SAME device: preset weights are drawn with that device's
    # generator, so a CPU reference would hold other weights than a GPU run of the same seed.
    reference = LLM(model, backend="torch", device=device, dtype="float32", seed=11, prefix_cache=False,
                    memory_bytes=256 << 20)
    prompts = [torch.randint(0, reference.config.vocab_size, (n,), generator=generator).tolist()
               for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    ref_tokens = [o.token_ids for o in reference.generate(prompts, params)]
    ref_logits = [reference.prompt_logits(p) for p in prompts]
    torch_bf16 = None
    if "bfloat16" in dtypes:
        bf16 = LLM(model, backend="torch", device=device, dtype="bfloat16", seed=11, prefix_cache=False,
                   memory_bytes=256 << 20)
        torch_bf16 = max(relative_error(bf16.prompt_logits(p), ref) for p, ref in zip(prompts, ref_logits))
    results = []
    for dtype in dtypes:
        start = time.perf_counter()
        llm = LLM(model, backend=backend, device=device, dtype=dtype, seed=11, prefix_cache=False,
                  memory_bytes=256 << 20)
        rows = []
        for prompt, ref in zip(prompts, ref_logits):
            got = llm.prompt_logits(prompt)
            agreement = float((got.argmax(-1).cpu() == ref.argmax(-1).cpu()).double().mean())
            rows.append({"prompt_len": len(prompt), "relative_error": relative_error(got, ref),
                         "greedy_agreement": agreement})
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        worst = max(r["relative_error"] for r in rows)
        same_tokens = tokens == ref_tokens
        tolerance = TOLERANCE.get(dtype) or BF16_FACTOR * (torch_bf16 or 0.0) + BF16_FLOOR
        passed = worst <= tolerance
        results.append({"dtype": dtype, "providers": {op: c.provider for op, c in llm.ops.choices.items()},
                        "logits": rows, "worst_relative_error": worst, "tolerance": tolerance,
                        "torch_backend_bf16_error": torch_bf16,
                        "greedy_tokens_identical": same_tokens, "passed": passed,
                        "seconds": time.perf_counter() - start})
    described = f"{preset} with top-k = all experts" + (", MXFP4 experts from a K3-format checkpoint"
                                                         if expert_format == "mxfp4" else "")
    return {"model": described, "expert_format": expert_format, "backend": backend, "device": device,
            "versions": _versions(), "results": results}


def write_report(report: dict, path: str) -> None:
    with open(path + ".json", "w") as handle:
        json.dump(report, handle, indent=1)
    v = report["versions"]
    lines = [f"# Model-level conformance: {report['model']} on {report['backend']} ({report['device']})", "",
             f"device {v.get('device', 'cpu')}, torch {v['torch']}, triton {v['triton']}, commit {v['commit']}, "
             f"{v['date']}", "",
             "| dtype | worst relative logit error | tolerance | greedy 16 tokens identical | passed |",
             "|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['dtype']} | {r['worst_relative_error']:.2e} | {r['tolerance']:.2g} | "
                     f"{r['greedy_tokens_identical']} | {'yes' if r['passed'] else 'NO'} |")
    with open(path + ".md", "w") as handle:
        handle.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.model_check", description=__doc__)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32,bfloat16")
    parser.add_argument("--report", default="conformance-model")
    parser.add_argument("--expert-format", default="bf16", choices=EXPERT_FORMATS,
                        help="mxfp4: the model as a K3-format checkpoint with MXFP4 routed experts")
    args = parser.parse_args(argv)
    report = run(args.backend, args.device, args.dtype.split(","), expert_format=args.expert_format)
    write_report(report, args.report)
    for r in report["results"]:
        print(f"{args.backend} {r['dtype']}: worst relative logit error {r['worst_relative_error']:.2e} "
              f"(tolerance {r['tolerance']:.2g}), greedy identical {r['greedy_tokens_identical']}, "
              f"{'PASSED' if r['passed'] else 'FAILED'}")
    return 0 if all(r["passed"] for r in report["results"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
