"""The Kimi tokenizer as it ships (tiktoken.model + tokenizer_config.json), loaded as data only."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from k3core.config import ModelConfig
from k3core.model.tokenizer_writer import K3_SPECIAL_OFFSETS, prefix_ranks, write_kimi_tokenizer
from k3core.tokenizer import KIMI_PAT_STR, TiktokenTokenizer, TokenizerError, load_tokenizer

WORDS = ["Hello", " world", "message", " role", "assistant", "你好"]


def _config(num_ranks: int, **changes) -> ModelConfig:
    config = ModelConfig.preset("k3-tiny")
    extra = {**config.extra, "hf_model_type": "kimi_k3"}
    return config.replace(vocab_size=num_ranks + 256, bos_token_id=num_ranks, eos_token_id=num_ranks + 2,
                          pad_token_id=num_ranks + 255, extra=extra, **changes)


def _plant_remote_code(directory: Path) -> Path:
    """A tokenization_kimi.py (and encoding_k3.py) that would leave a marker file if anything ran them."""
    marker = directory / "REMOTE_CODE_RAN"
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    (directory / "tokenization_kimi.py").write_text(code)
    (directory / "encoding_k3.py").write_text(code)
    return marker


@pytest.fixture
def kimi_dir(tmp_path):
    ranks = prefix_ranks(WORDS)
    write_kimi_tokenizer(tmp_path, ranks)
    marker = _plant_remote_code(tmp_path)
    return tmp_path, ranks, marker


def test_loads_as_data_and_never_runs_checkpoint_code(kimi_dir):
    directory, ranks, marker = kimi_dir
    num_ranks = len(ranks)
    tokenizer = load_tokenizer(directory, _config(num_ranks))
    assert isinstance(tokenizer, TiktokenTokenizer)
    assert not marker.exists(), "a file from the checkpoint was executed"
    hello = ranks.index(b"Hello")
    world = ranks.index(b" world")
    assert tokenizer.encode("Hello world") == [hello, world]
    assert tokenizer.decode([hello, world]) == "Hello world"
    assert tokenizer.encode("你好") == [ranks.index("你好".encode())]
    # the special ids follow the ranks, named from added_tokens_decoder; unnamed ones are reserved_token_{id}
    for offset, name in K3_SPECIAL_OFFSETS.items():
        assert tokenizer.special_token_id(name) == num_ranks + offset
    assert tokenizer.special_token_id(f"<|reserved_token_{num_ranks + 8}|>") == num_ranks + 8
    assert tokenizer.bos_token_id == num_ranks
    assert tokenizer.eos_token_ids[0] == num_ranks + 2          # config.json's eos (<|end_of_msg|>) first
    assert num_ranks + 1 in tokenizer.eos_token_ids              # tokenizer_config's [EOS] also stops
    assert tokenizer.pad_token_id == num_ranks + 255


def test_specials_are_text_in_encode_and_tokens_in_encode_with_specials(kimi_dir):
    directory, ranks, _ = kimi_dir
    tokenizer = load_tokenizer(directory, _config(len(ranks)))
    sep = tokenizer.special_token_id("<|sep|>")
    plain = tokenizer.encode("a<|sep|>b")
    assert sep not in plain and tokenizer.decode(plain) == "a<|sep|>b"
    assert tokenizer.encode_with_specials("a<|sep|>b") == [ord("a"), sep, ord("b")]


def test_decode_keeps_structure_markers_and_drops_special_tokens(kimi_dir):
    directory, ranks, _ = kimi_dir
    tokenizer = load_tokenizer(directory, _config(len(ranks)))
    ids = {name: tokenizer.special_token_id(name) for name in ("<|open|>", "<|close|>", "<|sep|>",
                                                               "<|end_of_msg|>", "[EOS]", "[BOS]")}
    text = tokenizer.encode("think")
    out = tokenizer.decode([ids["[BOS]"], ids["<|close|>"], *text, ids["<|sep|>"], ids["<|open|>"],
                            ids["<|end_of_msg|>"], ids["[EOS]"], len(ranks) + 100])
    assert out == "<|close|>think<|sep|><|open|>"


def test_markers_stay_text_even_when_marked_special(tmp_path):
    """The parsers need the markers in the text, whatever the release's `special` flags say."""
    ranks = prefix_ranks(WORDS)
    write_kimi_tokenizer(tmp_path, ranks)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for entry in settings["added_tokens_decoder"].values():
        entry["special"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = load_tokenizer(tmp_path, _config(len(ranks)))
    assert tokenizer.decode([tokenizer.special_token_id("<|open|>")]) == "<|open|>"
    assert tokenizer.decode([tokenizer.special_token_id("[EOS]")]) == ""


def test_split_regex_matches_the_reference_splitter(kimi_dir):
    """tiktoken's split (with the && intersections) agrees with the `regex` module's reading of the same pattern:
    no token crosses a piece boundary, and a piece that is one rank is one token."""
    import regex
    directory, ranks, _ = kimi_dir
    tokenizer = load_tokenizer(directory, _config(len(ranks)))
    text = "Hello world's 12345 你好世界 ÉCOLE école\n\n  tabs\t\there!!! Hello你好 message role"
    pieces = regex.findall("(?V1)" + KIMI_PAT_STR, text)
    assert "".join(pieces) == text
    ids = tokenizer.encode(text)
    assert b"".join(ranks[i] for i in ids) == text.encode()
    piece_ends, position = set(), 0
    for piece in pieces:
        position += len(piece.encode())
        piece_ends.add(position)
    token_ends, position = set(), 0
    for token_id in ids:
        position += len(ranks[token_id])
        token_ends.add(position)
    assert piece_ends <= token_ends
    for word in ("Hello", "你好", " role"):
        assert word in pieces and ranks.index(word.encode()) in ids


def test_tokenizer_json_wins_and_still_works(tmp_path):
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import models, pre_tokenizers, decoders, trainers
    fast = FastTokenizer(models.BPE())
    fast.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast.decoder = decoders.ByteLevel()
    fast.train_from_iterator(["hello world"] * 5, trainer=trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast.save(str(tmp_path / "tokenizer.json"))
    write_kimi_tokenizer(tmp_path, prefix_ranks(WORDS))
    tokenizer = load_tokenizer(tmp_path, ModelConfig.preset("k3-tiny"))
    assert not isinstance(tokenizer, TiktokenTokenizer)
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    assert tokenizer.special_token_id("<|eos|>") not in tokenizer.encode("<|eos|>")     # text stays text
    assert tokenizer.encode_with_specials("<|eos|>") == [tokenizer.special_token_id("<|eos|>")]


def test_neither_format_fails_in_one_sentence(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TikTokenTokenizer",
         "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    marker = _plant_remote_code(tmp_path)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path, ModelConfig.preset("k3-tiny"))
    message = str(info.value)
    assert "tokenizer.json" in message and "tiktoken.model" in message and message.count(". ") == 0
    assert not marker.exists()


def test_tiktoken_without_config_and_bad_ranks_fail_clearly(tmp_path):
    (tmp_path / "tiktoken.model").write_text(f"{base64.b64encode(b'a').decode()} 0\n")
    with pytest.raises(TokenizerError, match="no tokenizer_config.json"):
        load_tokenizer(tmp_path, ModelConfig.preset("k3-tiny"))
    write_kimi_tokenizer(tmp_path, prefix_ranks(WORDS))
    (tmp_path / "tiktoken.model").write_text("not base64 at all\n")
    with pytest.raises(TokenizerError, match="not a tiktoken ranks file"):
        load_tokenizer(tmp_path, _config(300))


def test_vocabulary_larger_than_the_model_is_refused(kimi_dir):
    directory, ranks, _ = kimi_dir
    with pytest.raises(TokenizerError, match="vocab_size"):
        load_tokenizer(directory, _config(len(ranks)).replace(vocab_size=len(ranks) + 10))


def test_tokenizer_is_checked_before_any_weight_is_read(tmp_path):
    """A directory whose weights file is garbage fails on its tokenizer first: the weights were never opened."""
    from k3core import LLM
    from k3core.hf_config import k3_config_dict
    (tmp_path / "config.json").write_text(json.dumps(k3_config_dict(ModelConfig.preset("k3-tiny"))))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor tiktoken.model"):
        LLM(str(tmp_path), backend="torch", device="cpu", dtype="float32")
