"""Prompt logprobs and echo: the engine's per-prompt-token logprobs against one full-sequence forward, the prefix
cache left as it was, and the server's echo / `prompt_logprobs` responses as the OpenAI client and lm-eval read them.

Tolerance: the engine runs the prompt in chunks of 16 tokens, cut again at every KDA checkpoint, while
`LLM.prompt_logits` runs it in one float32 forward; the two sum the same terms in different orders, so their
logprobs agree to about 1e-5 (seen: 3e-6 on k3-tiny). PROMPT_TOL = 5e-5 is well below any change a wrong token,
position or state would make (those move logprobs by 1e-1 and more). Engine against engine (warm cache against cold,
overlapped against plain) runs the same computation and must be equal exactly; a run that resumes from a cached
checkpoint with positions from the prompt-logprob store sums the later tokens in another order (PROMPT_TOL).
"""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import torch

from k3core import LLM, SamplingParams

PROMPT_TOL = 5e-5
ENGINE = dict(page_size=4, checkpoint_interval=8, chunked_prefill_tokens=16)


def _prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(llm: LLM, ids: list[int]) -> torch.Tensor:
    """log_softmax of one full-sequence forward, float64 [T, V] (row p scores token p + 1)."""
    return torch.log_softmax(llm.prompt_logits(ids).double(), dim=-1)


def _assert_close(got, want) -> None:
    """Prompt logprobs of a run resumed from a cached checkpoint against a run from position 0: the tokens after
    the checkpoint sum in another order (seen: 1.4e-6), so PROMPT_TOL; ranks and top-N sets equal."""
    assert got.ranks == want.ranks
    for position, (a, b) in enumerate(zip(got.entries, want.entries)):
        assert (a is None) == (b is None), position
        if a is not None:
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < PROMPT_TOL for t in b), position


def _llm(model: str, **options) -> LLM:
    return LLM(model, backend="torch", device="cpu", dtype="float32", seed=3, **{**ENGINE, **options})


@pytest.mark.parametrize("model, overlap", [("k3-tiny", True), ("k3-tiny", False), ("k3-demo", True)])
def test_prompt_logprobs_match_one_full_forward(model, overlap):
    llm = _llm(model, overlap=overlap)
    ids = _prompt(1, 45)                      # 3 prefill chunks of 16, KDA checkpoints every 8 tokens
    out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    scored, ref = out.prompt_logprobs, _reference(llm, ids)
    assert scored.entries[0] is None and scored.ranks[0] is None and len(scored.entries) == len(ids)
    for position in range(1, len(ids)):
        token, entry, row = ids[position], scored.entries[position], ref[position - 1]
        assert abs(entry[token] - row[token].item()) < PROMPT_TOL, position
        top = torch.topk(row, 3)
        assert set(entry) == set(top.indices.tolist()) | {token}, position
        for token_id, value in entry.items():
            assert abs(value - row[token_id].item()) < PROMPT_TOL
        above_surely = int((row > row[token] + PROMPT_TOL).sum())
        above_maybe = int((row > row[token] - PROMPT_TOL).sum()) - 1       # the token itself is not above it
        assert above_surely + 1 <= scored.ranks[position] <= above_maybe + 1, position
    llm.engine.check_invariants()
    again = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    assert again.num_cached_tokens == 40 and again.token_ids == out.token_ids      # the store's 44 -> checkpoint 40
    assert again.prompt_logprobs.entries[:41] == scored.entries[:41]               # taken from the store
    _assert_close(again.prompt_logprobs, scored)


def test_max_tokens_zero_scores_the_prompt_only():
    llm = _llm("k3-tiny")
    ids = _prompt(2, 37)
    with_token = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    only = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert only.token_ids == [] and only.text == "" and only.finish_reason == "length"
    assert only.prompt_logprobs == with_token.prompt_logprobs
    assert all(set(e) == {t} for e, t in zip(only.prompt_logprobs.entries[1:], ids[1:]))
    llm.engine.check_invariants()
    assert llm.engine.flush_cache()
    assert llm.memory_usage().num_slots == 0 and llm.memory_usage().num_pages == 0


