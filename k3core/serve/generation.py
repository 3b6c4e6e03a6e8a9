"""One HTTP request's engine requests (n samples of each prompt), their events, and their text so far.

A `Generation` lives on the HTTP event loop. It submits its engine requests to the engine thread with a sink that
moves events onto its own `asyncio.Queue` (thread-safe through `call_soon_threadsafe`), and whoever serves the
response iterates `events()`. Closing a generation before all its choices finished aborts the rest, which frees
their slots and pages on the engine thread: that is how a client that disconnects gives its memory back.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from k3core.prompt_logprobs import PromptLogprobs
from k3core.sampling_params import SamplingParams
from k3core.stop import IncrementalDetokenizer
from k3core.serve.engine_thread import EngineEvent, EngineThread


@dataclass
class Choice:
    index: int
    engine_id: str
    prompt_index: int
    num_prompt_tokens: int
    text_parts: list[str] = field(default_factory=list)     # the engine's text deltas, in order
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    parser: Any = None          # chat: a K3OutputParser splitting the text into reasoning / content / tool calls
    prompt_logprobs: PromptLogprobs | None = None    # the engine's, when the request needs them
    echo_sent: bool = False     # streaming with echo: the prompt went out (with the choice's first chunk)
    _offsets: list[int] = field(default_factory=list)   # text_offset of each token so far (logprobs)
    _offset_chars: int = 0
    _offset_detokenizer: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text_offsets(self, tokenizer: Any, start: int) -> list[int]:
        """Logprobs' `text_offset` of token_ids[start:]: the characters of output text before each token. Extended
        incrementally, so each token is decoded once over the request's life instead of the whole output being
        decoded again for every token. A character still incomplete before a token (a multi-byte UTF-8 character
        split across tokens) is not counted yet."""
        if self._offset_detokenizer is None:
            self._offset_detokenizer = IncrementalDetokenizer(tokenizer)
        while len(self._offsets) < len(self.token_ids):
            token_id = self.token_ids[len(self._offsets)]
            self._offsets.append(self._offset_chars)
            self._offset_chars += len(self._offset_detokenizer.push([token_id]))
        return self._offsets[start:]

    @property
    def text(self) -> str:
        if len(self.text_parts) > 1:
            self.text_parts[:] = ["".join(self.text_parts)]
        return self.text_parts[0] if self.text_parts else ""


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None            # None: hidden (--hide-cached-tokens)

    def body(self) -> dict[str, Any]:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens is not None:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return body


class Generation:
    def __init__(self, engine: EngineThread, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 n: int, tokenizer: Any, registry: dict[str, "Generation"], include_usage: bool = False,
                 parser_factory: Callable[[], Any] | None = None, echo_texts: list[str] | None = None,
                 prompt_logprobs: int | None = None, max_buffered_events: int | None = None,
                 on_done: Callable[[], None] | None = None, hide_cached_tokens: bool = False,
                 observe: bool = True):
        """`echo_texts`: completions with echo, the text of each prompt (its choices' text starts with it);
        `prompt_logprobs`: the top-N of vLLM's `prompt_logprobs` field, None = no such field.
        `max_buffered_events`: engine events waiting for the client to read them, at most; past that the client
        is too slow (a stalled reader) and every choice is aborted, its events dropped. `on_done` runs once, when
        the generation closes or is aborted that way. `observe`: False leaves its engine requests out of the
        request metrics (the server's own HTTP warm-up)."""
        self.engine = engine
        self.observe = observe
        self.max_buffered_events = max_buffered_events
        self.on_done = on_done
        self.hide_cached_tokens = hide_cached_tokens
        self.overflowed = False
        self.include_usage = include_usage
        self.request_id = request_id
        self.prompts = prompts
        self.tokenizer = tokenizer            # for logprob token texts; the engine turns tokens into text
        self.created = int(time.time())
        self.registry = registry
        self.queue: asyncio.Queue[tuple[int, EngineEvent]] = asyncio.Queue()
        self.choices: list[Choice] = []
        for prompt_index, prompt in enumerate(prompts):
            for sample in range(n):
                index = len(self.choices)
                self.choices.append(Choice(index, f"{request_id}-{index}", prompt_index, len(prompt),
                                           parser=parser_factory() if parser_factory is not None else None))
        self.params = params
        self.echo_texts = echo_texts
        self.prompt_logprobs = prompt_logprobs

    def start(self, arrival: float) -> None:
        """Submit every choice; `arrival` (time.monotonic) is when the HTTP request came in, for TTFT."""
        loop = asyncio.get_running_loop()
        self.registry[self.request_id] = self
        for choice in self.choices:
            params = self.params
            if params.seed is not None and len(self.choices) > 1:
                # distinct but reproducible samples: each choice draws from its own seeded generator
                params = SamplingParams(**{**vars(params), "seed": params.seed + choice.index})
            else:
                params = SamplingParams(**vars(params))

            def sink(event: EngineEvent, index: int = choice.index) -> None:
                if not loop.is_closed():             # the server has shut down: nobody waits for the event
                    loop.call_soon_threadsafe(self._put, index, event)
            self.engine.submit(choice.engine_id, self.prompts[choice.prompt_index], params, sink, arrival,
                               observe=self.observe)

    def _put(self, index: int, event: EngineEvent) -> None:
        if self.overflowed:
            return
        if self.max_buffered_events is not None and self.queue.qsize() >= self.max_buffered_events:
            self._overflow()
            return
        self.queue.put_nowait((index, event))

    def _overflow(self) -> None:
        """The client stopped reading: abort every choice, free the buffered events, wake a waiting reader."""
        self.overflowed = True
        message = (f"the client read the stream too slowly ({self.max_buffered_events} events were waiting); the "
                   "request was aborted: read the stream as it arrives")
        for choice in self.choices:
            if not choice.finished:
                self.engine.abort(choice.engine_id)
                choice.finish_reason, choice.error = "abort", message
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait((-1, None))          # wakes events() if it waits; it then sees every choice finished
        self._done()

    def _done(self) -> None:
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            on_done()

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    async def events(self, poll_s: float | None = None) -> AsyncIterator[tuple[Choice | None, str, EngineEvent | None]]:
        """(choice, new text, the event) per engine event, until every choice has finished.

        With `poll_s`, yields `(None, "", None)` whenever no event came for that long, so that a caller can check
        whether its client is still there."""
        while not self.finished:
            try:
                if poll_s is None:
                    index, event = await self.queue.get()
                else:
                    index, event = await asyncio.wait_for(self.queue.get(), poll_s)
            except asyncio.TimeoutError:
                yield None, "", None
                continue
            if event is None:
                continue
            choice = self.choices[index]
            if choice.finished:
                continue
            delta = self._apply(choice, event)
            yield choice, delta, event

    def _apply(self, choice: Choice, event: EngineEvent) -> str:
        choice.token_ids.extend(event.new_token_ids)
        choice.logprobs.extend(event.new_logprobs)
        choice.num_cached_tokens = max(choice.num_cached_tokens, event.num_cached_tokens)
        if event.prompt_logprobs is not None:
            choice.prompt_logprobs = event.prompt_logprobs
        if event.new_text:
            choice.text_parts.append(event.new_text)
        if event.finished:
            choice.finish_reason = event.finish_reason or "stop"
            choice.error = event.error
        return event.new_text

    def close(self) -> None:
        """Abort every unfinished choice (the client went away or the server is answering with an error)."""
        for choice in self.choices:
            if not choice.finished:
                self.engine.abort(choice.engine_id)
                choice.finish_reason = "abort"
        self.registry.pop(self.request_id, None)
        self._done()

    def abort(self) -> None:
        """Abort on request of another client (POST /abort_request); the events report finish_reason 'abort'."""
        for choice in self.choices:
            if not choice.finished:
                self.engine.abort(choice.engine_id)

    def usage(self) -> Usage:
        prompt_tokens = sum(len(p) for p in self.prompts)
        cached = [0] * len(self.prompts)
        for choice in self.choices:
            cached[choice.prompt_index] = max(cached[choice.prompt_index], choice.num_cached_tokens)
        return Usage(prompt_tokens, sum(len(c.token_ids) for c in self.choices),
                     None if self.hide_cached_tokens else sum(cached))

    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error), None)
