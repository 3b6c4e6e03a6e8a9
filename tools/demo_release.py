"""Write the trained demo model as K3 publishes a checkpoint, and describe it in a model card.

Layout (K3_CHAT_FORMAT.md section 1): `config.json` (`model_type: kimi_k3`, the text model under `text_config`,
with the compressed-tensors `quantization_config` that the checkpoint writer adds for MXFP4 experts),
`model.safetensors` (routed experts as MXFP4 `weight_packed` + `weight_scale`, the other "weight" tensors bf16, the
"fp32" tensors float32), `tiktoken.model`, `tokenizer_config.json`, `generation_config.json`; next to them
`MODEL_CARD.md`, `loss_curve.png`, `training_log.json` (the numbers the card quotes) and `golden.json` (what
an engine must reproduce on it, written by tools/train_demo.py).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from k3core.config import ModelConfig
from k3core.hf_config import is_mxfp4_quantization
from k3core.model.checkpoint_writer import save_k3_checkpoint
from k3core.model.weights import count_parameters, expected_tensors

MAX_CHECKPOINT_BYTES = 30 * 1000 * 1000
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CARD_FILE = "MODEL_CARD.md"
LOSS_CURVE_FILE = "loss_curve.png"
TRAINING_LOG_FILE = "training_log.json"

def is_routed_expert(name: str) -> bool:
    return name.endswith((".mlp.experts.w13", ".mlp.experts.w2"))


def stored_bytes(config: ModelConfig) -> int:
    """Bytes of model.safetensors' tensor data for `config`: MXFP4 experts (4.25 bits), bf16 and float32 rest."""
    total = 0
    for name, spec in expected_tensors(config).items():
        numel = math.prod(spec.shape)
        if is_routed_expert(name):
            total += numel // 2 + numel // 32                   # packed codes + one scale byte per 32
        else:
            total += numel * (4 if spec.kind == "fp32" else 2)
    return total


