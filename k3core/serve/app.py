"""The HTTP routes: OpenAI completions and chat (whole or streamed), models, health, metrics, abort, flush, and
the tokenizer routes (/tokenize, /detokenize, /tokenizer_info).

Routes run on the event loop and never call the engine: they parse and check the request, tokenize, hand the
engine requests to the engine thread (`Generation.start`) and relay its events. Every error a client can cause
leaves in the OpenAI envelope with its status (see `protocol.APIError`), and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
import weakref
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3core.sampling_params import SamplingParams
from k3core.chat import chat_format
from k3core.serve import chat as chat_module
from k3core.serve import constraints
from k3core.serve import responses
from k3core.serve.access_log import AccessLogMiddleware, note_error, note_usage
from k3core.serve.admission import Admission
from k3core.serve.args import ServerArgs
from k3core.serve.body import parse_json_off_loop, read_body
from k3core.serve.engine_thread import EngineThread, ModelInfo
from k3core.serve.generation import Generation
from k3core.serve.http_warmup import HttpWarmup
from k3core.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from k3core.serve.protocol import APIError, ChatRequest, CompletionRequest, SamplingRequest, parse_chat, \
    parse_completion

DISCONNECT_POLL_S = 0.5      # a non-streaming request checks this often whether its client is still there
log = logging.getLogger("k3core.serve")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def create_app(args: ServerArgs, engine: EngineThread, metrics: ServerMetrics,
               warmup: HttpWarmup | None = None) -> FastAPI:
    app = FastAPI(title="k3core", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(AccessLogMiddleware, log_requests=not args.disable_log_requests)
    generations: dict[str, Generation] = {}        # request id -> its live generation, for /abort_request
    admission = Admission(args.max_queued_requests, args.max_queued_tokens)
    sampling_defaults = chat_module.generation_defaults(args.model)     # generation_config.json: temperature, top_p, top_k
    started = int(time.time())                     # the model cards' `created`

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        note_error(request, exc.message)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, "
                        f"/v1/chat/completions", 405: f"method {request.method} is not allowed on {request.url.path}"}
        error = APIError(message.get(exc.status_code, str(exc.detail)), status=exc.status_code,
                         type="invalid_request_error")
        note_error(request, error.message)
        return error_response(error)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(f"internal server error ({type(exc).__name__}: {exc})", status=500,
                                       type="server_error"))

    # ---- shared steps ---------------------------------------------------------------------------------
    def authorize(request: Request) -> None:
        if args.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), args.api_key.encode()):
            raise APIError("invalid API key: send `Authorization: Bearer <key>` with the key the server was started "
                           "with", status=401, code="invalid_api_key")

    def ready_info() -> ModelInfo:
        if engine.error is not None:
            raise APIError(f"the engine is not available ({engine.error}); fix it and restart the server",
                           status=503, type="server_error", code="engine_failed")
        if not engine.ready.is_set() or engine.info is None:
            raise APIError("the engine is still warming up; retry in a few seconds", status=503,
                           type="server_error", code="engine_not_ready")
        return engine.info

    async def read_json(request: Request) -> Any:
        """The parsed body (off the event loop; see k3core.serve.body for what is refused and why)."""
        data = await read_body(request, args.max_body_bytes, args.body_read_timeout)
        if data is None:
            raise APIError("the client disconnected while sending the body", code="client_disconnected")
        return await parse_json_off_loop(data)

    def check_model(name: str) -> None:
        if name != args.model_name:
            raise APIError(f"the model {name!r} does not exist; this server serves {args.model_name!r}",
                           status=404, param="model", code="model_not_found", type="invalid_request_error")

    def check_lengths(info: ModelInfo, prompts: list[list[int]], req: SamplingRequest, chat: bool) -> int:
        """Check every prompt against the context and the vocabulary; return max_tokens to use."""
        longest = max(len(p) for p in prompts)
        for prompt in prompts:
            bad = next((t for t in prompt if not 0 <= t < info.vocab_size), None)
            if bad is not None:
                raise APIError(f"token id {bad} in the prompt is outside the vocabulary (0..{info.vocab_size - 1})",
                               param="prompt", code="invalid_value")
        if longest > info.context_length:
            raise APIError(f"This model's maximum context length is {info.context_length} tokens. However, your "
                           f"request has {longest} input tokens. Please reduce the length of the input.",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        if "top_k" in req.given and req.top_k > info.vocab_size:
            raise APIError(f"'top_k' must be at most the vocabulary size {info.vocab_size} (0 or -1 turns it off), "
                           f"got {req.top_k}", param="top_k", code="invalid_value")
        max_tokens = req.max_tokens
        room = info.max_request_tokens()
        if max_tokens is None:
            # room for a long answer (K3 thinks first): what the context and the pool leave, capped by the flag
            max_tokens = max(min(args.default_max_tokens, info.context_length - longest, room - longest), 1)
        name = "max_completion_tokens" if chat else "max_tokens"
        if longest + max_tokens > info.context_length:
            raise APIError(f"This model's maximum context length is {info.context_length} tokens. However, you "
                           f"requested {longest + max_tokens} tokens ({longest} in the input, {max_tokens} in the "
                           f"completion). Please reduce the length of the input or of the completion.",
                           param=name if chat else "max_tokens", code="context_length_exceeded")
        if longest + max_tokens > room:
            raise APIError(f"the request needs {longest + max_tokens} tokens of KV memory but the pool holds at most "
                           f"{room} for one request; lower max_tokens or restart with a larger --memory-bytes",
                           param=name, code="request_too_large_for_memory")
        return max_tokens

    def sampling_params(req: SamplingRequest, max_tokens: int) -> SamplingParams:
        """The engine's parameters; temperature, top_p and top_k the request leaves out come from the model's
        generation_config.json when it has one."""
        picked = {key: getattr(req, key) if key in req.given else sampling_defaults.get(key, getattr(req, key))
                  for key in chat_module.SAMPLING_DEFAULT_KEYS}
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=float(picked["temperature"]),
                                  top_k=max(int(picked["top_k"]), 0), top_p=float(picked["top_p"]),
                                  min_p=req.min_p, seed=req.seed, stop=req.stop,
                                  stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  logprobs=req.logprobs, presence_penalty=req.presence_penalty,
                                  frequency_penalty=req.frequency_penalty,
                                  repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                                  logit_bias=req.logit_bias, prompt_logprobs=engine_prompt_logprobs(req))
        except ValueError as exc:
            raise APIError(str(exc), code="invalid_value") from None

    def engine_prompt_logprobs(req: SamplingRequest) -> int | None:
        """How many top alternatives per prompt token the engine computes: for `prompt_logprobs` and, with echo,
        for the prompt part of `logprobs` (the larger of the two)."""
        wanted = [req.prompt_logprobs]
        if isinstance(req, CompletionRequest) and req.echo:
            wanted.append(req.logprobs)
        wanted = [n for n in wanted if n is not None]
        return max(wanted) if wanted else None

    def timed_out(arrived: float) -> APIError | None:
        if args.request_timeout is None or time.monotonic() - arrived < args.request_timeout:
            return None
        return APIError(f"the request ran longer than {args.request_timeout:g} s (--request-timeout) and was "
                        "aborted; ask for fewer tokens or a shorter prompt", status=504, type="server_error",
                        code="request_timeout")

    async def collect(gen: Generation, request: Request, arrived: float) -> bool:
        """Wait for every choice; False (and everything aborted) if the client disconnected meanwhile."""
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            async for _ in gen.events(poll_s=DISCONNECT_POLL_S):
                if time.monotonic() >= next_check:
                    if await request.is_disconnected():
                        return False
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                timeout = timed_out(arrived)
                if timeout is not None:
                    raise timeout
        finally:
            gen.close()
        if gen.error is not None:
            rejected = any(c.finish_reason == "rejected" for c in gen.choices)
            raise APIError(gen.error, status=400 if rejected else 500,
                           type="invalid_request_error" if rejected else "server_error")
        return True

    async def stream(gen: Generation, model: str, chat: bool, arrived: float) -> AsyncIterator[str]:
        """Server-sent events, one per engine event with something to say; a cancelled stream aborts the rest.
        The engine requests start only once the response starts, so that nothing runs for a client already gone."""
        try:
            gen.start(arrived)
            if chat:
                yield responses.sse(responses.chat_chunk(gen, model, [
                    responses.chat_choice_delta(gen, c, {"role": "assistant", "content": ""}, [], [], False)
                    for c in gen.choices]))
            poll = None if args.request_timeout is None else DISCONNECT_POLL_S
            async for choice, delta, event in gen.events(poll_s=poll):
                timeout = timed_out(arrived)
                if timeout is not None:
                    gen.close()
                    yield responses.sse(timeout.body())
                    break
                if choice is None:
                    continue
                token_ids, entries = event.new_token_ids, event.new_logprobs
                message = responses.chat_delta(choice, delta) if chat else None
                if not (message if chat else delta) and not choice.finished and not (
                        entries and gen.params.logprobs is not None) and not responses.echo_pending(gen, choice):
                    continue
                if chat:
                    body = responses.chat_chunk(gen, model, [responses.chat_choice_delta(
                        gen, choice, message, token_ids, entries, choice.finished)])
                else:
                    body = responses.completion_chunk(gen, model, [responses.completion_stream_choice(
                        gen, choice, delta, len(token_ids), entries)])
                yield responses.sse(body)
            if gen.error is not None:
                yield responses.sse(APIError(gen.error, status=500, type="server_error").body())
            if gen.include_usage:
                chunk = responses.chat_chunk if chat else responses.completion_chunk
                yield responses.sse(chunk(gen, model, [], gen.usage()))
            yield responses.SSE_DONE
        finally:
            gen.close()

    async def serve(request: Request, chat: bool) -> Response:
        arrived = time.monotonic()
        authorize(request)
        body = await read_json(request)
        req: CompletionRequest | ChatRequest = parse_chat(body) if chat else parse_completion(body)
        if req.ignored:
            log.warning("ignored unknown request fields: %s", ", ".join(req.ignored))
        check_model(req.model)
        num_choices = req.n * (1 if chat else len(req.prompts))
        if num_choices > args.max_choices_per_request:
            raise APIError(f"the request asks for {num_choices} choices (prompts x n); this server takes at most "
                           f"{args.max_choices_per_request} per request (--max-choices-per-request)",
                           param="n" if chat or len(req.prompts) == 1 else "prompt", code="request_too_large")
        info = ready_info()
        parser_factory = None
        if chat:
            prompts = [chat_ids(info, req)]
            parser_factory = lambda: chat_module.output_parser(info.tokenizer, req)  # noqa: E731
        else:
            prompts = [list(info.tokenizer.encode(p)) if isinstance(p, str) else p for p in req.prompts]
        if any(not p for p in prompts):
            raise APIError("the prompt encodes to no tokens; give some text", param="prompt", code="invalid_value")
        params = sampling_params(req, check_lengths(info, prompts, req, chat))
        params.structured = await structured_spec(info, req, chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        echo_texts = None
        if isinstance(req, CompletionRequest) and req.echo:     # the prompt as given, or its ids decoded
            echo_texts = [p if isinstance(p, str) else info.tokenizer.decode(p) for p in req.prompts]
        ticket = admission.admit(num_choices, req.n * sum(len(p) for p in prompts))
        gen = Generation(engine, request_id, prompts, params, req.n, info.tokenizer, generations,
                         include_usage=req.include_usage, parser_factory=parser_factory, echo_texts=echo_texts,
                         prompt_logprobs=req.prompt_logprobs,
                         max_buffered_events=args.max_stream_buffer_events if req.stream else None,
                         on_done=ticket.release, hide_cached_tokens=args.hide_cached_tokens,
                         observe=warmup is None or not warmup.is_warmup(request.headers))
        weakref.finalize(gen, ticket.release)    # a stream whose response never started never closes its generation
        note_usage(request, gen.usage)
        if req.stream:
            return StreamingResponse(stream(gen, args.model_name, chat, arrived), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        gen.start(arrived)
        if not await collect(gen, request, arrived):
            note_error(request, "the client disconnected before the response; its request was aborted")
            return Response(status_code=499)        # the client left; nobody reads this
        return JSONResponse(responses.chat_body(gen, args.model_name) if chat
                            else responses.completion_body(gen, args.model_name))

    def chat_ids(info: ModelInfo, req: ChatRequest) -> list[int]:
        return chat_module.chat_prompt_ids(info.tokenizer, req)

    async def structured_spec(info: ModelInfo, req: CompletionRequest | ChatRequest, chat: bool):
        """The request's output constraint, compiled here (off the event loop, cached) so that a bad schema, regex
        or grammar is a 400 naming its field before anything is queued; None without one."""
        thinking = chat and chat_module.thinking_of(info.tokenizer, req)
        spec = constraints.request_spec(req, info.tokenizer, thinking)
        if spec is None:
            return None
        from k3core.structured import StructuredError
        from k3core.structured.compiler import compile_spec
        eos_ids = tuple(getattr(info.tokenizer, "eos_token_ids", ()) or ())
        try:
            await asyncio.to_thread(compile_spec, info.tokenizer, info.vocab_size, eos_ids, spec)
        except StructuredError as exc:
            raise APIError(str(exc), param=exc.field, code="invalid_value") from None
        return spec

    # ---- tokenizer routes (vLLM's names; lm-eval's remote tokenizer reads them) ---------------------------
    def optional_model(body: dict) -> None:
        if body.get("model") is not None:
            check_model(body["model"])

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """`{"prompt"}` -> the ids of the text, special tokens' spellings read as those tokens (as Hugging Face
        tokenizers do); `{"messages", "tools"?, ...}` -> the prompt ids a chat request with these fields runs."""
        authorize(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", code="invalid_json")
        optional_model(body)
        info = ready_info()
        if "messages" in body:
            add_generation_prompt = body.get("add_generation_prompt", True)
            if not isinstance(add_generation_prompt, bool):
                raise APIError("'add_generation_prompt' must be a boolean", param="add_generation_prompt",
                               code="invalid_type")
            req = parse_chat({**body, "model": args.model_name, "stream": False})
            tokens = chat_module.chat_prompt_ids(info.tokenizer, req, add_generation_prompt)
        elif isinstance(body.get("prompt"), str):
            encode = getattr(info.tokenizer, "encode_with_specials", info.tokenizer.encode)
            tokens = list(encode(body["prompt"]))
        else:
            raise APIError("give 'prompt' (a string) or 'messages' (a chat) to tokenize", param="prompt",
                           code="missing_required_parameter")
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": info.context_length})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        authorize(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", code="invalid_json")
        optional_model(body)
        info = ready_info()
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise APIError("'tokens' must be a list of token ids", param="tokens", code="invalid_type")
        bad = next((t for t in tokens if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise APIError(f"token id {bad} is outside the vocabulary (0..{info.vocab_size - 1})", param="tokens",
                           code="invalid_value")
        return JSONResponse({"prompt": info.tokenizer.decode(tokens)})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> JSONResponse:
        """What a remote-tokenizer client reads: the special tokens (spelled so that /tokenize turns them back
        into their ids), the jinja chat template when the model has one, and the context length."""
        authorize(request)
        info = ready_info()
        tokenizer = info.tokenizer
        name = getattr(tokenizer, "token_name", lambda token_id: None)
        eos_ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        bos_id, pad_id = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "pad_token_id", None)
        return JSONResponse({
            "tokenizer_class": type(tokenizer).__name__, "chat_format": chat_format(tokenizer),
            "chat_template": getattr(tokenizer, "chat_template", None),
            "eos_token": name(eos_ids[0]) if eos_ids else None, "eos_token_id": eos_ids[0] if eos_ids else None,
            "eos_token_ids": list(eos_ids), "bos_token": name(bos_id), "bos_token_id": bos_id,
            "pad_token": name(pad_id), "pad_token_id": pad_id, "model_max_length": info.context_length,
            "vocab_size": info.vocab_size})

    # ---- routes ---------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    def model_card() -> dict[str, Any]:
        """The OpenAI model object, plus vLLM's max_model_len once the engine knows it."""
        card: dict[str, Any] = {"id": args.model_name, "object": "model", "created": started,
                                "owned_by": "k3core"}
        if engine.info is not None:
            card["max_model_len"] = engine.info.context_length
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
        authorize(request)
        check_model(model_id)
        return JSONResponse(model_card())

    @app.get("/health")
    async def health() -> JSONResponse:
        ready_info()
        if warmup is not None and not warmup.done.is_set():
            raise APIError("the server is warming up its HTTP path; retry in a few seconds", status=503,
                           type="server_error", code="engine_not_ready")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_route() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        authorize(request)
        body = await read_json(request)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            raise APIError("give the id of the request to abort as {\"rid\": \"cmpl-...\"}", param="rid",
                           code="invalid_type")
        gen = generations.get(rid)
        if gen is None:
            raise APIError(f"no running request has id {rid!r} (it may have finished already)", status=404,
                           param="rid", code="request_not_found")
        gen.abort()
        return JSONResponse({"success": True, "rid": rid})

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> JSONResponse:
        authorize(request)
        ready_info()
        flushed = await asyncio.wrap_future(engine.flush_cache())
        return JSONResponse({"success": bool(flushed)})

    return app
