"""Train k3core's demo model: Kimi-K3's architecture at ~20M parameters on the Python standard library.

    python -m tools.train_demo --device cuda --time-budget-s 420 --out k3core/presets/demo
    python -m tools.train_demo --smoke --out /tmp/demo-smoke          # a few CPU steps of a tiny model

Steps: select the corpus (tools/demo_corpus.py), train the tokenizer on the training files and write it in the
published Kimi format (tools/demo_tokenizer.py), encode source files and chat examples (rendered by the
product's XTML renderer, k3core.chat.xtml) into one token stream per split, train
`tools.demo_model.DemoModel` (autograd through the reference ops) with AdamW, then write the checkpoint in the
published K3 layout with a loss curve and a model card (tools/demo_release.py), evaluate held-out perplexity on
the checkpoint as written, and check the engine's network on it.

`--time-budget-s` bounds the whole run, setup included: training stops `--reserve-s` seconds before the budget
ends so that evaluation and writing still fit, and the learning-rate schedule follows the larger of the step
and time progress. On cuda the forward runs under bf16 autocast (the KDA recurrence and the router stay float32).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):                           # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from k3core.chat import xtml
from k3core.config import ModelConfig, kimi_layer_pattern
from tools import demo_corpus, demo_release, demo_tokenizer
from tools.demo_model import DemoModel, initial_weights

REQUIRED_PACKAGES = ("regex", "tokenizers", "tiktoken", "safetensors", "tqdm")
EOS_OFFSET, END_OF_MSG_OFFSET, PAD_OFFSET = 1, 2, 255        # special ids: num_ranks + offset (K3's numbering)


# ---- model size -------------------------------------------------------------------------------------------------

def demo_config(num_ranks: int, smoke: bool = False) -> ModelConfig:
    """The demo architecture: every K3 switch on. 9 layers put MLA at 3, 7 and 8, so the pattern ends in two MLA
    layers as K3's 93 do; AttnRes seals every 3 layers."""
    num_layers = 5 if smoke else 9
    hidden = 64 if smoke else 256
    return ModelConfig(
        vocab_size=num_ranks + demo_tokenizer.NUM_RESERVED_SPECIAL_TOKENS, hidden_size=hidden,
        num_layers=num_layers, layer_types=tuple(kimi_layer_pattern(num_layers)),
        mlp_types=tuple("dense" if i == 0 else "moe" for i in range(num_layers)),
        bos_token_id=num_ranks, eos_token_id=num_ranks + END_OF_MSG_OFFSET, pad_token_id=num_ranks + PAD_OFFSET,
        max_position_embeddings=1 << 20, activation="situ", situ_beta=4.0, situ_linear_beta=25.0,
        intermediate_size=4 * hidden,
        kda_num_heads=2 if smoke else 4, kda_head_dim=32 if smoke else 64, conv_kernel_size=4,
        kda_gate="lower_bound", kda_gate_lower_bound=-5.0, kda_output_gate="full_rank",
        mla_num_heads=2 if smoke else 4, q_lora_rank=32 if smoke else 128, kv_lora_rank=32 if smoke else 128,
        qk_nope_head_dim=16 if smoke else 64, qk_rope_head_dim=8 if smoke else 32, v_head_dim=16 if smoke else 64,
        mla_output_gate=True,
        num_experts=4 if smoke else 16, num_experts_per_token=2 if smoke else 4,
        moe_intermediate_size=32 if smoke else 256, num_shared_experts=1, router_scoring="sigmoid",
        router_correction_bias=True, moe_renormalize=True, routed_scaling_factor=2.5 if not smoke else 1.0,
        moe_latent_size=32 if smoke else 128, moe_latent_norm=True,
        attn_res=True, attn_res_block_size=2 if smoke else 3, name="k3-demo")


# ---- data -------------------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    train_ids: torch.Tensor            # int64 [N_train]: every training document, shuffled, concatenated
    heldout_ids: torch.Tensor          # int64 [N_heldout]
    stats: dict


