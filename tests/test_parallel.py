"""Parallel plans over gloo on CPU processes: greedy tokens identical to one process, logits within float32
tolerance, for TP, PP (2 stages, several micro-chunks), DCP (2 and 4), EP, and combinations."""
from __future__ import annotations

import pytest
import torch

from hf_helpers import save_kimi_linear
from k3core import LLM, SamplingParams
from k3core.parallel.launch import spawn
from k3core.parallel.plan import ParallelPlan

# Logits under a plan vs one process, both float32: partial sums are reduced in another order (TP all-reduce,
# DCP LSE merge), which moves the largest logit by float32 rounding only; a sharding bug moves it by O(1).
LOGIT_RTOL = 1e-4
PROMPTS = [[5, 17, 2, 99, 3, 1, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19], [42], [7, 7, 7, 7, 7, 7]]
ENGINE = dict(page_size=2, checkpoint_interval=8, chunked_prefill_tokens=64, memory_bytes=64 << 20)


def _generate_with_logits(llm: LLM, prompts, max_tokens: int):
    seen: dict[str, list[torch.Tensor]] = {}
    original = llm.engine._sample

    def spy(logits, requests):                   # the logits each sampled token came from (last stage only)
        if logits is not None:
            for row, request in enumerate(requests):
                seen.setdefault(request.request_id, []).append(logits[row].clone())
        return original(logits, requests)

    llm.engine._sample = spy
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.token_ids for o in outs], [torch.stack(seen[o.request_id]) if o.request_id in seen else None
                                         for o in outs]


def _rank_main(rank: int, plan: ParallelPlan, device, model: str, prefix_cache: bool):
    llm = LLM(model, backend="torch", device=str(device), dtype="float32", seed=7, plan=plan, rank=rank,
              prefix_cache=prefix_cache, **ENGINE)
    tokens, logits = _generate_with_logits(llm, PROMPTS, max_tokens=6)
    usage = llm.memory_usage()
    return tokens, logits, usage.kda_bytes + usage.mla_bytes if not prefix_cache else None


@pytest.fixture(scope="module")
def reference():
    llm = LLM("k3-tiny", backend="torch", device="cpu", dtype="float32", seed=7, prefix_cache=False, **ENGINE)
    return _generate_with_logits(llm, PROMPTS, max_tokens=6)


PLANS = {
    "tp2": ParallelPlan(tp=2),
    "pp2": ParallelPlan(pp=2),
    "dcp2": ParallelPlan(tp=2, dcp=2),
    "dcp4_only": ParallelPlan(dcp=4),
    "ep2": ParallelPlan(tp=2, ep=2),
    "pp2_tp2": ParallelPlan(pp=2, tp=2),
    "dcp4_ep4": ParallelPlan(dcp=4, ep=4),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_matches_single_process(reference, name):
    plan = PLANS[name]
    ref_tokens, ref_logits = reference
    results = spawn(_rank_main, plan, args=("k3-tiny", False))
    for rank, (tokens, logits, bytes_in_use) in enumerate(results):
        assert tokens == ref_tokens, f"rank {rank} of {name} generated other tokens"
        assert bytes_in_use == 0, f"rank {rank} of {name} leaked {bytes_in_use} bytes of sequence state"
        for got, expected in zip(logits, ref_logits):
            if got is None:
                continue                    # earlier pipeline stages have no logits
            error = (got - expected).abs().max().item() / expected.abs().max().item()
            assert error <= LOGIT_RTOL, f"rank {rank} of {name}: relative logit error {error:.2e}"
    assert any(logits[0] is not None for _, logits, _ in results)


def test_tp2_matches_single_process_on_the_trained_default():
    """The trained k3-demo under tp=2 over gloo: the same greedy tokens as one process, logits within the plan
    tolerance (a random model would not notice a rank computing a wrong shard of a trained layer)."""
    single = LLM("k3-demo", backend="torch", device="cpu", dtype="float32", prefix_cache=False, **ENGINE)
    ref_tokens, ref_logits = _generate_with_logits(single, DEMO_PROMPTS, max_tokens=6)
    for rank, (tokens, logits, bytes_in_use) in enumerate(spawn(_demo_rank_main, PLANS["tp2"])):
        assert tokens == ref_tokens, f"rank {rank} generated other tokens"
        assert bytes_in_use == 0
        for got, expected in zip(logits, ref_logits):
            error = (got - expected).abs().max().item() / expected.abs().max().item()
            assert error <= LOGIT_RTOL, f"rank {rank}: relative logit error {error:.2e}"


DEMO_PROMPTS = [[763, 733, 758, 484, 32], [347, 5087, 808, 360, 876, 12, 99, 4000, 17]]


def _demo_rank_main(rank: int, plan: ParallelPlan, device):
    llm = LLM("k3-demo", backend="torch", device=str(device), dtype="float32", plan=plan, rank=rank,
              prefix_cache=False, **ENGINE)
    tokens, logits = _generate_with_logits(llm, DEMO_PROMPTS, max_tokens=6)
    usage = llm.memory_usage()
    return tokens, logits, usage.kda_bytes + usage.mla_bytes


@pytest.fixture(scope="module")
def kimi_linear_checkpoint(tmp_path_factory):
    """A random transformers Kimi-Linear checkpoint (no AttnRes, softplus gate, SiLU, no q_lora) and its
    single-process greedy tokens and logits."""
    directory = save_kimi_linear(tmp_path_factory.mktemp("kimi_linear"), seed=0, vocab_size=300)
    single = LLM(str(directory), backend="torch", device="cpu", dtype="float32", prefix_cache=False, **ENGINE)
    return str(directory), _generate_with_logits(single, PROMPTS, max_tokens=6)


@pytest.mark.parametrize("name", ["tp2", "pp2", "dcp2", "ep2"])
def test_plan_matches_single_process_on_a_kimi_linear_checkpoint(kimi_linear_checkpoint, name):
    directory, (ref_tokens, ref_logits) = kimi_linear_checkpoint
    for rank, (tokens, logits, bytes_in_use) in enumerate(spawn(_rank_main, PLANS[name], args=(directory, False))):
        assert tokens == ref_tokens, f"rank {rank} of {name} generated other tokens"
        assert bytes_in_use == 0
        for got, expected in zip(logits, ref_logits):
            if got is not None:
                error = (got - expected).abs().max().item() / expected.abs().max().item()
                assert error <= LOGIT_RTOL, f"rank {rank} of {name}: relative logit error {error:.2e}"


def _leader_follower_main(rank: int, plan: ParallelPlan, device, abort_at_step: int):
    from k3core.parallel.distributed_engine import DistributedEngine, follow
    options = dict(backend="torch", device=str(device), dtype="float32", seed=7, plan=plan, rank=rank,
                   page_size=2, checkpoint_interval=8, chunked_prefill_tokens=8)
    layout = LLM("k3-tiny", memory_bytes=1 << 20, **options).engine.pool.layout
    # room for two requests' slots and 6 pages: the four requests take turns and decodes run out of pages
    llm = LLM("k3-tiny", memory_bytes=2 * layout.slot_bytes + 6 * layout.page_bytes, **options)
    if rank != 0:
        follow(llm.engine, llm.comm)
        llm.engine.check_invariants()
        return llm.engine.scheduler.num_retractions, llm.memory_usage()
    engine = DistributedEngine(llm.engine, llm.comm)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(list(p), params) for p in PROMPTS + [[3] * 12]]
    victim = ids[-1]
    outputs: dict[str, list[int]] = {}
    step = 0
    while engine.has_work:
        step += 1
        if step == abort_at_step:
            engine.abort(victim)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.engine.check_invariants()
    engine.flush_cache()
    engine.shutdown()
    return [outputs[i] for i in ids[:-1]], llm.engine.scheduler.num_retractions, llm.memory_usage()


