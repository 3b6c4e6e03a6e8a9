"""OpenAI response objects (completions and chat, whole and streamed) built from a `Generation`'s choices.

Completions with `echo` start each choice's text with its prompt (streamed: in the choice's first chunk), and with
`logprobs` its logprobs cover the prompt tokens first: `null` for the first token, which has no prefix. vLLM's
`prompt_logprobs` extension is a list per completion choice and one list per chat response (its choices share the
prompt): `null`, then per prompt token `{token id: {logprob, rank, decoded_token}}` for the token and its top N.
"""
from __future__ import annotations

import json
from typing import Any

from k3core.prompt_logprobs import PromptLogprobs
from k3core.serve import chat
from k3core.serve.generation import Choice, Generation, Usage
from k3core.serve.text import token_text
from k3core.stop import IncrementalDetokenizer


# Characters that json.dumps(ensure_ascii=False) leaves raw but that line-based SSE readers (Python's
# str.splitlines, JavaScript line terminators) take for line breaks: escaped, the event stays one line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event; its JSON is one line for every reader."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {text}\n\n"


SSE_DONE = sse("[DONE]")


def _top(entry: dict[int, float], num: int) -> list[tuple[int, float]]:
    """The `num` most likely tokens of one logprob entry (the engine adds the chosen token to the top-N)."""
    return sorted(entry.items(), key=lambda item: -item[1])[:num]


# ---- completions --------------------------------------------------------------------------------
def completion_logprobs(tokenizer: Any, choice: Choice, start: int, entries: list[dict[int, float]],
                        num: int, offset_base: int = 0) -> dict[str, Any]:
    """Logprobs of the tokens `choice.token_ids[start:]`; `text_offset` counts characters of the output text
    (after `offset_base` characters of echoed prompt)."""
    tokens, token_logprobs, tops = [], [], []
    for token_id, entry in zip(choice.token_ids[start:], entries):
        tokens.append(token_text(tokenizer, token_id))
        token_logprobs.append(entry.get(token_id))
        tops.append({token_text(tokenizer, t): v for t, v in _top(entry, num)} if num else None)
    offsets = [offset_base + n for n in choice.text_offsets(tokenizer, start)[:len(tokens)]]
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_completion_logprobs(tokenizer: Any, prompt_ids: list[int], scored: PromptLogprobs | None,
                               num: int) -> dict[str, Any]:
    """The echoed prompt's part of a completion's logprobs: the first token's logprob and top are null (no prefix;
    so is every entry the engine did not compute, when the request ended early). `text_offset` counts characters of
    the decoded prompt before each token, a character still incomplete (split UTF-8) not counted yet."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    entries = scored.entries if scored is not None else [None] * len(prompt_ids)
    tokens, token_logprobs, tops, offsets, chars = [], [], [], [], 0
    for token_id, entry in zip(prompt_ids, entries):
        tokens.append(token_text(tokenizer, token_id))
        token_logprobs.append(entry.get(token_id) if entry is not None else None)
        tops.append({token_text(tokenizer, t): v for t, v in _top(entry, num)} if num and entry is not None
                    else None)
        offsets.append(chars)
        chars += len(detokenizer.push([token_id]))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: Any, prompt_ids: list[int], scored: PromptLogprobs | None,
                         num: int) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null first, then per prompt token the token and its top `num` alternatives, each
    `{logprob, rank, decoded_token}` (the alternatives ranked by their order, the token by the engine's count)."""
    if scored is None:
        return [None] * len(prompt_ids)
    out: list[dict[int, dict[str, Any]] | None] = []
    for token_id, entry, rank in zip(prompt_ids, scored.entries, scored.ranks):
        if entry is None:
            out.append(None)
            continue
        position = {t: {"logprob": v, "rank": r, "decoded_token": token_text(tokenizer, t)}
                    for r, (t, v) in enumerate(_top(entry, num), start=1)}
        position[token_id] = {"logprob": entry[token_id], "rank": rank,
                              "decoded_token": token_text(tokenizer, token_id)}
        out.append(position)
    return out


def echo_pending(gen: Generation, choice: Choice) -> bool:
    """Whether the choice's next streamed chunk must carry the echoed prompt."""
    return gen.echo_texts is not None and not choice.echo_sent


def completion_choice(gen: Generation, choice: Choice, text: str, num_new_tokens: int,
                      entries: list[dict[int, float]], finish: bool, with_prompt: bool = False) -> dict[str, Any]:
    """One choice of a response (all tokens) or of a chunk (the last `num_new_tokens` of the choice); with_prompt:
    the echoed prompt first, in the text and in the logprobs."""
    prompt_ids = gen.prompts[choice.prompt_index]
    echo_text = gen.echo_texts[choice.prompt_index] if gen.echo_texts is not None else ""   # offsets start after it
    echoed = echo_text if with_prompt and gen.echo_texts is not None else None
    logprobs = None
    if gen.params.logprobs is not None:
        logprobs = completion_logprobs(gen.tokenizer, choice, len(choice.token_ids) - num_new_tokens, entries,
                                       gen.params.logprobs, len(echo_text))
        if echoed is not None:
            prompt_part = prompt_completion_logprobs(gen.tokenizer, prompt_ids, choice.prompt_logprobs,
                                                     gen.params.logprobs)
            logprobs = {key: prompt_part[key] + logprobs[key] for key in logprobs}
    body = {"index": choice.index, "text": text if echoed is None else echoed + text, "logprobs": logprobs,
            "finish_reason": choice.finish_reason if finish else None}
    if gen.prompt_logprobs is not None and with_prompt:
        body["prompt_logprobs"] = vllm_prompt_logprobs(gen.tokenizer, prompt_ids, choice.prompt_logprobs,
                                                       gen.prompt_logprobs)
    return body