def test_a_warm_cache_gives_the_cold_values_and_stays_as_it_was():
    """Run a prompt twice (the second reads its cached prefix), then a prompt-logprobs request sharing 30 tokens of
    it, then the first prompt again: it hits the same prefix and computes exactly what it did before (every logprob
    equal), so nothing the cache held was written. The prompt-logprobs values equal a cold engine's exactly."""
    first = _prompt(3, 41)
    shared = first[:30] + _prompt(4, 13)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    scoring = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    warm = _llm("k3-tiny")
    warm.generate([first], greedy)
    before = warm.generate([first], greedy)[0]
    assert before.num_cached_tokens > 0
    warm.engine.check_invariants()
    scored_warm = warm.generate([shared], scoring)[0]
    assert scored_warm.num_cached_tokens == 0            # it read no cached prefix
    warm.engine.check_invariants()
    after = warm.generate([first], greedy)[0]
    warm.engine.check_invariants()
    assert after.num_cached_tokens == before.num_cached_tokens
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)
    scored_cold = _llm("k3-tiny").generate([shared], scoring)[0]
    assert scored_warm.prompt_logprobs == scored_cold.prompt_logprobs
    assert scored_warm.token_ids == scored_cold.token_ids
    assert scored_warm.prompt_logprobs.complete


def test_retracted_prompt_logprob_requests_recompute_the_same_values():
    """A pool for about two requests and seven of them: decodes retract the requests that computed least, one of
    them mid-prefill (some prompt positions already scored), which recomputes from position 0; every step keeps the
    invariants, and each request's tokens and prompt logprobs match it run alone."""
    alone = _llm("k3-tiny")
    prompts = [_prompt(10 + i, n) for i, n in enumerate([29, 35, 40, 33, 24, 31, 37])]
    params = SamplingParams(max_tokens=14, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    expected = [alone.generate([p], params)[0] for p in prompts]
    layout = alone.engine.pool.layout
    tight = _llm("k3-tiny", memory_bytes=2 * (layout.slot_bytes + 15 * layout.page_bytes))
    engine = tight.engine
    retracted = []                         # (tokens computed, tokens sampled) of each retracted request
    retract = engine.scheduler.retract

    def spy(request):
        retracted.append((request.num_computed_tokens, len(request.output_token_ids)))
        retract(request)
    engine.scheduler.retract = spy
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {}
    while engine.has_work:
        for output in engine.step():
            if output.prompt_logprobs is not None:
                outputs[output.request_id] = output.prompt_logprobs
        engine.check_invariants()
    assert any(computed > 0 and sampled == 0 for computed, sampled in retracted), (
        f"no request was retracted mid-prefill: {retracted}")
    for request_id, want in zip(ids, expected):
        assert engine.requests[request_id].output_token_ids == want.token_ids
        for got_entry, want_entry in zip(outputs[request_id].entries[1:], want.prompt_logprobs.entries[1:]):
            assert got_entry.keys() == want_entry.keys()
            assert all(abs(got_entry[t] - want_entry[t]) < PROMPT_TOL for t in got_entry)


# ---- the server ---------------------------------------------------------------------------------------------------
SERVER_MODEL = "k3-tiny"          # byte-level tokens: prompts split characters across tokens


@pytest.fixture(scope="module")
def server():
    from k3core.serve.args import ServerArgs
    from k3core.serve.launch import build_server
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    args = ServerArgs(model=SERVER_MODEL, port=port, memory_bytes=64 << 20, log_level="warning", seed=0,
                      cpu_threads=torch.get_num_threads(), page_size=16, checkpoint_interval=32,
                      chunked_prefill_tokens=16)
    srv = build_server(args)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline, status = time.monotonic() + 120, None
    while time.monotonic() < deadline and status != 200:
        try:
            status = httpx.get(base + "/health", timeout=2).status_code
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    assert status == 200, f"server did not become healthy (engine error {srv.engine.error})"
    yield base
    srv.shutdown()
    thread.join(15)
    sock.close()
    assert not thread.is_alive(), "the server thread did not stop"


@pytest.fixture(scope="module")
def offline():
    return LLM(SERVER_MODEL, backend="torch", device="cpu", dtype="float32", seed=0)


def _complete(server: str, **body) -> dict:
    response = httpx.post(server + "/v1/completions", json={"model": SERVER_MODEL, "temperature": 0, **body},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_covers_the_prompt(server, offline, max_tokens):
    ids = offline.tokenizer.encode(PROMPT)
    assert len(ids) > 16                                  # more than one prefill chunk on the server
    body = _complete(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens)
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and len(logprobs["tokens"]) == len(ids) + max_tokens
    assert body["usage"]["completion_tokens"] == max_tokens and body["usage"]["prompt_tokens"] == len(ids)
    if max_tokens == 0:
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"][:len(ids)]) == PROMPT
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    ref = _reference(offline, ids)
    for position in range(1, len(ids)):
        assert abs(logprobs["token_logprobs"][position] - ref[position - 1, ids[position]].item()) < PROMPT_TOL
        top = logprobs["top_logprobs"][position]
        assert len(top) == 1 and abs(max(top.values()) - ref[position - 1].max().item()) < PROMPT_TOL
    by_ids = _complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens)["choices"][0]
    assert by_ids["text"] == choice["text"] and by_ids["logprobs"] == logprobs


def test_echo_text_offsets_across_split_utf8(server, offline):
    text = "héllo 日本語 ok"
    ids = offline.tokenizer.encode(text)
    assert any("\ufffd" in offline.tokenizer.decode([t]) for t in ids), "no token splits a character here"
    logprobs = _complete(server, prompt=text, echo=True, logprobs=0, max_tokens=1)["choices"][0]["logprobs"]
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    for i in range(len(ids)):                # before token i: the characters decoded so far, whole ones only
        assert offsets[i] == len(offline.tokenizer.decode(ids[:i]).rstrip("\ufffd")), i
    assert offsets[len(ids)] == len(text)   # the generated token starts after the whole prompt


def test_echo_without_logprobs_and_streamed(server):
    whole = _complete(server, prompt=PROMPT, echo=True, max_tokens=4, logprobs=2,
                      ignore_eos=True)["choices"][0]
    with httpx.stream("POST", server + "/v1/completions", timeout=60, json={
            "model": SERVER_MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 4, "temperature": 0,
            "logprobs": 2, "stream": True, "ignore_eos": True}) as response:
        import json
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][key]] == \
            whole["logprobs"][key], key
    plain = _complete(server, prompt=PROMPT, echo=True, max_tokens=0)["choices"][0]
    assert plain["text"] == PROMPT and plain["logprobs"] is None and plain["finish_reason"] == "length"