def release_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Canonical tensors as they are stored: float32 experts (the writer quantises them), bf16 / float32 rest."""
    specs = expected_tensors(config)
    out = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().cpu()
        if is_routed_expert(name) or specs[name].kind == "fp32":
            out[name] = tensor.float()
        else:
            out[name] = tensor.to(torch.bfloat16)
    return out


def write_checkpoint(weights: dict[str, torch.Tensor], config: ModelConfig, directory: Path) -> dict[str, torch.Tensor]:
    """config.json + model.safetensors; returns the canonical weights the directory holds (float32 experts
    dequantised from MXFP4, the rest as stored)."""
    held = save_k3_checkpoint(release_weights(weights, config), config, directory, mxfp4_experts=True)
    written = json.loads((directory / "config.json").read_text())["text_config"].get("quantization_config")
    if not is_mxfp4_quantization(written):
        raise RuntimeError(f"{directory}/config.json does not declare the MXFP4 experts it holds; the checkpoint "
                           "writer must write the compressed-tensors quantization_config")
    return held


def write_generation_config(config: ModelConfig, directory: Path) -> None:
    data = {"bos_token_id": config.bos_token_id, "eos_token_id": [config.eos_token_id],
            "pad_token_id": config.pad_token_id, "do_sample": True, "temperature": 1.0, "top_p": 0.95}
    (directory / GENERATION_CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")


@dataclass
class LossCurve:
    """(training tokens, loss) points: the per-step training loss and the held-out evaluations."""
    train: list[tuple[int, float]] = field(default_factory=list)
    heldout: list[tuple[int, float]] = field(default_factory=list)


NO_PLOT_NOTE = ("matplotlib was not installed where it trained, so the PNG is missing; its points are in "
                "training_log.json: draw it with `python -m tools.demo_release plot DIR`")


def plot_loss_curve(curve: LossCurve, path: Path) -> bool:
    """Training loss (per step and a running mean) and held-out loss against training tokens; False (and no file)
    when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"[train_demo] warning: {NO_PLOT_NOTE}", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4), dpi=110)
    if curve.train:
        tokens, losses = zip(*curve.train)
        smoothed, running = [], None
        for loss in losses:
            running = loss if running is None else 0.95 * running + 0.05 * loss
            smoothed.append(running)
        axes.plot(tokens, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
        axes.plot(tokens, smoothed, color="tab:blue", linewidth=1.6, label="train (running mean)")
    if curve.heldout:
        tokens, losses = zip(*curve.heldout)
        axes.plot(tokens, losses, "o-", color="tab:orange", label="held-out")
    axes.set_xlabel("training tokens")
    axes.set_ylabel("cross-entropy (nats / token)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


@dataclass
class TrainingSummary:
    """What the card reports: every number comes from the run that wrote the directory."""
    config: ModelConfig
    arguments: dict[str, Any]
    data: dict[str, Any]                                  # demo_corpus.describe() plus token counts
    steps: int
    tokens_seen: int
    train_seconds: float
    stop_reason: str
    final_train_loss: float
    heldout: dict[str, float]                             # loss, perplexity, bits_per_byte, tokens
    samples: list[dict[str, str]] = field(default_factory=list)   # prompt, continuation (greedy)
    device: str = "cpu"
    checkpoint_bytes: int = 0
    tokenizer_sha256: str = ""
    engine_check: str = ""
    loss_curve: LossCurve = field(default_factory=LossCurve)
    loss_curve_note: str = ""                             # why the PNG is missing, when it is

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("config", "loss_curve")}
        out["config"] = self.config.to_dict()
        out["loss_curve"] = {"train": self.loss_curve.train, "heldout": self.loss_curve.heldout}
        return out


def write_model_card(summary: TrainingSummary, directory: Path) -> None:
    c = summary.config
    params = count_parameters(c)
    data, held = summary.data, summary.heldout
    mla = ", ".join(str(i) for i in c.mla_layer_ids)
    samples = "\n\n".join(f"Prompt:\n```\n{s['prompt']}\n```\nGreedy continuation:\n```\n{s['continuation']}\n```"
                          for s in summary.samples)
    text = f"""# k3core demo model (K3 architecture, {params.total / 1e6:.1f}M parameters)

A small model with Kimi-K3's architecture, trained from scratch by `tools/train_demo.py` so that k3core's
embedded default produces real text and every system check (prefix cache, chunking, backends, parallel plans)
can compare logprobs on a trained model instead of random weights. It is a demo, not an assistant.

## Architecture
Every K3 switch is on: {c.num_layers} layers, hidden size {c.hidden_size}; KDA layers with the lower-bounded gate
(bound {c.kda_gate_lower_bound}) and the full-rank output gate; gated NoPE MLA at layers {mla} (the 3:1 pattern
ending in two MLA layers, as in K3); Attention Residuals in blocks of {c.attn_res_block_size} layers; layer 0 a
dense SiTU-GLU FFN; LatentMoE (latent width {c.moe_latent_size}, latent norm) with {c.num_experts} SiTU experts,
top-{c.num_experts_per_token} sigmoid routing with an auxiliary-loss-free correction bias, and
{c.num_shared_experts} shared expert. Parameters: {params.total:,} in all, {params.active:,} active per token.
Vocabulary: {c.vocab_size} ({c.vocab_size - 256} BPE ranks + K3's 256 reserved specials at K3's offsets).

## Checkpoint
The published K3 layout: `config.json` (`model_type: kimi_k3`, `text_config`, compressed-tensors
`quantization_config`), `model.safetensors` ({summary.checkpoint_bytes / 1e6:.1f} MB; routed experts in MXFP4
`weight_packed`/`weight_scale`, the rest bf16, conv/gate/bias tensors float32), `tiktoken.model` (sha256
`{summary.tokenizer_sha256[:16]}...`), `tokenizer_config.json`, `generation_config.json`, and `golden.json` (a held-out window with its loss and a
greedy continuation, computed on the CPU in float32 from the checkpoint: what an engine must reproduce). The
experts were
trained quantisation-aware (MXFP4 values in the forward, straight-through gradient) for the second part of
training, so the stored MXFP4 experts are the weights that were evaluated. Engine check: {summary.engine_check}

## Data (all of it from the Python standard library, PSF licence)
Selection: {data['rule']}

- Python {data['python_version']}, standard library at `{data['stdlib_dir']}`.
- Files: {data['num_train_files']} training, {data['num_heldout_files']} held out; chat pairs:
  {data['num_train_pairs']} training, {data['num_heldout_pairs']} held out; each training pair rendered
  {data['chat_renders']} time(s) in XTML with different request wordings.
- Tokens: {data['train_tokens']:,} training ({data['chat_train_tokens']:,} of them chat), {data['heldout_tokens']:,}
  held out (sha256 of the int64 streams: training `{data['train_sha256'][:16]}...`, held-out
  `{data['heldout_sha256'][:16]}...`). Tokenizer: byte-level BPE trained on the training files only, Kimi
  split regex.
- Seed {summary.arguments['seed']}: it fixes the initialisation, the chat renderings, the document order and the
  training windows. The held-out split depends only on the file paths.

## Training
{summary.steps} steps, {summary.tokens_seen:,} tokens, {summary.train_seconds:.0f} s on {summary.device}
(stopped by: {summary.stop_reason}). Arguments: `{json.dumps(summary.arguments, sort_keys=True)}`.
Final training loss (running mean) {summary.final_train_loss:.3f} nats/token.

{summary.loss_curve_note or f"![loss curve]({LOSS_CURVE_FILE})"}

## Held-out evaluation
On {int(held['tokens']):,} held-out tokens (files and chat pairs never trained on), computed from the checkpoint
as written (bf16 weights, MXFP4 experts, float32 math): loss {held['loss']:.3f} nats/token, perplexity
{held['perplexity']:.2f}, {held['bits_per_byte']:.3f} bits per UTF-8 byte.

## What it can and cannot do
It continues Python source in the style of the standard library (imports, docstrings, indentation, common
idioms) and answers a chat request in K3's XTML format with the right control structure (think / response
channels, `<|end_of_msg|>`). It does not follow instructions reliably, does not know facts, and its code is
rarely correct beyond a few lines: use it to check that an engine computes the model right, not for answers.

## Samples (greedy, from the checkpoint)
{samples}
"""
    (directory / MODEL_CARD_FILE).write_text(text)
    (directory / TRAINING_LOG_FILE).write_text(json.dumps(summary.to_json(), indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    """`python -m tools.demo_release plot DIR`: draw DIR/loss_curve.png from DIR/training_log.json."""
    parser = argparse.ArgumentParser(prog="python -m tools.demo_release")
    parser.add_argument("command", choices=["plot"])
    parser.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    log = json.loads((args.directory / TRAINING_LOG_FILE).read_text())["loss_curve"]
    curve = LossCurve([tuple(p) for p in log["train"]], [tuple(p) for p in log["heldout"]])
    if not plot_loss_curve(curve, args.directory / LOSS_CURVE_FILE):
        sys.exit("error: drawing the loss curve needs matplotlib (`pip install matplotlib`)")
    card = args.directory / MODEL_CARD_FILE
    if card.exists():
        card.write_text(card.read_text().replace(NO_PLOT_NOTE, f"![loss curve]({LOSS_CURVE_FILE})"))


if __name__ == "__main__":
    main()