def subset(files: list[demo_corpus.SourceFile], limit: int | None) -> list[demo_corpus.SourceFile]:
    """`limit` training files and limit // 8 (at least one) held-out files, each spread evenly over the sorted
    list (every file when limit is None)."""
    if limit is None:
        return files

    def spread(part: list, count: int) -> list:
        if count >= len(part):
            return part
        return [part[int(i * len(part) / count)] for i in range(count)]

    train = spread([f for f in files if not f.held_out], limit)
    held = spread([f for f in files if f.held_out], max(1, limit // 8))
    return sorted(train + held, key=lambda f: f.relative_path)


def chat_ids(example: demo_corpus.ChatExample, encoding) -> list[int]:
    """A finished conversation as the product renders it (k3core.chat's XTML renderer): the prompt the server
    would build for its messages, then the assistant's answer, closed by `<|end_of_msg|>`."""
    segments = xtml.prompt_segments(example.messages, thinking=example.thinking,
                                    thinking_effort=example.effort or xtml.DEFAULT_THINKING_EFFORT,
                                    add_generation_prompt=False)
    return xtml.encode_segments(encoding, segments)


def build_corpus(files: list[demo_corpus.SourceFile], encoding, num_ranks: int, seed: int,
                 chat_renders: int) -> Corpus:
    """Source files end with [EOS]; a chat example is its XTML rendering (each message ends <|end_of_msg|>).
    Training documents are shuffled with `seed`; held-out documents keep their sorted order."""
    eos = num_ranks + EOS_OFFSET
    rng = random.Random(seed)
    documents: dict[bool, list[tuple[str, list[int]]]] = {True: [], False: []}
    counts = {"files": {True: 0, False: 0}, "pairs": {True: 0, False: 0}}
    for source in files:
        counts["files"][source.held_out] += 1
        documents[source.held_out].append(("source", encoding.encode_ordinary(source.text) + [eos]))
        for pair in demo_corpus.function_pairs(source):
            counts["pairs"][pair.held_out] += 1
            for _ in range(1 if pair.held_out else chat_renders):
                documents[pair.held_out].append(("chat", chat_ids(demo_corpus.chat_example(pair, rng), encoding)))
    rng.shuffle(documents[False])

    def stream(held_out: bool) -> torch.Tensor:
        return torch.tensor([t for _, ids in documents[held_out] for t in ids], dtype=torch.long)

    stats = {"num_train_files": counts["files"][False], "num_heldout_files": counts["files"][True],
             "num_train_pairs": counts["pairs"][False], "num_heldout_pairs": counts["pairs"][True],
             "chat_renders": chat_renders,
             "chat_train_tokens": sum(len(ids) for kind, ids in documents[False] if kind == "chat")}
    corpus = Corpus(stream(False), stream(True), stats)
    stats.update(train_tokens=len(corpus.train_ids), heldout_tokens=len(corpus.heldout_ids),
                 train_sha256=_stream_sha256(corpus.train_ids), heldout_sha256=_stream_sha256(corpus.heldout_ids))
    return corpus


def _stream_sha256(ids: torch.Tensor) -> str:
    """sha256 of a token stream as little-endian int64: two runs that agree on it trained on the same data."""
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


def training_windows(stream: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Endless batches [B, T+1] of windows at random offsets of the stream."""
    limit = len(stream) - seq_len - 1
    if limit <= 0:
        raise ValueError(f"the training stream has {len(stream)} tokens, fewer than one window of {seq_len + 1}")
    while True:
        starts = torch.randint(0, limit, (batch_size,), generator=generator)
        yield torch.stack([stream[s: s + seq_len + 1] for s in starts.tolist()])


def heldout_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive non-overlapping windows [W, T+1] from the start of the held-out stream."""
    count = min(max_windows, (len(stream) - 1) // seq_len)
    if count <= 0:
        raise ValueError(f"the held-out stream has {len(stream)} tokens, fewer than one window of {seq_len + 1}")
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(count)])


# ---- training ---------------------------------------------------------------------------------------------------

def _autocast(device: torch.device, enabled: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def evaluate(model: DemoModel, windows: torch.Tensor, batch_size: int, device: torch.device,
             bf16: bool) -> tuple[float, int]:
    """(mean cross-entropy in nats per token, number of tokens) over the windows' next-token targets."""
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start: start + batch_size].to(device)
        with _autocast(device, bf16):
            logits = model(chunk[:, :-1])                                            # [B, T, V] float32
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count, count


def learning_rate(peak: float, step: int, warmup_steps: int, progress: float) -> float:
    """Linear warmup, then cosine decay to 10 % of the peak as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    return peak * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def _optimizer(model: DemoModel, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, param in model.params.items():
        # matrices decay; norms, gate parameters, conv taps and the embedding do not
        matrix = param.dim() >= 2 and "conv1d" not in name and "embed_tokens" not in name
        (decay if matrix else no_decay).append(param)
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def greedy(model: DemoModel, prompt_ids: list[int], max_tokens: int, stop_id: int | None,
           device: torch.device) -> list[int]:
    """Greedy continuation by full recomputation (the demo model is small; this checks meaning, not speed); it
    ends after `stop_id` when one is given."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        next_id = int(model(torch.tensor([ids], device=device))[0, -1].argmax())
        ids.append(next_id)
        if next_id == stop_id:
            break
    return ids[len(prompt_ids):]


def write_golden(directory: Path, config: ModelConfig, encoding, window: torch.Tensor) -> dict:
    """golden.json: what the engine must reproduce on this checkpoint, computed on the CPU in float32 by the training
    network from the checkpoint as loaded: the mean next-token loss of a held-out window, and the greedy
    continuation (GOLDEN_TOKENS tokens, end-of-sequence ids not stopping it) of a fixed prompt."""
    from k3core.model.loader import load_checkpoint
    cpu = torch.device("cpu")
    model = DemoModel(config, load_checkpoint(directory, config, dtype=torch.float32, device=cpu))
    loss, _ = evaluate(model, window[None], 1, cpu, bf16=False)
    prompt_ids = encoding.encode_ordinary(GOLDEN_PROMPT)
    golden = {"heldout_token_ids": window.tolist(), "heldout_loss": loss, "prompt": GOLDEN_PROMPT,
              "prompt_token_ids": prompt_ids,
              "greedy_token_ids": greedy(model, prompt_ids, GOLDEN_TOKENS, stop_id=None, device=cpu)}
    (directory / GOLDEN_FILE).write_text(json.dumps(golden) + "\n")
    return golden


def engine_check(directory: Path, golden: dict) -> str:
    """`k3core.LLM(directory)` (the path a real K3 checkpoint takes; torch backend, float32, CPU) against the
    golden: its loss on the held-out window and its greedy continuation. Returns the card's sentence."""
    from k3core import LLM, SamplingParams
    try:
        llm = LLM(str(directory), backend="torch", device="cpu", dtype="float32")
    except Exception as exc:          # reported in the card and on stderr; the weights were checked by the golden
        return f"`k3core.LLM(directory)` does not load it ({type(exc).__name__}: {exc})."
    ids = golden["heldout_token_ids"]
    logits = llm.prompt_logits(ids[:-1])                                                # [T, V]
    loss = F.cross_entropy(logits, torch.tensor(ids[1:])).item()
    params = SamplingParams(max_tokens=len(golden["greedy_token_ids"]), temperature=0.0, ignore_eos=True)
    tokens = llm.generate([golden["prompt_token_ids"]], params)[0].token_ids
    same = "the same" if tokens == golden["greedy_token_ids"] else "DIFFERENT"
    return (f"`k3core.LLM(directory)` loads it as a real K3 checkpoint (torch backend, float32, CPU): held-out loss "
            f"{loss:.5f} against the training network's {golden['heldout_loss']:.5f} on {len(ids) - 1} tokens, and "
            f"{same} {len(tokens)} greedy tokens as `{GOLDEN_FILE}` records.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.train_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (the checkpoint)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, a few files, a few steps (CI)")
    parser.add_argument("--steps", type=int, default=None, help="maximum training steps (default 20000; smoke 4)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="wall-clock bound for the whole run; training stops early to leave --reserve-s")
    parser.add_argument("--reserve-s", type=float, default=75.0,
                        help="seconds kept for evaluation and writing at the end of --time-budget-s")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 32; smoke 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512; smoke 64)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=150)
    parser.add_argument("--qat-start", type=float, default=0.6,
                        help="progress from which the routed experts train on their MXFP4 values")
    parser.add_argument("--balance-rate", type=float, default=1e-3, help="router correction-bias update per step")
    parser.add_argument("--num-ranks", type=int, default=None, help="BPE ranks (default 8192; smoke 512)")
    parser.add_argument("--max-files", type=int, default=None, help="use this many corpus files (smoke 16)")
    parser.add_argument("--chat-renders", type=int, default=2, help="renderings of each training chat pair")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between quick held-out evaluations")
    parser.add_argument("--eval-windows", type=int, default=None,
                        help="held-out windows in the final evaluation (default 128; smoke 4)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 autocast (default: on for cuda, off for cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    smoke = args.smoke
    defaults = {"steps": 4 if smoke else 20000, "batch_size": 4 if smoke else 32, "seq_len": 64 if smoke else 512,
                "num_ranks": 512 if smoke else 8192, "max_files": 16 if smoke else None,
                "eval_windows": 4 if smoke else 128}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if smoke:
        args.warmup_steps = min(args.warmup_steps, 2)
    if args.bf16 is None:
        args.bf16 = torch.device(args.device).type == "cuda"
    return args


def _require_packages() -> None:
    missing = [name for name in REQUIRED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"error: tools.train_demo needs the packages {', '.join(missing)}; install them "
                 f"(`pip install {' '.join(missing)}`) and run again")


def main(argv: list[str] | None = None) -> demo_release.TrainingSummary:
    started = time.monotonic()
    args = parse_args(argv)
    _require_packages()
    from tqdm import tqdm
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")                                  # TF32 for float32 GEMMs
    torch.manual_seed(args.seed)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    config = demo_config(args.num_ranks, args.smoke)
    size = demo_release.stored_bytes(config)
    if size > demo_release.MAX_CHECKPOINT_BYTES:
        sys.exit(f"error: the checkpoint would hold {size / 1e6:.1f} MB, over the "
                 f"{demo_release.MAX_CHECKPOINT_BYTES / 1e6:.0f} MB limit; use a smaller --num-ranks")

    # data and tokenizer
    files = subset(demo_corpus.select_files(), args.max_files)
    ranks = demo_tokenizer.train_bpe_ranks([f.text for f in files if not f.held_out], args.num_ranks)
    demo_tokenizer.write_tokenizer(ranks, out)
    encoding = demo_tokenizer.load_encoding(out)
    corpus = build_corpus(files, encoding, args.num_ranks, args.seed, args.chat_renders)
    heldout = heldout_windows(corpus.heldout_ids, args.seq_len, args.eval_windows)
    quick_heldout = heldout[: max(1, min(8, len(heldout)))]
    print(f"[train_demo] {len(files)} files, {corpus.stats['train_tokens']:,} training tokens "
          f"({corpus.stats['chat_train_tokens']:,} chat), {corpus.stats['heldout_tokens']:,} held out; "
          f"setup {time.monotonic() - started:.0f} s", file=sys.stderr)

    # model and optimiser
    model = DemoModel(config, initial_weights(config, args.seed)).to(device)
    optimizer = _optimizer(model, args.lr, args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    batches = training_windows(corpus.train_ids, args.batch_size, args.seq_len, generator)
    deadline = None if args.time_budget_s is None else started + args.time_budget_s - args.reserve_s
    train_started = time.monotonic()
    train_points: list[tuple[int, float]] = []
    heldout_points: list[tuple[int, float]] = []
    stop_reason, running, step = f"{args.steps} steps", None, 0
    bar = tqdm(total=args.steps, desc="training", unit="step", dynamic_ncols=True)
    while step < args.steps:
        now = time.monotonic()
        if deadline is not None and step > 0 and now >= deadline:
            stop_reason = f"the time budget ({args.time_budget_s:.0f} s, {args.reserve_s:.0f} s kept for writing)"
            break
        progress = step / args.steps
        if deadline is not None:
            progress = max(progress, (now - train_started) / max(1e-9, deadline - train_started))
        model.fake_quant_experts = progress >= args.qat_start
        lr = learning_rate(args.lr, step, args.warmup_steps, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(batches).to(device, non_blocking=True)                          # [B, T+1]
        model.train()
        with _autocast(device, args.bf16):
            logits = model(batch[:, :-1])                                            # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        model.balance_experts(args.balance_rate)
        step += 1
        value = loss.item()
        if not math.isfinite(value):
            sys.exit(f"error: the training loss became {value} at step {step}; lower --lr")
        running = value if running is None else 0.98 * running + 0.02 * value
        tokens = step * batch[:, 1:].numel()
        train_points.append((tokens, value))
        if step % args.eval_every == 0:
            model.eval()
            heldout_points.append((tokens, evaluate(model, quick_heldout, args.batch_size, device, args.bf16)[0]))
        bar.set_postfix(loss=f"{running:.3f}", lr=f"{lr:.1e}", qat=int(model.fake_quant_experts))
        bar.update(1)
    bar.close()
    train_seconds = time.monotonic() - train_started
    tokens_seen = step * args.batch_size * args.seq_len

    # write the checkpoint, then evaluate what was written
    model.eval()
    held = demo_release.write_checkpoint(model.state_weights(), config, out)
    demo_release.write_generation_config(config, out)
    checkpoint_model = DemoModel(config, held).to(device)
    loss, num_tokens = evaluate(checkpoint_model, heldout, args.batch_size, device, bf16=False)
    heldout_points.append((tokens_seen, loss))
    target_bytes = _byte_lengths(encoding, config.vocab_size)[heldout[:, 1:].flatten()].sum().item()
    heldout_metrics = {"loss": loss, "perplexity": math.exp(loss), "tokens": num_tokens,
                       "bits_per_byte": loss * num_tokens / math.log(2) / max(1, target_bytes)}
    samples = _samples(checkpoint_model, encoding, config, device, max_tokens=2 if args.smoke else 120)
    golden = write_golden(out, config, encoding, heldout[0, : GOLDEN_WINDOW + 1])
    check = engine_check(out, golden)
    print(f"[train_demo] engine check: {check}", file=sys.stderr)
    curve = demo_release.LossCurve(train_points, heldout_points)
    plotted = demo_release.plot_loss_curve(curve, out / demo_release.LOSS_CURVE_FILE)
    summary = demo_release.TrainingSummary(
        config=config, arguments={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        data={**demo_corpus.describe(), **corpus.stats}, steps=step, tokens_seen=tokens_seen,
        train_seconds=train_seconds, stop_reason=stop_reason, final_train_loss=running or float("nan"),
        heldout=heldout_metrics, samples=samples, device=_device_name(device),
        checkpoint_bytes=(out / "model.safetensors").stat().st_size,
        tokenizer_sha256=demo_tokenizer.ranks_sha256(out), engine_check=check, loss_curve=curve,
        loss_curve_note="" if plotted else demo_release.NO_PLOT_NOTE)
    demo_release.write_model_card(summary, out)
    directory_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    if directory_bytes > demo_release.MAX_CHECKPOINT_BYTES:
        sys.exit(f"error: {out} holds {directory_bytes / 1e6:.1f} MB, over the "
                 f"{demo_release.MAX_CHECKPOINT_BYTES / 1e6:.0f} MB limit for a committed checkpoint")
    print(f"[train_demo] {step} steps in {train_seconds:.0f} s; held-out perplexity {math.exp(loss):.2f} "
          f"({heldout_metrics['bits_per_byte']:.3f} bits/byte); wrote {out} in {time.monotonic() - started:.0f} s "
          "total", file=sys.stderr)
    return summary


def _byte_lengths(encoding, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes of every id (a special token counts the bytes of its name)."""
    lengths = torch.zeros(vocab_size, dtype=torch.long)
    for token_id in range(vocab_size):
        try:
            lengths[token_id] = len(encoding.decode_single_token_bytes(token_id))
        except KeyError:
            lengths[token_id] = 0
    return lengths


GOLDEN_FILE = "golden.json"
GOLDEN_WINDOW = 256                # held-out tokens whose loss the engine must reproduce
GOLDEN_TOKENS = 16                 # greedy tokens the engine must reproduce
GOLDEN_PROMPT = "import os\n\n\ndef "
SAMPLE_CODE_PROMPT = 'def read_lines(path):\n    """Return the lines of the file at path, without line endings."""\n'
SAMPLE_CHAT_REQUEST = "Write a Python function `is_palindrome(text)` that returns True when text reads the same " \
                      "backwards, ignoring case."


def _samples(model: DemoModel, encoding, config: ModelConfig, device: torch.device, max_tokens: int) -> list[dict]:
    code_ids = encoding.encode_ordinary(SAMPLE_CODE_PROMPT)
    chat_prompt = xtml.prompt_segments([{"role": "user", "content": SAMPLE_CHAT_REQUEST}], thinking=False)
    out = []
    for prompt_ids in (code_ids, xtml.encode_segments(encoding, chat_prompt)):
        continuation = greedy(model, prompt_ids, max_tokens, config.eos_token_id, device)
        out.append({"prompt": encoding.decode(prompt_ids), "continuation": encoding.decode(continuation)})
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU (torch {torch.__version__})"


if __name__ == "__main__":
    main()