@pytest.mark.parametrize("plan", [ParallelPlan(pp=2), ParallelPlan(tp=2, dcp=2)], ids=["pp2", "tp2_dcp2"])
def test_leader_and_followers_with_abort_and_retraction(reference, plan):
    results = spawn(_leader_follower_main, plan, args=(3,))
    tokens, retractions, usage = results[0]
    assert tokens == reference[0], "the leader's tokens differ from one process"
    assert retractions > 0, "the pool was meant to be small enough to force a retraction"
    for rank, result in enumerate(results):
        usage = result[-1]
        assert usage.kda_bytes == 0 and usage.mla_bytes == 0, f"rank {rank} holds memory after flush: {usage}"
        assert result[-2] == retractions, f"rank {rank} retracted differently from the leader"


def test_pipeline_toy_matches_the_write_up():
    from bench.pp_sim import schedule, utilisation
    assert round(utilisation(8, 5), 2) == 0.42          # the write-up's 8 stages x 5 chunks: 42 % of slots
    grid = schedule(8, 5)
    assert sum(c is not None for row in grid for c in row) == 8 * 5
    assert utilisation(8, 64) > utilisation(8, 16) > utilisation(8, 5)


@pytest.mark.parametrize("nodes", [1, 2, "torchrun"])
def test_server_starts_its_own_ranks_and_matches_one_process(tmp_path, nodes):
    """`python -m k3core.serve --tp 2` starts the second rank itself (one node), or a second "node" process joins
    through --nnodes/--node-rank/--dist-init-addr, or torchrun starts both; each serves the one-process text."""
    import subprocess
    import sys
    import time

    import httpx

    from k3core.parallel.launch import free_port
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    common = [sys.executable, "-m", "k3core.serve", "--model", "k3-tiny", "--tp", "2", "--memory-bytes", str(64 << 20),
              "--cpu-threads", "1"]
    if nodes == "torchrun":
        common[1:3] = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                       "-m", "k3core.serve"]
    if nodes == 2:
        common += ["--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
        node1 = subprocess.Popen(common + ["--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT)
        common += ["--node-rank", "0"]
    server = subprocess.Popen(common + ["--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        body = {"model": "k3-tiny", "prompt": [5, 17, 2, 99], "max_tokens": 6, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
    finally:
        server.terminate()
        server.wait(timeout=30)
        if nodes == 2:
            node1.wait(timeout=30)           # the follower node leaves on its own once the leader is gone
    single = LLM("k3-tiny", seed=0, prefix_cache=False, memory_bytes=64 << 20)
    expected = single.generate([[5, 17, 2, 99]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert reply["choices"][0]["text"] == expected.text
