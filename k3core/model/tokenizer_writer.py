"""Write a Kimi-format tokenizer (`tiktoken.model` + `tokenizer_config.json`) for tests and test checkpoints.

The layout is the published one (../shared/K3_CHAT_FORMAT.md section 2): one `base64(bytes) rank` line per token,
then 256 reserved special ids after the ranks, named in `added_tokens_decoder` at K3's offsets (`[BOS]` +0,
`[EOS]` +1, `<|end_of_msg|>` +2, `<|open|>` +3, `<|close|>` +4, `<|sep|>` +5, ...), the three structure markers
marked `"special": false`. `tokenizer_class` and `auto_map` name the checkpoint's Python tokenizer as the release
does; k3core never runs it.

`prefix_ranks(words)` is a small vocabulary for tests: the 256 single bytes, then every prefix (two bytes or
longer) of each word, so that BPE can build each word by merging left to right.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Iterable, Sequence

K3_SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    254: "[UNK]", 255: "[PAD]",
}
# K2-family (Kimi-Linear) names at the K2 tokenizer's offsets (163584 + offset), as a public port of the K2
# special-token table gives them: chat roles 2-4, 10 and 17, the tool-call markers 11-15. Not checked against
# Kimi-Linear's own tokenizer_config.json (../shared/K3_CHAT_FORMAT.md says the two share the tokenizer).
K2_SPECIAL_OFFSETS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                      6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                      11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                      14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
                      254: "[UNK]", 255: "[PAD]"}
NOT_SPECIAL = ("<|open|>", "<|close|>", "<|sep|>")


def prefix_ranks(words: Iterable[str]) -> list[bytes]:
    ranks = [bytes([b]) for b in range(256)]
    seen = set(ranks)
    for word in words:
        data = word.encode("utf-8")
        for end in range(2, len(data) + 1):
            if data[:end] not in seen:
                seen.add(data[:end])
                ranks.append(data[:end])
    return ranks


def write_kimi_tokenizer(directory: str | Path, ranks: Sequence[bytes],
                         special_offsets: dict[int, str] | None = None,
                         chat_template: str | None = None) -> dict[str, int]:
    """Write the two tokenizer files into `directory`; returns name -> id of the named specials."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    offsets = K3_SPECIAL_OFFSETS if special_offsets is None else special_offsets
    with open(directory / "tiktoken.model", "w") as handle:
        for rank, token in enumerate(ranks):
            handle.write(f"{base64.b64encode(token).decode()} {rank}\n")
    named = {name: len(ranks) + offset for offset, name in offsets.items()}
    decoder = {str(token_id): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": name not in NOT_SPECIAL}
               for name, token_id in sorted(named.items(), key=lambda item: item[1])}
    settings = {"tokenizer_class": "TikTokenTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                "added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
                "unk_token": "[UNK]", "clean_up_tokenization_spaces": False, "model_max_length": 1048576}
    if chat_template is not None:
        settings["chat_template"] = chat_template
    with open(directory / "tokenizer_config.json", "w") as handle:
        json.dump(settings, handle, indent=2, ensure_ascii=False)
    return named
