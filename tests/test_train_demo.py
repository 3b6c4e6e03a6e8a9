"""tools/train_demo.py end to end on the CPU in its smoke setting: it trains, stops on its time budget, and writes a
directory in the published K3 layout that k3core loads as it loads a real K3 checkpoint.

What a user would hit: a checkpoint whose experts are not MXFP4, specials at the wrong ids, a directory the engine
cannot load, logits in the engine that differ from what was trained and evaluated, data that changes from run to
run with the same seed.
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from k3core.config import ModelConfig
from k3core.model.loader import load_checkpoint
from tools import demo_corpus, demo_tokenizer, train_demo
from tools.demo_model import DemoModel

pytest.importorskip("tiktoken")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

EXPECTED_FILES = ("config.json", "model.safetensors", "tiktoken.model", "tokenizer_config.json",
                  "generation_config.json", "MODEL_CARD.md", "loss_curve.png", "training_log.json", "golden.json")
SHIPPED_DEMO = Path(__file__).resolve().parents[1] / "k3core" / "presets" / "k3-demo"


@pytest.fixture(scope="module", autouse=True)
def _restore_threads():
    """--threads 1 keeps the runs quick on a shared CI machine; later test modules get the thread count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    summary = train_demo.main(["--smoke", "--steps", "3", "--out", str(out), "--seed", "3", "--threads", "1"])
    return out, summary


