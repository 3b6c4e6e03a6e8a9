"""python -m bench.pool_sim: replay request traces on the unified pool and the static dual pool.

No model is needed: the pools run on a layout in abstract units, where one unit is one MLA page of 256 bytes
and a KDA slot is `slot_units` pages (`unit_layout`). The pools are the real `k3core.memory` classes, so
compaction really copies bytes and `check_invariants()` runs after every step.

A step is one decode token for every running request. Each step: requests that produced their last token
free their slot and pages; running requests that cross a page boundary take one more page (if none is left
the request is aborted, a failure); then new arrivals ask for one slot plus their prompt's pages (refused
when that does not fit, a failure). Traces:

* toy: the launch write-up's teaching example, 44 pages, 3 pages of KDA state per request, 32 steps: a burst
  of short requests (many slots, few pages), then a few long ones (few slots, many pages);
* random: a configurable mix of long and short requests with random arrivals whose share of long requests
  drifts over the trace while the expected total occupancy stays put (`random_trace`). The static split is
  planned for the trace's average demand (the best a start-up guess can do); it fails as the mix drifts.

A refused request is dropped, not queued, so both pools see the same arrivals. The unified pool refuses only
when the free bytes are truly short (`refused_with_room` is always 0 for it); it usually admits more, though
on a rare trace a large request it took crowds out a later one the static pool would have admitted.

Writes `pool_sim_{toy,random}.png` (timelines: used KDA / used MLA / free, refusals marked) and `.json`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from k3core.memory import ArenaPool, PoolLayout, StaticDualPool, UnifiedPool

UNIT_BYTES = 256
RESULTS_DIR = Path(__file__).parent / "results"


@dataclass(frozen=True)
class SimRequest:
    arrival: int          # step at which it asks for admission
    prompt_len: int       # tokens cached at admission
    output_len: int       # decode steps (one token each) before it finishes


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[SimRequest, ...]
    capacity_units: int
    slot_units: int
    page_size: int
    static_slots: int     # KDA partition of the static pool, in slots
    num_steps: int


@dataclass
class Timeline:
    kda_units: list[int] = field(default_factory=list)
    mla_units: list[int] = field(default_factory=list)
    free_units: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    refused_steps: list[int] = field(default_factory=list)
    aborted_steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PoolResult:
    pool: str
    admitted: int
    refused: int
    aborted: int
    completed: int
    failures: int
    refused_with_room: int    # refusals while the pool held enough free bytes in total for the request
    peak_used_units: int
    peak_kda_units: int
    peak_mla_units: int
    bytes_moved: int


def unit_layout(slot_units: int, page_size: int) -> PoolLayout:
    """A layout where a page is one 256-byte unit and a slot is `slot_units` units (real bytes, tiny sizes)."""
    if slot_units < 1 or not 1 <= page_size <= 128:
        raise ValueError(f"slot_units={slot_units} must be >= 1 and page_size={page_size} in 1..128")
    layout = PoolLayout(
        num_kda_layers=1, kda_heads=1, kda_head_dim=8, state_dtype=torch.float32,      # 8*8*4 = 256 B
        conv_channels=128 * (slot_units - 1), conv_window=1, conv_dtype=torch.bfloat16,  # 256 B per extra unit
        num_mla_layers=1, page_size=page_size, latent_width=128 // page_size, kv_dtype=torch.bfloat16)
    assert layout.page_bytes == UNIT_BYTES and layout.slot_bytes == slot_units * UNIT_BYTES
    return layout


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


# ---- traces ---------------------------------------------------------------------------------------
def toy_trace() -> Trace:
    """44 pages, a slot = 3 pages, 2 tokens per page; the static pool splits 18 pages KDA | 26 pages MLA.
    Steps 0-10 admit a burst of short requests (the KDA partition fills while MLA idles); steps 12-31 a few
    long requests whose pages outgrow the MLA partition while KDA slots sit empty. The unified pool never
    needs more than 44 pages in total, so it runs everything."""
    short = [SimRequest(arrival, 2, 6) for arrival in (0, 0, 1, 1, 2, 2, 3, 3)]
    long = [SimRequest(12, 16, 19), SimRequest(13, 14, 18), SimRequest(15, 12, 16), SimRequest(17, 10, 14)]
    return Trace("toy", tuple(short + long), capacity_units=44, slot_units=3, page_size=4, static_slots=6,
                 num_steps=32)


def random_trace(num_requests: int, long_fraction: tuple[float, float], seed: int, capacity_units: int,
                 slot_units: int, page_size: int, load: float, short_prompt: tuple[int, int],
                 short_output: tuple[int, int], long_prompt: tuple[int, int], long_output: tuple[int, int],
                 static_kda_fraction: float | None) -> Trace:
    """Poisson arrivals; the share of long requests drifts linearly from long_fraction[0] to [1] over the
    trace, and the arrival rate follows the mix so that the expected occupancy stays at `load` x capacity
    (Little's law). The total demand is thus steady while its KDA : MLA ratio moves: chat-like traffic
    (many short requests, KDA-heavy) turns into long-document traffic (few long requests, MLA-heavy)."""
    def unit_steps(prompt: tuple[int, int], output: tuple[int, int]) -> float:
        # Expected units x steps of one request: a slot for its life, prompt + half its output in pages.
        mean_prompt, mean_output = sum(prompt) / 2, sum(output) / 2
        mean_output_sq = mean_output ** 2 + ((output[1] - output[0] + 1) ** 2 - 1) / 12
        return mean_output * slot_units + (mean_output * mean_prompt + mean_output_sq / 2) / page_size

    short_cost, long_cost = unit_steps(short_prompt, short_output), unit_steps(long_prompt, long_output)
    rng = random.Random(seed)
    requests, clock = [], 0.0
    for index in range(num_requests):
        progress = index / max(num_requests - 1, 1)
        share = long_fraction[0] + (long_fraction[1] - long_fraction[0]) * progress
        clock += rng.expovariate(load * capacity_units / (share * long_cost + (1 - share) * short_cost))
        prompt, output = (long_prompt, long_output) if rng.random() < share else (short_prompt, short_output)
        requests.append(SimRequest(int(clock), rng.randint(*prompt), rng.randint(*output)))
    if static_kda_fraction is None:
        # Plan the split for the average demand over time: a slot for each decode step, and on average the
        # prompt plus half the output in pages.
        kda = sum(r.output_len * slot_units for r in requests)
        mla = sum(r.output_len * (r.prompt_len + r.output_len / 2) / page_size for r in requests)
        static_kda_fraction = kda / (kda + mla)
    static_slots = max(1, round(capacity_units * static_kda_fraction / slot_units))
    num_steps = max(r.arrival + r.output_len for r in requests) + 2
    return Trace("random", tuple(requests), capacity_units, slot_units, page_size, static_slots, num_steps)


# ---- replay ---------------------------------------------------------------------------------------
@dataclass
class _Running:
    request: SimRequest
    slot: int
    pages: list[int]
    num_tokens: int
    generated: int = 0


def replay(trace: Trace, pool: ArenaPool, check_invariants: bool = True) -> tuple[PoolResult, Timeline]:
    by_arrival: dict[int, list[SimRequest]] = {}
    for request in trace.requests:
        by_arrival.setdefault(request.arrival, []).append(request)
    running: list[_Running] = []
    timeline = Timeline()
    admitted = completed = refused_with_room = 0
    peaks = [0, 0, 0]
    for step in range(trace.num_steps):
        still_running = []
        for state in running:
            if state.generated == state.request.output_len:
                pool.free_pages(state.pages)
                pool.free_slot(state.slot)
                completed += 1
            else:
                still_running.append(state)
        running = []
        for state in still_running:                        # decode: one token each, a page when one fills
            if state.num_tokens % trace.page_size == 0:
                page = pool.alloc_pages(1)
                if page is None:
                    pool.free_pages(state.pages)
                    pool.free_slot(state.slot)
                    timeline.aborted_steps.append(step)
                    continue
                state.pages += page
            state.num_tokens += 1
            state.generated += 1
            running.append(state)
        for request in by_arrival.get(step, []):
            num_pages = pages_for(request.prompt_len, trace.page_size)
            if not pool.can_allocate(1, num_pages):
                timeline.refused_steps.append(step)
                need = pool.layout.slot_bytes + num_pages * pool.layout.page_bytes
                refused_with_room += pool.usage().free_bytes >= need
                continue
            slot, pages = pool.alloc_slot(), pool.alloc_pages(num_pages)
            assert slot is not None and pages is not None, "can_allocate promised room that alloc did not give"
            running.append(_Running(request, slot, pages, request.prompt_len))
            admitted += 1
        if check_invariants:
            pool.check_invariants()
        usage = pool.usage()
        kda, mla = usage.kda_bytes // UNIT_BYTES, usage.mla_bytes // UNIT_BYTES
        timeline.kda_units.append(kda)
        timeline.mla_units.append(mla)
        timeline.free_units.append(usage.free_bytes // UNIT_BYTES)
        timeline.running.append(len(running))
        peaks = [max(peaks[0], kda + mla), max(peaks[1], kda), max(peaks[2], mla)]
    refused, aborted = len(timeline.refused_steps), len(timeline.aborted_steps)
    result = PoolResult(pool=type(pool).__name__, admitted=admitted, refused=refused, aborted=aborted,
                        completed=completed, failures=refused + aborted, refused_with_room=refused_with_room,
                        peak_used_units=peaks[0], peak_kda_units=peaks[1], peak_mla_units=peaks[2],
                        bytes_moved=pool.bytes_moved)
    return result, timeline


def make_pools(trace: Trace) -> tuple[StaticDualPool, UnifiedPool]:
    layout = unit_layout(trace.slot_units, trace.page_size)
    capacity = trace.capacity_units * UNIT_BYTES
    return StaticDualPool(layout, capacity, num_slots=trace.static_slots), UnifiedPool(layout, capacity)


def run_trace(trace: Trace, out_dir: Path, check_invariants: bool = True,
              plot: bool = True) -> dict[str, PoolResult]:
    static, unified = make_pools(trace)
    results, timelines = {}, {}
    for key, pool in (("static", static), ("unified", unified)):
        results[key], timelines[key] = replay(trace, pool, check_invariants)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plot:
        plot_timelines(trace, timelines, results, static.num_slot_positions * trace.slot_units,
                       out_dir / f"pool_sim_{trace.name}.png")
    summary = {
        "meta": _meta(),
        "trace": {key: value for key, value in asdict(trace).items() if key != "requests"},
        "num_requests": len(trace.requests),
        "results": {key: asdict(result) for key, result in results.items()},
    }
    if len(trace.requests) <= 64:
        summary["requests"] = [asdict(request) for request in trace.requests]
        summary["timelines"] = {key: asdict(timeline) for key, timeline in timelines.items()}
    (out_dir / f"pool_sim_{trace.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return results


def _meta() -> dict[str, str]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit or "unknown", "torch": torch.__version__,
            "device": "cpu (the arena holds abstract units; no model runs)"}


# ---- plot -----------------------------------------------------------------------------------------
def plot_timelines(trace: Trace, timelines: dict[str, Timeline], results: dict[str, PoolResult],
                   static_kda_units: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(trace.num_steps))
    capacity = trace.capacity_units
    fig, axes = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
    colours = {"kda": "#3b6fb6", "mla": "#e08a2c", "free": "#d9d9d9", "kda_free": "#c6d8ef", "mla_free": "#f7dcbd"}
    for ax, key in zip(axes, ("static", "unified")):
        line, result = timelines[key], results[key]
        if key == "static":
            kda_free = [static_kda_units - used for used in line.kda_units]
            mla_free = [free - kfree for free, kfree in zip(line.free_units, kda_free)]
            ax.stackplot(steps, line.kda_units, kda_free, mla_free, line.mla_units,
                         colors=[colours["kda"], colours["kda_free"], colours["mla_free"], colours["mla"]],
                         labels=["used KDA", "free (KDA partition only)", "free (MLA partition only)", "used MLA"],
                         step="post")
            ax.axhline(static_kda_units, color="black", linestyle="--", linewidth=1)
            title = (f"static dual pool (split at start: {static_kda_units} KDA | "
                     f"{capacity - static_kda_units} MLA units)")
        else:
            ax.stackplot(steps, line.kda_units, line.free_units, line.mla_units,
                         colors=[colours["kda"], colours["free"], colours["mla"]],
                         labels=["used KDA (left end)", "free (shared middle)", "used MLA (right end)"], step="post")
            title = f"unified two-ended pool (compaction moved {result.bytes_moved // UNIT_BYTES} units)"
        for steps_hit, marker, label in ((line.refused_steps, "x", "refused admission"),
                                         (line.aborted_steps, "v", "aborted: no page to grow")):
            if steps_hit:
                counts: dict[int, int] = {}
                for step in steps_hit:
                    counts[step] = counts.get(step, 0) + 1
                ax.scatter([s + 0.5 for s in counts], [capacity * 1.04] * len(counts), marker=marker, color="red",
                           s=[40 + 20 * n for n in counts.values()], label=label, zorder=5, clip_on=False)
                if trace.num_steps <= 100:                 # a short trace: say how much memory sat free then
                    for step in counts:
                        ax.annotate(f"{line.free_units[step]} free", (step + 0.5, capacity * 1.04),
                                    xytext=(6, -12), textcoords="offset points", fontsize=7, color="red")
        ax.set_title(f"{title}: {result.admitted} admitted, {result.refused} refused "
                     f"({result.refused_with_room} with enough free memory in total), {result.aborted} aborted",
                     fontsize=9)
        ax.set_ylim(0, capacity * 1.08)
        ax.set_ylabel(f"units (page = {trace.page_size} tok; slot = {trace.slot_units} pages)", fontsize=8)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, framealpha=0.9)
    axes[-1].set_xlabel("step (one decode token per running request)")
    fig.suptitle(f"pool_sim trace '{trace.name}': {len(trace.requests)} requests, {capacity} units of memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------------
def print_table(name: str, results: dict[str, PoolResult]) -> None:
    header = ("trace", "pool", "admitted", "refused", "aborted", "failures", "refused w/ room", "peak used",
              "peak KDA", "peak MLA", "bytes moved")
    print(" | ".join(f"{h:>9}" for h in header))
    for result in results.values():
        row = (name, result.pool.replace("Pool", ""), result.admitted, result.refused, result.aborted,
               result.failures, result.refused_with_room, result.peak_used_units, result.peak_kda_units,
               result.peak_mla_units, result.bytes_moved)
        print(" | ".join(f"{value:>9}" for value in row))


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def _fraction_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    return float(low), float(high or low)


def main(argv: list[str] | None = None) -> dict[str, dict[str, PoolResult]]:
    parser = argparse.ArgumentParser(prog="python -m bench.pool_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", choices=("toy", "random", "both"), default="both")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--long-fraction", type=_fraction_range, default=(0.0, 0.6),
                        help="share of long requests, START[,END] drifting linearly over the trace")
    parser.add_argument("--capacity-units", type=int, default=16384, help="pool size in pages")
    parser.add_argument("--slot-units", type=int, default=128,
                        help="pages per KDA slot (K3 at TP8 with 16-token pages: ~128)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--load", type=float, default=0.7,
                        help="expected occupancy as a share of capacity; sets the arrival rate")
    parser.add_argument("--short-prompt", type=_range, default=(64, 1024), help="LOW,HIGH tokens")
    parser.add_argument("--short-output", type=_range, default=(32, 256), help="LOW,HIGH tokens")
    parser.add_argument("--long-prompt", type=_range, default=(8192, 24576), help="LOW,HIGH tokens")
    parser.add_argument("--long-output", type=_range, default=(128, 512), help="LOW,HIGH tokens")
    parser.add_argument("--static-kda-fraction", type=float, default=None,
                        help="static split; default: planned for the trace's average demand")
    parser.add_argument("--no-check", action="store_true", help="skip check_invariants() after each step")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    traces = []
    if args.trace in ("toy", "both"):
        traces.append(toy_trace())
    if args.trace in ("random", "both"):
        traces.append(random_trace(
            args.num_requests, args.long_fraction, args.seed, args.capacity_units, args.slot_units,
            args.page_size, args.load, args.short_prompt, args.short_output, args.long_prompt,
            args.long_output, args.static_kda_fraction))
    all_results = {}
    for trace in traces:
        all_results[trace.name] = run_trace(trace, args.out_dir, not args.no_check, not args.no_plot)
        print_table(trace.name, all_results[trace.name])
        print()
    print(f"wrote {', '.join(f'pool_sim_{t.name}.{{png,json}}' for t in traces)} to {args.out_dir}")
    return all_results


if __name__ == "__main__":
    main()
