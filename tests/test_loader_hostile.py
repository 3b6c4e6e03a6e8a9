"""Hostile checkpoint directories: each is a valid tiny K3 checkpoint (k3-tiny, MXFP4 experts, two shards) with
one thing broken, opened the way a user opens it (`LLM(path)`), and must be refused with a typed error whose
message is one sentence naming the file (and the tensor when there is one), before anything large is allocated,
and without running anything from the directory.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3core import LLM
from k3core.config import ConfigError, ModelConfig
from k3core.model.checkpoint_writer import save_k3_checkpoint
from k3core.model.loader import CheckpointError, load_checkpoint
from k3core.model.weights import init_random_weights
from k3core.tokenizer import TokenizerError

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"
ENGINE = dict(page_size=2, memory_bytes=16 << 20)
EMBED = "language_model.model.embed_tokens.weight"
EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("good")
    config = ModelConfig.preset("k3-tiny").replace(expert_format="mxfp4")
    held = save_k3_checkpoint(init_random_weights(config, seed=2), config, directory, mxfp4_experts=True,
                              num_shards=2)
    assert sorted(p.name for p in directory.glob("*.safetensors")) == list(SHARDS)
    return directory, held


@pytest.fixture(scope="module")
def base(written) -> Path:
    return written[0]


def _copy(base: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(base, directory)
    return directory


def _shard_of(directory: Path, tensor: str) -> Path:
    return directory / json.loads((directory / INDEX).read_text())["weight_map"][tensor]


def _edit_tensors(directory: Path, tensor: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Rewrite the shard holding `tensor` after `edit(tensors)`; returns that shard's path."""
    shard = _shard_of(directory, tensor)
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    return shard


def _edit_config(directory: Path, **text_fields) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    for key, value in text_fields.items():
        if "." in key:
            outer, inner = key.split(".")
            data["text_config"][outer][inner] = value
        else:
            data["text_config"][key] = value
    path.write_text(json.dumps(data))


def _edit_index(directory: Path, edit: Callable[[dict[str, str]], None]) -> None:
    data = json.loads((directory / INDEX).read_text())
    edit(data["weight_map"])
    (directory / INDEX).write_text(json.dumps(data))


def _refused(directory: Path, *must_name: str) -> str:
    """LLM(directory) raises a typed error of one sentence naming `must_name` (files by their names)."""
    with pytest.raises((ConfigError, CheckpointError, TokenizerError)) as info:
        LLM(str(directory), device="cpu", dtype="float32", **ENGINE)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert not re.search(r"[.!?]\s+[A-Z]", message), f"more than one sentence: {message}"
    for name in must_name:
        assert name in message, f"{name!r} is not named in: {message}"
    return message


def test_the_base_directory_loads_exactly(written):
    """The unbroken directory loads bit for bit (LLM(base) itself runs in the peak-RSS test's warm-up)."""
    directory, held = written
    loaded = load_checkpoint(directory, ModelConfig.from_hf(directory), dtype=torch.float32)
    assert loaded.keys() == held.keys()
    assert all(torch.equal(loaded[name], held[name]) for name in held)


# ---- config.json ------------------------------------------------------------------------------------------------