def completion_stream_choice(gen: Generation, choice: Choice, delta: str, num_new_tokens: int,
                             entries: list[dict[int, float]]) -> dict[str, Any]:
    """A streamed chunk's choice: the new text and tokens, after the echoed prompt in the choice's first chunk."""
    with_prompt = echo_pending(gen, choice)
    choice.echo_sent = choice.echo_sent or with_prompt
    return completion_choice(gen, choice, delta, num_new_tokens, entries, choice.finished, with_prompt)


def completion_body(gen: Generation, model: str) -> dict[str, Any]:
    choices = [completion_choice(gen, c, c.text, len(c.token_ids), c.logprobs, True, with_prompt=True)
               for c in gen.choices]
    return {"id": gen.request_id, "object": "text_completion", "created": gen.created, "model": model,
            "choices": choices, "usage": gen.usage().body()}


def _stream_chunk(kind: str, gen: Generation, model: str, choices: list[dict[str, Any]],
                  usage: Usage | None) -> dict[str, Any]:
    body = {"id": gen.request_id, "object": kind, "created": gen.created, "model": model, "choices": choices}
    if gen.include_usage:                     # every chunk carries the key; only the last one a value
        body["usage"] = usage.body() if usage is not None else None
    return body


def completion_chunk(gen: Generation, model: str, choices: list[dict[str, Any]],
                     usage: Usage | None = None) -> dict[str, Any]:
    return _stream_chunk("text_completion", gen, model, choices, usage)


# ---- chat -----------------------------------------------------------------------------------------
def _token_entry(tokenizer: Any, token_id: int, logprob: float | None) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float]],
                  num: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, entries):
        item = _token_entry(tokenizer, token_id, entry.get(token_id))
        item["top_logprobs"] = [_token_entry(tokenizer, t, v) for t, v in _top(entry, num)]
        content.append(item)
    return {"content": content}


def chat_finish_reason(choice: Choice) -> str | None:
    return chat.finish_reason(choice.finish_reason, bool(choice.parser is not None and choice.parser.tool_calls))


def chat_message(choice: Choice) -> dict[str, Any]:
    """The whole message of a finished choice: its text, or what the K3 parser reads in it."""
    if choice.parser is None:
        return {"role": "assistant", "content": choice.text}
    choice.parser.feed(choice.text)
    choice.parser.finish()
    return chat.message_body(choice.parser.result())


def chat_body(gen: Generation, model: str) -> dict[str, Any]:
    choices = []
    for c in gen.choices:
        logprobs = None
        if gen.params.logprobs is not None:
            logprobs = chat_logprobs(gen.tokenizer, c.token_ids, c.logprobs, gen.params.logprobs)
        message = chat_message(c)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs,
                        "finish_reason": chat_finish_reason(c)})
    body = {"id": gen.request_id, "object": "chat.completion", "created": gen.created, "model": model,
            "choices": choices, "usage": gen.usage().body()}
    if gen.prompt_logprobs is not None:       # one prompt for every choice: any choice's (the first that has it)
        scored = next((c.prompt_logprobs for c in gen.choices if c.prompt_logprobs is not None), None)
        body["prompt_logprobs"] = vllm_prompt_logprobs(gen.tokenizer, gen.prompts[0], scored, gen.prompt_logprobs)
    return body


def chat_chunk(gen: Generation, model: str, choices: list[dict[str, Any]],
               usage: Usage | None = None) -> dict[str, Any]:
    return _stream_chunk("chat.completion.chunk", gen, model, choices, usage)


def chat_delta(choice: Choice, text: str) -> dict[str, Any]:
    """A streamed chunk's delta for `text`, the choice's new output: the text itself, or what the K3 parser hands
    out for it (everything it held back too, once the choice has finished)."""
    if choice.parser is None:
        return {"content": text} if text else {}
    parsed = choice.parser.feed(text)
    if choice.finished:
        parsed = chat.merge_deltas(parsed, choice.parser.finish())
    return chat.delta_body(parsed)


def chat_choice_delta(gen: Generation, choice: Choice, delta: dict[str, Any], token_ids: list[int],
                      entries: list[dict[int, float]], finish: bool) -> dict[str, Any]:
    logprobs = None
    if gen.params.logprobs is not None and token_ids:
        logprobs = chat_logprobs(gen.tokenizer, token_ids, entries, gen.params.logprobs)
    return {"index": choice.index, "delta": delta, "logprobs": logprobs,
            "finish_reason": chat_finish_reason(choice) if finish else None}