def test_smoke_run_writes_the_published_layout(smoke_run):
    out, summary = smoke_run
    for name in EXPECTED_FILES:
        assert (out / name).is_file(), name
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["model_type"] == "kimi_k3" and "text_config" in config_json
    assert config_json["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
        experts = [n for n in names if ".experts." in n]
        assert experts and all(n.endswith(("weight_packed", "weight_scale")) for n in experts)
        assert all(handle.get_tensor(n).dtype == torch.uint8 for n in experts)
        others = {handle.get_tensor(n).dtype for n in names if ".experts." not in n}
        assert others <= {torch.bfloat16, torch.float32} and torch.bfloat16 in others
    assert summary.steps == 3 and math.isfinite(summary.heldout["perplexity"])
    assert sum(f.stat().st_size for f in out.iterdir()) <= 30 * 1000 * 1000
    card = (out / "MODEL_CARD.md").read_text()
    assert demo_corpus.SELECTION_RULE in card and "Seed 3" in card and "perplexity" in card


def test_specials_are_named_at_k3_offsets(smoke_run):
    out, summary = smoke_run
    num_ranks = summary.config.vocab_size - demo_tokenizer.NUM_RESERVED_SPECIAL_TOKENS
    decoder = json.loads((out / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert len(decoder) == 256
    for offset, name in {2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>", 255: "[PAD]"}.items():
        assert decoder[str(num_ranks + offset)]["content"] == name
    assert summary.config.eos_token_id == num_ranks + 2
    encoding = demo_tokenizer.load_encoding(out)
    assert encoding.encode_single_token("<|end_of_msg|>") == summary.config.eos_token_id


def test_the_checkpoint_loads_as_a_k3_checkpoint_and_means_what_was_trained(smoke_run):
    """The loader's weights give the training network the held-out loss the card reports, and `k3core.LLM` on the
    directory (config, tokenizer and weights as a real K3 checkpoint) computes the same logits."""
    out, summary = smoke_run
    config = ModelConfig.from_hf(out)
    # the architecture as trained; `name` comes from the directory, derived fields from quantization_config
    derived = ("name", "expert_format")
    assert {k: v for k, v in config.to_dict().items() if k not in derived} == \
        {k: v for k, v in summary.config.to_dict().items() if k not in derived}
    weights = load_checkpoint(out, config, dtype=torch.float32)
    model = DemoModel(config, weights)
    heldout = train_demo.heldout_windows(_heldout_stream(out, summary), summary.arguments["seq_len"],
                                         summary.arguments["eval_windows"])
    loss, _ = train_demo.evaluate(model, heldout, 4, torch.device("cpu"), bf16=False)
    assert abs(loss - summary.heldout["loss"]) < 1e-4
    from k3core import LLM
    llm = LLM(str(out), backend="torch", device="cpu", dtype="float32")
    prompt = heldout[0, :40].tolist()
    with torch.no_grad():
        want = model(torch.tensor([prompt]))[0]
    assert torch.allclose(llm.prompt_logits(prompt), want, atol=1e-4, rtol=0)
    text = "def f(x):\n    return x"
    assert llm.tokenizer.encode(text) == demo_tokenizer.load_encoding(out).encode_ordinary(text)
    assert "loads it as a real K3 checkpoint" in summary.engine_check and "the same" in summary.engine_check
    _check_golden(out)


def _check_golden(directory: Path) -> None:
    """The engine (`k3core.LLM`, torch backend, float32) reproduces the directory's golden.json: the held-out loss
    to float32 rounding and the greedy tokens exactly."""
    from k3core import LLM, SamplingParams
    golden = json.loads((directory / "golden.json").read_text())
    llm = LLM(str(directory), backend="torch", device="cpu", dtype="float32")
    ids = golden["heldout_token_ids"]
    loss = torch.nn.functional.cross_entropy(llm.prompt_logits(ids[:-1]), torch.tensor(ids[1:])).item()
    assert abs(loss - golden["heldout_loss"]) < 1e-4
    assert llm.tokenizer.encode(golden["prompt"]) == golden["prompt_token_ids"]
    params = SamplingParams(max_tokens=len(golden["greedy_token_ids"]), temperature=0.0, ignore_eos=True)
    assert llm.generate([golden["prompt"]], params)[0].token_ids == golden["greedy_token_ids"]


@pytest.mark.skipif(not (SHIPPED_DEMO / "config.json").is_file(), reason="the trained demo checkpoint is not shipped")
def test_the_shipped_demo_checkpoint_reproduces_its_golden():
    _check_golden(SHIPPED_DEMO)


def _heldout_stream(out, summary) -> torch.Tensor:
    files = train_demo.subset(demo_corpus.select_files(), summary.arguments["max_files"])
    corpus = train_demo.build_corpus(files, demo_tokenizer.load_encoding(out), summary.config.vocab_size - 256,
                                     summary.arguments["seed"], summary.arguments["chat_renders"])
    assert corpus.stats["heldout_sha256"] == summary.data["heldout_sha256"]
    return corpus.heldout_ids


def test_the_data_is_the_same_in_another_process(smoke_run):
    """Same seed, fresh interpreter (another hash seed): the same tokenizer and training stream."""
    out, summary = smoke_run
    code = ("import sys, tempfile; from pathlib import Path; from tools import demo_corpus, demo_tokenizer, "
            "train_demo as t; files = t.subset(demo_corpus.select_files(), 16); "
            "d = Path(tempfile.mkdtemp()); demo_tokenizer.write_tokenizer(demo_tokenizer.train_bpe_ranks("
            "[f.text for f in files if not f.held_out], 512), d); "
            "print(t.build_corpus(files, demo_tokenizer.load_encoding(d), 512, 3, 2).stats['train_sha256'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=str(_repo_root()))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == summary.data["train_sha256"]


def test_the_time_budget_stops_training_and_still_writes(tmp_path):
    summary = train_demo.main(["--smoke", "--steps", "1000", "--time-budget-s", "0.01", "--reserve-s", "0",
                               "--out", str(tmp_path), "--threads", "1"])
    assert summary.steps == 1 and "time budget" in summary.stop_reason
    assert all((tmp_path / name).is_file() for name in EXPECTED_FILES)


def test_training_chat_examples_render_as_the_independent_renderer_does():
    """k3core.chat (what training uses) and tools/demo_tokenizer's own renderer agree on finished conversations."""
    import tiktoken
    encoding = tiktoken.Encoding(name="bytes", pat_str=demo_tokenizer.KIMI_PAT_STR,
                                 mergeable_ranks={bytes([b]): b for b in range(256)},
                                 special_tokens={name: 256 + offset for offset, name in
                                                 demo_tokenizer.NAMED_SPECIAL_OFFSETS.items()})
    source = demo_corpus.SourceFile("m.py", 'def f(a, b=2):\n    """Add b to a, and return the sum."""\n'
                                    '    return a + b\n', held_out=False)
    pair = demo_corpus.function_pairs(source)[0]
    rng = random.Random(0)
    for _ in range(12):
        example = demo_corpus.chat_example(pair, rng)
        segments = demo_tokenizer.render_conversation(example.messages, example.thinking, example.effort)
        assert train_demo.chat_ids(example, encoding) == demo_tokenizer.encode_segments(encoding, segments)


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def test_the_loss_curve_can_be_redrawn_from_the_log(smoke_run, tmp_path):
    """Where matplotlib is missing the run still writes its points; `python -m tools.demo_release plot` draws it."""
    import shutil
    from tools import demo_release
    out, summary = smoke_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / demo_release.LOSS_CURVE_FILE).unlink()
    log = json.loads((copy / demo_release.TRAINING_LOG_FILE).read_text())
    assert len(log["loss_curve"]["train"]) == summary.steps and log["loss_curve"]["heldout"]
    demo_release.main(["plot", str(copy)])
    assert (copy / demo_release.LOSS_CURVE_FILE).stat().st_size > 1000