CONFIG_CASES = {
    "experts_million": ({"num_experts": 1_000_000}, "num_experts"),
    "hidden_huge": ({"hidden_size": 1 << 30}, "hidden_size"),
    "hidden_negative": ({"hidden_size": -64}, "hidden_size"),
    "layers_zero": ({"num_hidden_layers": 0}, "num_hidden_layers"),
    "vocab_float": ({"vocab_size": 320.5}, "vocab_size"),
    "kv_rank_string": ({"kv_lora_rank": "32"}, "kv_lora_rank"),
    "moe_inner_negative": ({"moe_intermediate_size": -32}, "moe_intermediate_size"),
    "kda_heads_huge": ({"linear_attn_config.num_heads": 10 ** 9}, "linear_attn_config.num_heads"),
    "kda_head_dim_zero": ({"linear_attn_config.head_dim": 0}, "linear_attn_config.head_dim"),
    "eps_string": ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    "scaling_nan": ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor"),
    "layer_types_int": ({"layer_types": 7}, "layer_types"),
    "eos_garbage": ({"eos_token_id": "end"}, "eos_token_id"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_values_are_refused_by_name(base, tmp_path, case):
    fields, field = CONFIG_CASES[case]
    directory = _copy(base, tmp_path)
    _edit_config(directory, **fields)
    _refused(directory, "config.json", f"`{field}`")


@pytest.mark.parametrize("fields, tensor", [
    ({"num_experts": 16}, "block_sparse_moe.gate.weight"),               # 16 experts in config, 8 stored
    ({"hidden_size": 128}, "embed_tokens.weight"),
    ({"moe_intermediate_size": 64}, "shared_experts.down_proj.weight"),
    ({"vocab_size": 640}, "embed_tokens.weight"),
])
def test_config_inconsistent_with_tensor_shapes(base, tmp_path, fields, tensor):
    directory = _copy(base, tmp_path)
    _edit_config(directory, **fields)
    message = _refused(directory, "mis-shaped", tensor, ".safetensors")
    assert "expected" in message and "got" in message


@pytest.mark.parametrize("content, what", [("{not json", "not readable JSON"), ("[1, 2]", "JSON object"),
                                           (None, "no config.json")])
def test_config_file_missing_or_garbage(base, tmp_path, content, what):
    directory = _copy(base, tmp_path)
    if content is None:
        (directory / "config.json").unlink()
    else:
        (directory / "config.json").write_text(content)
    _refused(directory, "config.json", what)


def test_huge_configs_allocate_nothing_before_they_are_refused(base, tmp_path):
    """Peak RSS of a fresh process stays flat while `num_experts: 1000000` (out of bounds) and a config within
    bounds but far larger than its tensors (16384 experts: ~2 GB of expert stacks if allocated) are refused."""
    huge = {"bounds": {"num_experts": 1_000_000},
            "shapes": {"num_experts": 16384, "num_expert_group": 1}}
    dirs = {}
    for name, fields in huge.items():
        dirs[name] = _copy(base, tmp_path / name)
        _edit_config(dirs[name], **fields)
    script = f"""
import resource, sys
from k3core import LLM
LLM({str(base)!r}, device="cpu", dtype="float32", page_size=2, memory_bytes=16 << 20)   # imports, warm-up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for path in {[str(d) for d in dirs.values()]!r}:
    try:
        LLM(path, device="cpu", dtype="float32", page_size=2, memory_bytes=16 << 20)
    except Exception as exc:
        print(type(exc).__name__, exc)
    else:
        sys.exit("loaded " + path)
print("growth_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("ConfigError") and "num_experts" in lines[0], lines[0]
    assert lines[1].startswith("CheckpointError") and "mis-shaped" in lines[1], lines[1]
    growth_mib = int(lines[-1].split()[1]) / 1024
    assert growth_mib < 32, f"refusing the huge configs raised peak RSS by {growth_mib:.0f} MiB"


# ---- tensors ----------------------------------------------------------------------------------------------------

def _drop(name):
    return lambda t: t.pop(name)


def _cast(name, dtype):
    return lambda t: t.__setitem__(name, t[name].to(dtype))


def _poison(name, value):
    def edit(t):
        t[name] = t[name].clone()
        t[name].view(-1)[3] = value
    return edit


TENSOR_CASES = {
    "missing": (EMBED, _drop(EMBED), ("missing", "embed_tokens.weight", "ckpt")),
    "missing_mxfp4_half": (EXPERT + ".weight_scale", _drop(EXPERT + ".weight_scale"),
                           ("missing", "experts.3.w1", "other half")),
    "extra": (EMBED, lambda t: t.__setitem__("language_model.model.layers.0.bogus.weight", torch.ones(3)),
              ("unexpected", "layers.0.bogus.weight", "model-0000")),
    "int64_weight": (EMBED, _cast(EMBED, torch.int64), ("mis-typed", EMBED, "torch.int64", "model-0000")),
    "bool_weight": (EMBED, _cast(EMBED, torch.bool), ("mis-typed", EMBED, "torch.bool")),
    "uint8_weight": (EMBED, _cast(EMBED, torch.uint8), ("mis-typed", EMBED, "torch.uint8")),
    "float_mxfp4_codes": (EXPERT + ".weight_packed", _cast(EXPERT + ".weight_packed", torch.float32),
                          ("mis-typed", EXPERT + ".weight_packed", "uint8")),
    "nan_weight": (EMBED, _poison(EMBED, float("nan")), ("NaN or Inf", EMBED, "model-0000")),
    "inf_weight": ("language_model.model.layers.2.self_attn.o_proj.weight",
                   _poison("language_model.model.layers.2.self_attn.o_proj.weight", float("inf")),
                   ("NaN or Inf", "layers.2.self_attn.o_proj.weight")),
    "misshaped_expert": (EXPERT + ".weight_packed",
                         lambda t: t.__setitem__(EXPERT + ".weight_packed", t[EXPERT + ".weight_packed"][:, :8]
                                                 .contiguous()),
                         ("mis-shaped", EXPERT + ".weight_packed", "[32, 8]")),
}


@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_bad_tensors_are_refused_by_file_and_name(base, tmp_path, case):
    tensor, edit, names = TENSOR_CASES[case]
    directory = _copy(base, tmp_path)
    _edit_tensors(directory, tensor, edit)
    _refused(directory, *names)


def test_finiteness_check_can_be_turned_off(base, tmp_path):
    directory = _copy(base, tmp_path)
    _edit_tensors(directory, EMBED, _poison(EMBED, float("nan")))
    config = ModelConfig.from_hf(directory)
    weights = load_checkpoint(directory, config, dtype=torch.float32, check_finite=False)
    assert weights["model.embed_tokens.weight"].isnan().sum() == 1


def test_duplicate_tensor_across_shards(base, tmp_path):
    directory = _copy(base, tmp_path)
    first = load_file(str(directory / SHARDS[0]))
    name = next(iter(first))
    _edit_tensors(directory, next(n for n in load_file(str(directory / SHARDS[1]))),
                  lambda t: t.__setitem__(name, first[name]))
    _refused(directory, "duplicate", name, SHARDS[0], SHARDS[1])


# ---- safetensors files ----------------------------------------------------------------------------------------

def _header(path: Path) -> tuple[int, bytes]:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return length, raw


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])


def _lying_length(path: Path) -> None:
    _, raw = _header(path)
    path.write_bytes((len(raw) * 2).to_bytes(8, "little") + raw[8:])


def _garbage_header(path: Path) -> None:
    length, raw = _header(path)
    path.write_bytes(raw[:8] + b"{" + b"\x00" * (length - 1) + raw[8 + length:])


def _short_file(path: Path) -> None:
    path.write_bytes(b"\x01\x02\x03")


def _offsets_disagree(path: Path) -> None:
    length, raw = _header(path)
    header = json.loads(raw[8:8 + length])
    name = next(n for n in header if n != "__metadata__")
    header[name]["shape"] = [d * 2 for d in header[name]["shape"]]
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def _header_not_object(path: Path) -> None:
    length, raw = _header(path)
    text = b"[1, 2, 3]".ljust(length)
    path.write_bytes(raw[:8] + text + raw[8 + length:])


FILE_CASES = {"truncated": (_truncate, "truncated"), "lying_header_length": (_lying_length, "header length"),
              "garbage_header_json": (_garbage_header, "not JSON"), "shorter_than_8_bytes": (_short_file, "8-byte"),
              "offsets_disagree_with_shape": (_offsets_disagree, "data_offsets span"),
              "header_not_an_object": (_header_not_object, "not a JSON object")}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_corrupt_safetensors_files(base, tmp_path, case):
    corrupt, what = FILE_CASES[case]
    directory = _copy(base, tmp_path)
    corrupt(directory / SHARDS[1])
    _refused(directory, SHARDS[1], what)


# ---- the index and the directory ------------------------------------------------------------------------------

def _outside_file(tmp_path: Path, base: Path) -> Path:
    other = tmp_path / "elsewhere"
    shutil.copytree(base, other)
    return other / SHARDS[1]


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_may_not_leave_the_directory(base, tmp_path, how):
    directory = _copy(base, tmp_path)
    outside = _outside_file(tmp_path, base)
    if how == "symlink":
        (directory / SHARDS[1]).unlink()
        (directory / SHARDS[1]).symlink_to(outside)
        _refused(directory, SHARDS[1], "outside the checkpoint directory")
        return
    target = "../elsewhere/" + SHARDS[1] if how == "dotdot" else str(outside)
    _edit_index(directory, lambda m: m.update({k: target for k, v in m.items() if v == SHARDS[1]}))
    (directory / SHARDS[1]).unlink()
    _refused(directory, INDEX, target, "inside the checkpoint directory")


def test_hugging_face_cache_links_into_blobs_are_followed(base, tmp_path):
    """The hub's own layout: snapshots/<rev>/<file> -> ../../blobs/<hash>; that is the same repository."""
    repo = tmp_path / "models--x--y"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, file in enumerate(sorted(p.name for p in base.iterdir())):
        shutil.copy(base / file, blobs / f"blob{i}")
        (snapshot / file).symlink_to(Path("../../blobs") / f"blob{i}")
    config = ModelConfig.from_hf(snapshot)
    assert load_checkpoint(snapshot, config, dtype=torch.float32)


def test_index_naming_a_missing_file(base, tmp_path):
    directory = _copy(base, tmp_path)
    (directory / SHARDS[1]).unlink()
    _refused(directory, INDEX, "missing file", SHARDS[1])


def test_index_garbage(base, tmp_path):
    directory = _copy(base, tmp_path)
    (directory / INDEX).write_text('{"weight_map": ')
    _refused(directory, INDEX, "not readable JSON")


def test_directory_without_weights(base, tmp_path):
    directory = tmp_path / "empty"
    directory.mkdir()
    shutil.copy(base / "config.json", directory)
    _refused(directory, str(directory), "neither model.safetensors nor")


class _Explodes:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('executed')",))


def test_pickle_only_directory_is_never_unpickled(base, tmp_path):
    directory = tmp_path / "pickled"
    directory.mkdir()
    shutil.copy(base / "config.json", directory)
    marker = tmp_path / "marker"
    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(_Explodes(str(marker))))
    _refused(directory, "pytorch_model.bin", "pickle")
    assert not marker.exists()


# ---- tokenizer files -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("files, name", [
    ({"tokenizer.json": "{garbage"}, "tokenizer.json"),
    ({"tiktoken.model": "AAAA 0\n"}, "tokenizer_config.json"),                # no tokenizer_config.json
    ({"tiktoken.model": "not base64 !!\n", "tokenizer_config.json": "{}"}, "tiktoken.model"),
    ({"tokenizer.json": "{}", "tokenizer_config.json": "[[["}, "tokenizer_config.json"),
])
def test_tokenizer_files_garbage(base, tmp_path, files, name):
    directory = _copy(base, tmp_path)
    for file, text in files.items():
        (directory / file).write_text(text)
    _refused(directory, name)


# ---- the server --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("breakage", ["config", "weights"])
def test_server_exits_with_the_sentence_and_no_traceback(base, tmp_path, breakage):
    directory = _copy(base, tmp_path)
    if breakage == "config":
        _edit_config(directory, num_experts=1_000_000)
        expected = "`num_experts`"
    else:
        _edit_tensors(directory, EMBED, _cast(EMBED, torch.int64))
        expected = EMBED
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-m", "k3core.serve", "--model", str(directory), "--port", "1"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
