"""lm-eval (the real harness, its Python API) against the server on the embedded default k3-demo, offline: the
tasks and their data are files written here, nothing is downloaded.

* generate_until with 5 `until` strings through `local-completions` (remote tokenizer: /tokenizer_info, /tokenize):
  every response equals the offline engine's greedy text cut by the same stop strings, and the server generated
  exactly the offline engine's tokens (a server that ignored the stop strings would generate to max_gen_toks, and
  lm-eval cutting the text itself would hide that).
* the same task through `local-chat-completions` (lm-eval sends at most 4 stop strings to a chat endpoint).
* a multiple-choice task (loglikelihood: `echo` + prompt logprobs): each choice's loglikelihood equals the one
  computed from a full forward of the offline model.
"""
from __future__ import annotations

import json
import logging
import math

import httpx
import lm_eval
import pytest
import torch

from k3core import LLM, SamplingParams
from k3core.serve.args import ServerArgs
from k3core.serve.metrics import metric_sum, parse_metrics
from tests.server_helpers import DEMO_ENGINE, running_server

MODEL = "k3-demo"
MAX_GEN_TOKS = 16
UNTIL = ["\n\n", "return", "):", " = ", "raise"]      # 5 stop strings
# k3-demo's greedy continuations: the first runs to max_gen_toks, the others stop at "):", "raise" and "return"
GEN_DOCS = [{"prompt": "import os\n\n\ndef ", "target": ""},
            {"prompt": "class Parser:\n    def __init__(self", "target": ""},
            {"prompt": "for line in", "target": ""},
            {"prompt": "def read(path):\n    with open(path) as f:\n", "target": ""}]
MC_DOCS = [{"question": "import", "choices": ["os", "banana"], "answer": 0},     # lm-eval scores " " + choice
           {"question": "def main(self", "choices": ["):", "while"], "answer": 0}]


@pytest.fixture(scope="module")
def server():
    args = ServerArgs(model=MODEL, log_level="warning", engine_in_process=True, seed=0, **DEMO_ENGINE)
    with running_server(args) as (base, _):
        yield base


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, device="cpu", dtype="float32", prefix_cache=False, chunked_prefill_tokens=64, page_size=16)


@pytest.fixture()
def tasks(tmp_path, monkeypatch):
    """A TaskManager that knows the two local tasks, and no network."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name, docs in (("gen", GEN_DOCS), ("mc", MC_DOCS)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {{file}}\n  cache_dir: {tmp_path}/hf\n"
              "test_split: test\n")
    (tmp_path / "k3_gen.yaml").write_text(
        "task: k3_gen\n" + common.format(file=tmp_path / "gen.jsonl") +
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    (tmp_path / "k3_mc.yaml").write_text(
        "task: k3_mc\n" + common.format(file=tmp_path / "mc.jsonl") +
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=str(tmp_path), include_defaults=False)


def evaluate(task_manager, task: str, model: str, model_args: dict, **kwargs) -> list[dict]:
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=task_manager,
                                      log_samples=True, bootstrap_iters=0, **kwargs)
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def generated_tokens(base: str) -> float:
    return metric_sum(parse_metrics(httpx.get(base + "/metrics").text), "k3core_generation_tokens_total")


def test_generate_until_with_five_stop_strings_matches_the_offline_engine(server, offline, tasks):
    eos = httpx.get(server + "/tokenizer_info").json()["eos_token"]
    params = SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0.0, stop=UNTIL + [eos])
    want = offline.generate([d["prompt"] for d in GEN_DOCS], params)
    assert sum(w.finish_reason == "stop" for w in want) >= 3, [w.text for w in want]   # the stops matter here
    before = generated_tokens(server)
    samples = evaluate(tasks, "k3_gen", "local-completions",
                       dict(base_url=server + "/v1/completions", model=MODEL, tokenizer_backend="remote",
                            max_retries=1, max_length=512))
    assert [s["resps"][0][0] for s in samples] == [w.text for w in want]
    assert generated_tokens(server) - before == sum(len(w.token_ids) for w in want)


def test_generate_until_through_chat_completions(server, tasks):
    samples = evaluate(tasks, "k3_gen", "local-chat-completions",
                       dict(base_url=server + "/v1/chat/completions", model=MODEL, max_retries=1),
                       apply_chat_template=True)
    client = httpx.Client(base_url=server, timeout=120)
    for doc, sample in zip(GEN_DOCS, samples):
        direct = client.post("/v1/chat/completions", json=dict(
            model=MODEL, messages=[{"role": "user", "content": doc["prompt"]}], max_tokens=MAX_GEN_TOKS,
            temperature=0, stop=UNTIL[:4], seed=1234)).json()
        assert sample["resps"][0][0] == direct["choices"][0]["message"]["content"]
        assert not any(stop in sample["resps"][0][0] for stop in UNTIL[:4])


def reference_loglikelihood(offline: LLM, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split (context tokens, then what the whole adds), scored by one full forward in float32."""
    encode = offline.tokenizer.encode
    whole = list(encode(context + continuation))
    context_ids = list(encode(context))
    ids = context_ids + whole[len(context_ids):]
    with torch.no_grad():
        logprobs = torch.log_softmax(offline.prompt_logits(ids).double(), dim=-1)    # [T, vocab]
    positions = range(len(context_ids), len(ids))
    total = sum(logprobs[p - 1, ids[p]].item() for p in positions)
    greedy = all(int(logprobs[p - 1].argmax()) == ids[p] for p in positions)
    return total, greedy


def test_multiple_choice_loglikelihoods_match_a_full_forward(server, offline, tasks, caplog):
    caplog.set_level(logging.WARNING)
    try:
        samples = evaluate(tasks, "k3_mc", "local-completions",
                           dict(base_url=server + "/v1/completions", model=MODEL, tokenizer_backend="remote",
                                max_retries=1, max_length=512))
    except Exception as exc:      # say what the server answered: lm-eval's own error names only the status
        answers = [r.getMessage() for r in caplog.records if "API request failed" in r.getMessage()]
        pytest.fail(f"lm-eval's loglikelihood requests failed ({exc}); the server answered: {answers[-1:]}")
    for doc, sample in zip(MC_DOCS, samples):
        assert len(sample["resps"]) == len(doc["choices"])
        for choice, resp in zip(doc["choices"], sample["resps"]):
            loglikelihood, greedy = resp[0]
            want, want_greedy = reference_loglikelihood(offline, doc["question"], " " + choice)
            # float32 chunked prefill against one float32 full forward: summed over a few tokens
            assert math.isclose(loglikelihood, want, abs_tol=2e-3), (doc, choice, loglikelihood, want)
            assert greedy == want_greedy
