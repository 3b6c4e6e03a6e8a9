"""`python -m bench.pp_sim`: the launch write-up's chunked pipeline-prefill toy, and how utilisation grows.

Equal-cost stages, a prompt cut into C equal chunks flowing through S stages: chunk c occupies stage s in time
slot c + s, so the pipeline runs C + S - 1 slots and each stage is busy for C of them. Slot utilisation is
C / (C + S - 1); the write-up's toy (8 stages, 5 chunks) gives 5 / 12 = 42 %.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def utilisation(stages: int, chunks: int) -> float:
    if stages < 1 or chunks < 1:
        raise ValueError("stages and chunks must be >= 1")
    return chunks / (chunks + stages - 1)


def schedule(stages: int, chunks: int) -> list[list[int | None]]:
    """grid[stage][slot] = chunk index running there, or None (a bubble)."""
    slots = chunks + stages - 1
    return [[slot - stage if 0 <= slot - stage < chunks else None for slot in range(slots)] for stage in range(stages)]


def plot(stages: int, chunks: int, max_chunks: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_grid, ax_curve) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    grid = schedule(stages, chunks)
    colors = plt.cm.tab10.colors
    for stage, row in enumerate(grid):
        for slot, chunk in enumerate(row):
            if chunk is None:
                ax_grid.add_patch(plt.Rectangle((slot, stage), 1, 1, color="0.92", ec="white"))
            else:
                ax_grid.add_patch(plt.Rectangle((slot, stage), 1, 1, color=colors[chunk % 10], ec="white"))
                ax_grid.text(slot + 0.5, stage + 0.5, f"c{chunk}", ha="center", va="center", fontsize=8)
    ax_grid.set_xlim(0, len(grid[0]))
    ax_grid.set_ylim(stages, 0)
    ax_grid.set_yticks([s + 0.5 for s in range(stages)], [f"G{s + 1}" for s in range(stages)])
    ax_grid.set_xlabel("time slot")
    ax_grid.set_title(f"chunked PP{stages}, {chunks} chunks: {utilisation(stages, chunks):.0%} of slots busy "
                      "(grey = fill/drain bubble)")
    counts = list(range(1, max_chunks + 1))
    for s in sorted({2, 4, stages}):
        ax_curve.plot(counts, [utilisation(s, c) for c in counts], marker=".", label=f"{s} stages")
    ax_curve.axhline(1.0, color="0.6", lw=0.8, ls="--")
    ax_curve.set_xlabel("chunks per prompt")
    ax_curve.set_ylabel("pipeline slot utilisation")
    ax_curve.set_ylim(0, 1.05)
    ax_curve.legend()
    ax_curve.set_title("more chunks amortise the bubble")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pp_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=5)
    parser.add_argument("--max-chunks", type=int, default=64)
    parser.add_argument("--out", default="bench/results/pp_sim")
    args = parser.parse_args(argv)
    toy = utilisation(args.stages, args.chunks)
    print(f"{args.stages} stages, {args.chunks} chunks: slot utilisation {toy:.1%} (bubble {1 - toy:.1%})")
    print(f"{'chunks':>7} | " + " | ".join(f"PP{s:<3}" for s in (2, 4, 8)))
    for chunks in (1, 2, 5, 8, 16, 32, 64):
        print(f"{chunks:>7} | " + " | ".join(f"{utilisation(s, chunks):5.1%}" for s in (2, 4, 8)))
    out = Path(args.out)
    plot(args.stages, args.chunks, args.max_chunks, out.with_suffix(".png"))
    summary = {"stages": args.stages, "chunks": args.chunks, "utilisation": toy,
               "curve": {s: {c: utilisation(s, c) for c in range(1, args.max_chunks + 1)} for s in (2, 4, 8)}}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
