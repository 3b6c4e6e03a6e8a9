"""`python -m k3core.generate --model k3-demo --prompt "def add(a, b):"`: print a completion."""
from __future__ import annotations

import argparse
import sys

from k3core.config import list_checkpoint_presets, list_presets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m k3core.generate", description=__doc__)
    presets = ", ".join(list_checkpoint_presets() + list_presets())
    parser.add_argument("--model", default="k3-demo",
                        help=f"checkpoint directory or preset ({presets}); default k3-demo, the shipped trained "
                             "demo model")
    parser.add_argument("--prompt", default="def add(a, b):\n", help="prompt text")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--backend", default="torch", help="auto | cuda | rocm | torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--expert-format", default=None, choices=["mxfp4", "bf16"],
                        help="routed-expert storage (default: as the checkpoint or preset has them)")
    args = parser.parse_args(argv)

    from k3core import LLM, SamplingParams
    try:
        llm = LLM(args.model, backend=args.backend, device=args.device, dtype=args.dtype,
                  expert_format=args.expert_format)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        out = llm.generate([args.prompt], params)[0]
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"error: {exc}")
    if llm.is_random:
        print(f"[{args.model}: random weights, so the text is noise]", file=sys.stderr)
    print(args.prompt + out.text)
    print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated, "
          f"finish: {out.finish_reason}]", file=sys.stderr)


if __name__ == "__main__":
    main()
