"""`python -m k3core.backends [--backend cuda|rocm|torch|auto] [--model PRESET] [--dtype bf16] [--arch gfx942]`

Prints the provider chosen for every op and every rejected candidate with its reasons (the same selection the
engine makes once at start), then the facts of the device. With `--backend cuda` on a machine without an
NVIDIA GPU every cuda provider is listed as rejected and the torch reference is shown as the fallback.

With `--arch` (gfx942, gfx950, sm_90, sm_100) no GPU is needed: the provider each op would get on that GPU is listed
with the resources of every kernel launch it makes for the model, compiled offline (`backends.offline`).
"""
from __future__ import annotations

import argparse
import sys

import torch

from k3core.backend import NoProviderError, OpSpec, resolve_backend, select_ops
from k3core.config import ConfigError, load_config

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64}


def parse_dtype(text: str) -> torch.dtype:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[text]


def default_device(backend: str) -> torch.device:
    return torch.device("cuda") if backend in ("cuda", "rocm") and torch.cuda.is_available() else torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3core.backends", description=__doc__.split("\n\n")[1])
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "cuda", "rocm"])
    parser.add_argument("--model", default="k3", help="preset name, YAML file, config.json or checkpoint directory")
    parser.add_argument("--dtype", default="bf16", type=parse_dtype, help="activation dtype (bf16, fp16, fp32, fp64)")
    parser.add_argument("--no-fallback", action="store_true",
                        help="fail instead of falling back to the torch reference when no provider can serve an op")
    parser.add_argument("--arch", default="", help="offline: the GPU architecture to compile for (gfx942, gfx950, "
                                                    "sm_90, sm_100); no GPU needed")
    parser.add_argument("--tp", type=int, default=1, help="--arch: the tensor-parallel split of the model's heads")
    parser.add_argument("--ep", type=int, default=1, help="--arch: the expert-parallel split of its experts")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.model)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.arch:
        from backends.offline_report import print_offline_choice  # noqa: PLC0415  (imports triton)
        return print_offline_choice(args.backend, args.arch, config, args.dtype, args.tp, args.ep)
    backend = resolve_backend(args.backend)
    spec = OpSpec(config=config, dtype=args.dtype, device=default_device(backend))
    print(f"model: {config.name}   dtype: {str(args.dtype).removeprefix('torch.')}   device: {spec.device}   "
          f"requested backend: {args.backend}")
    try:
        table = select_ops(backend, spec, fallback_to_reference=not args.no_fallback)
    except NoProviderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(table.describe())
    fallbacks = [c.op for c in table.choices.values() if backend != "torch" and c.provider.startswith("torch.")]
    if fallbacks:
        print(f"fallback to the torch reference for {len(fallbacks)} of {len(table.choices)} ops: "
              f"{', '.join(fallbacks)}")
    from backends.common import device_facts  # noqa: PLC0415  (backends/ imports vendor code lazily itself)
    facts = device_facts()
    print(f"device: {facts.describe() if facts else 'no GPU visible (CPU only)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