def test_vllm_prompt_logprobs_on_both_endpoints(server, offline):
    ids = offline.tokenizer.encode(PROMPT)
    choice = _complete(server, prompt=PROMPT, max_tokens=2, prompt_logprobs=2)["choices"][0]
    listed = choice["prompt_logprobs"]
    assert not choice["text"].startswith(PROMPT) and len(listed) == len(ids) and listed[0] is None
    ref = _reference(offline, ids)
    for position in range(1, len(ids)):
        entry = listed[position]
        token = str(ids[position])
        assert token in entry and len(entry) in (2, 3)
        assert abs(entry[token]["logprob"] - ref[position - 1, ids[position]].item()) < PROMPT_TOL
        assert entry[token]["decoded_token"] == offline.tokenizer.decode([ids[position]])
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]      # the top 2 (the token may be one)
        row, value = ref[position - 1], ref[position - 1, ids[position]]
        rank = entry[token]["rank"]
        assert int((row > value + PROMPT_TOL).sum()) + 1 <= rank <= int((row > value - PROMPT_TOL).sum())
    chat = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": SERVER_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    chat_ids = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    listed = chat.json()["prompt_logprobs"]
    assert len(listed) == chat_ids["count"] and listed[0] is None
    assert all(list(e) == [str(t)] for e, t in zip(listed[1:], chat_ids["tokens"][1:]))


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_refusals_name_the_field(server, body, param):
    response = httpx.post(server + "/v1/completions", json={"model": SERVER_MODEL, **body}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_chat_refuses_echo(server):
    response = httpx.post(server + "/v1/chat/completions", timeout=30, json={
        "model": SERVER_MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo", response.text


def test_lm_eval_loglikelihood_through_the_server(server, offline):
    """lm-eval's own local-completions client (remote tokenizer: /tokenize, /tokenizer_info) scores two
    continuations; its sums equal the reference logprobs of the continuation tokens."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    lm = LocalCompletionsAPI(base_url=server + "/v1/completions", model=SERVER_MODEL, tokenizer_backend="remote",
                             max_length=256, max_retries=1)
    pairs = [("The quick brown fox", " jumps over the lazy dog"), ("Once upon a time", " there was a king")]
    instances = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    results = lm.loglikelihood(instances, disable_tqdm=True)
    for (context, continuation), (total, is_greedy) in zip(pairs, results):
        context_ids = offline.tokenizer.encode(context)         # lm-eval: encode(context + continuation), split
        whole = offline.tokenizer.encode(context + continuation)  # after encode(context)'s length
        assert whole[:len(context_ids)] == context_ids
        ref = _reference(offline, whole)
        expected = sum(ref[p - 1, whole[p]].item() for p in range(len(context_ids), len(whole)))
        assert abs(total - expected) < PROMPT_TOL * len(whole)
        greedy = all(ref[p - 1].argmax().item() == whole[p] for p in range(len(context_ids), len(whole)))
        assert is_greedy == greedy


def test_a_shared_context_is_scored_once_and_read_from_the_cache():
    """lm-eval's multiple choice: one context, several continuations, each scored with prompt logprobs. After the
    first, a choice takes the context's positions from the prompt-logprob store and starts from a cached KDA
    checkpoint inside them, prefilling only the rest; its logprobs equal a cold engine's
    within PROMPT_TOL (see _assert_close) and the cache and the store stay consistent."""
    context = _prompt(11, 37)
    choices = [_prompt(12 + i, 5 + i) for i in range(3)]
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
    warm = _llm("k3-tiny")
    outs = [warm.generate([context + choice], scoring)[0] for choice in choices]
    warm.engine.check_invariants()
    assert outs[0].num_cached_tokens == 0
    for out in outs[1:]:
        # the store knows positions 0..35 (whole pages of 4 of the shared 37): the deepest checkpoint below is 32
        assert out.num_cached_tokens == 32
    for choice, out in zip(choices, outs):
        cold = _llm("k3-tiny").generate([context + choice], scoring)[0]
        assert out.prompt_logprobs.complete
        _assert_close(out.prompt_logprobs, cold.prompt_logprobs)
    other_top = warm.generate([context + choices[0]], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert other_top.num_cached_tokens == 0              # a different top-N is another entry: scored afresh
    warm.engine.check_invariants()
    assert warm.engine.flush_cache()
    assert warm.engine.prompt_logprob_store.num_positions == 0


def test_prompt_logprob_store_bounds_and_verifies_its_entries():
    from k3core.prompt_logprob_store import PromptLogprobStore
    from k3core.prompt_logprobs import PromptLogprobs

    def scored(tokens):
        return PromptLogprobs([None] + [{t: -1.0} for t in tokens[1:]], [None] + [1] * (len(tokens) - 1))

    store = PromptLogprobStore(page_size=4, max_positions=30)
    a, b = list(range(12)), list(range(8)) + [50, 51, 52, 53]
    store.put(a, scored(a), 1)
    store.put(b, scored(b), 1)
    store.check_invariants()
    assert store.lookup(list(range(10)) + [99], 1)[0] == 8        # whole pages of the longest shared prefix
    assert store.lookup(a, 1)[0] == 12 and store.lookup(a, 2) == (0, None)    # another top-N is another entry
    c = list(range(100, 112))
    store.put(c, scored(c), 1)             # 36 positions > 30: the least recently used (b) goes
    store.check_invariants()
    assert store.num_positions == 24 and store.lookup(c, 1)[0] == 12
    assert store.lookup(b, 1)[0] == 8      # a still holds b's first 8
    incomplete = PromptLogprobs([None, None, {1: -1.0}, None], [None] * 4)
    store.put([0, 1, 2, 3], incomplete, 1)                         # only complete prompts are stored
    store.check_invariants()
