"""The engine with cuda_graphs: decode steps that fit a graph replay it, every other step runs eagerly, same output.

No GPU here, so a stand-in graph runner (`ReplayByCall`) takes the backend's place through the engine's
`graph_runner_factory` seam: it keeps the static buffers that capture made and, on every run, copies the step's
inputs into them and calls the captured step on those buffers, which is what a replay computes. Most tests run the
torch reference ops (fast); one runs the cuda backend's Triton kernels under the interpreter with every host read of
a tensor turned into an error, as in tests/test_graph_decode.py.

Tolerances: the replayed step pads the batch to its bucket and gives the page table the graph's width, which changes
how float32 sums are split (MLA split count, MoE row blocks) but not what is summed: logits agree to ~1e-6 relative,
held here to 1e-4 of the row's largest logit (as in test_graph_decode). Greedy token ids must be identical.
"""
from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
from test_graph_decode import forbid_host_reads

from k3core import LLM, SamplingParams
from k3core.engine import Engine, EngineOptions
from k3core.parallel.plan import ParallelPlan

LOGIT_TOL = 1e-4
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PAGE_SIZE = 4
INTERVAL = 8


class ReplayByCall:
    """GraphRunner's contract without a GPU: capture makes one set of static inputs per bucket (largest first) and
    runs the step on them once; run copies the inputs into the bucket's buffers and runs the step on the buffers."""

    def __init__(self, fn, buckets, device=None, guard=None):
        self.fn = fn
        self.buckets = sorted(set(buckets))
        self.device = device
        self.guard = guard                       # a context manager around every call of fn
        self.static: dict[int, tuple[torch.Tensor, ...]] = {}
        self.captured: list[int] = []
        self.replayed: list[int] = []            # the bucket of every run

    def _call(self, inputs):
        if self.guard is None:
            return self.fn(*inputs)
        with self.guard():
            return self.fn(*inputs)

    def capture(self, example_inputs) -> None:
        for bucket in reversed(self.buckets):
            self.static[bucket] = tuple(t.to(self.device).clone() for t in example_inputs(bucket))
            self._call(self.static[bucket])
            self.captured.append(bucket)

    def run(self, *inputs):
        num_rows = inputs[0].shape[0]
        bucket = next(b for b in self.buckets if b >= num_rows)
        for static, new in zip(self.static[bucket], inputs):
            static[:num_rows].copy_(new)
        self.replayed.append(bucket)
        return self._call(self.static[bucket])[:num_rows]


class StandIns:
    """A factory for the engine that remembers the runner it made."""

    def __init__(self, guard=None):
        self.guard = guard
        self.runners: list[ReplayByCall] = []

    def __call__(self, fn, buckets, device=None):
        runner = ReplayByCall(fn, buckets, device, self.guard)
        self.runners.append(runner)
        return runner


@pytest.fixture(scope="module")
def llm():
    return LLM("k3-tiny", backend="torch", device="cpu", dtype="float32", seed=3, page_size=PAGE_SIZE,
               checkpoint_interval=INTERVAL, memory_bytes=4 << 20)


def _engine(llm, graphs: StandIns | None, **options) -> Engine:
    options = {"page_size": PAGE_SIZE, "checkpoint_interval": INTERVAL, **options}
    return Engine(llm, EngineOptions(cuda_graphs=graphs is not None, **options), graph_runner_factory=graphs)


def _prompts(seed: int, lengths, vocab: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


class Recorder:
    """Runs a script of arrivals and aborts on an engine, checking its invariants after every step, and keeps every
    sampled logits row by (request, output index) and every eager forward's work."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.logits: dict[tuple[str, int], torch.Tensor] = {}
        self.eager_work: list[list] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)
        sample, forward = engine._sample, engine.runner.forward

        def recording_sample(logits, requests):
            for row, request in enumerate(requests):
                self.logits[(request.request_id, len(request.output_token_ids))] = logits[row].clone()
            return sample(logits, requests)

        def recording_forward(work, state, future=None):
            self.eager_work.append(list(work))
            return forward(work, state, future)

        engine._sample = recording_sample
        self.forward = recording_forward
        self.graph_work: list[list] = []
        self.split_steps = 0
        if engine.graph_decode is not None:
            replay = engine.graph_decode.run

            def recording_replay(work, future=None):
                self.graph_work.append(list(work))
                return replay(work, future)

            engine.graph_decode.run = recording_replay

    def run(self, arrivals: dict[int, list[tuple[str, list[int], int]]], aborts: dict[int, list[str]]) -> None:
        engine = self.engine
        runner_forward = engine.runner.forward
        engine.runner.forward = self.forward            # the runner is the LLM's: put it back afterwards
        try:
            step = 0
            while step <= max(arrivals) or engine.has_work:
                for request_id, prompt, max_tokens in arrivals.get(step, []):
                    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), request_id)
                for request_id in aborts.get(step, []):
                    assert engine.abort(request_id)
                replays, forwards = len(self.graph_work), len(self.eager_work)
                for output in engine.step():
                    self.tokens[output.request_id].extend(output.new_token_ids)
                if len(self.graph_work) > replays and len(self.eager_work) > forwards:
                    self.split_steps += 1          # decodes replayed beside an eager forward of prefill chunks
                engine.check_invariants()
                step += 1
        finally:
            engine.runner.forward = runner_forward


def _assert_same_results(graphed: Recorder, eager: Recorder) -> None:
    assert dict(graphed.tokens) == dict(eager.tokens)
    assert graphed.logits.keys() == eager.logits.keys()
    for key, want in eager.logits.items():
        got = graphed.logits[key]
        error = float((got - want).abs().max() / want.abs().max())
        assert error < LOGIT_TOL, (key, error)


def _is_decode(work) -> bool:
    return all(len(w.new_token_ids) == 1 and w.prefix_len > 0 for w in work)


def test_graphs_replay_decode_steps_and_match_eager(llm):
    """Mixed prefill/decode steps, batches of every bucket and above the largest, a context past the graphs' width,
    a one-token prompt, prefix-cache hits, requests finishing and arriving mid-run, and an abort."""
    family = _prompts(1, [9])[0]
    prompts = _prompts(2, [5, 1, 13, 3, 7, 6, 11, 4])
    arrivals = {
        0: [("a", prompts[0], 9), ("b", prompts[1], 4), ("c", family + prompts[2], 6), ("d", prompts[3], 12)],
        2: [("e", family + prompts[4], 5), ("f", prompts[5], 14)],
        9: [("g", prompts[6], 10), ("h", family + prompts[7], 3), ("long", prompts[2] + prompts[6], 16)],
        14: [("i", prompts[4], 30)],           # outlives the rest: decodes alone
    }
    aborts = {7: ["f"]}
    options = {"graph_batch_sizes": (1, 2, 4), "graph_max_context": 28, "chunked_prefill_tokens": 16,
               "max_running_requests": 8, "memory_bytes": 4 << 20}
    stand_ins = StandIns()
    graphed_engine = _engine(llm, stand_ins, **options)
    graphed = Recorder(graphed_engine)
    graphed.run(arrivals, aborts)
    eager = Recorder(_engine(llm, None, **options))
    eager.run(arrivals, aborts)
    _assert_same_results(graphed, eager)

    runner = stand_ins.runners[0]
    assert runner.captured == [4, 2, 1]
    assert set(runner.replayed) == {1, 2, 4}                          # every bucket was hit
    assert graphed_engine.num_graph_steps == len(runner.replayed)
    graph = graphed_engine.graph_decode
    eager_decode = [w for w in graphed.eager_work if _is_decode(w)]
    # a decode-only step ran eagerly only when it did not fit: more rows than the largest bucket, or a long context
    for work in eager_decode:
        assert len(work) > 4 or max(w.prefix_len + 1 for w in work) > graph.max_context
    assert any(len(w) > 4 for w in eager_decode)
    assert any(len(w) <= 4 for w in eager_decode)                     # "long" outgrew the graphs' 28 tokens
    assert any(not _is_decode(w) for w in graphed.eager_work)         # prefill chunks stayed eager
    assert graphed.split_steps > 0                 # steps of chunks and decodes replayed their decodes
    for work in graphed.eager_work:                # and only what no graph takes ran eagerly beside them
        if not _is_decode(work):
            assert not any(graph.accepts([w]) for w in work) or len([w for w in work if graph.accepts([w])]) > 4
    assert graphed_engine.num_steps == eager.engine.num_steps

    unsplit = Recorder(_engine(llm, StandIns(), split_mixed_steps=False, **options))
    unsplit.run(arrivals, aborts)
    _assert_same_results(unsplit, eager)
    assert unsplit.split_steps == 0


def test_prompt_tokens_fed_one_per_step_ride_in_the_graph(llm):
    """A step budget one above the decodes feeds a prompt one token per step: after its first token those steps are
    decode-shaped and replay the graph, with rows that want no logits among rows that do."""
    prompts = _prompts(6, [4, 3, 7])
    arrivals = {0: [("a", prompts[0], 12), ("b", prompts[1], 12)], 4: [("c", prompts[2], 3)]}
    options = {"graph_batch_sizes": (4,), "chunked_prefill_tokens": 3, "memory_bytes": 4 << 20, "prefix_cache": False}
    graphed = Recorder(_engine(llm, StandIns(), **options))
    graphed.run(arrivals, {})
    eager = Recorder(_engine(llm, None, **options))
    eager.run(arrivals, {})
    _assert_same_results(graphed, eager)
    assert any(w.want_logits == "none" for work in graphed.graph_work for w in work)


def test_retraction_under_memory_pressure(llm):
    layout = llm.engine.pool.layout
    # Room for four working slots (plus the graphs' scratch) but far fewer pages than four 40-token requests need.
    memory = 5 * layout.slot_bytes + 30 * layout.page_bytes
    prompts = _prompts(3, [14, 9, 17, 6, 11])
    arrivals = {0: [(f"r{i}", p, 24) for i, p in enumerate(prompts)]}
    options = {"graph_batch_sizes": (1, 2, 4), "chunked_prefill_tokens": 16, "memory_bytes": memory,
               "prefix_cache": False}
    stand_ins = StandIns()
    graphed = Recorder(_engine(llm, stand_ins, **options))
    graphed.run(arrivals, {})
    eager = Recorder(_engine(llm, None, memory_bytes=memory - layout.slot_bytes - layout.page_bytes,
                             **{k: v for k, v in options.items() if k != "memory_bytes"}))
    eager.run(arrivals, {})
    assert graphed.engine.scheduler.num_retractions > 0
    assert eager.engine.scheduler.num_retractions > 0
    _assert_same_results(graphed, eager)
    assert stand_ins.runners[0].replayed


def test_scratch_is_accounted_for_and_returned_on_close(llm):
    stand_ins = StandIns()
    engine = _engine(llm, stand_ins, graph_batch_sizes=(4,), memory_bytes=2 << 20)
    layout = engine.pool.layout
    usage = engine.memory_usage()
    assert (usage.num_slots, usage.num_pages) == (1, 1)                # the scratch, counted as used
    assert usage.kda_bytes == layout.slot_bytes and usage.mla_bytes == layout.page_bytes
    assert engine.reserved_bytes == layout.slot_bytes + layout.page_bytes
    engine.check_invariants()
    for prompt in _prompts(4, [6, 10, 3]):
        engine.add_request(prompt, SamplingParams(max_tokens=20, **GREEDY))
    for _ in range(8):
        engine.step()
        engine.check_invariants()
    assert engine.num_graph_steps > 0 and engine.scheduler.running
    engine.close()                                                     # aborts the running requests too
    engine.check_invariants()
    engine.flush_cache()
    usage = engine.memory_usage()
    assert (usage.num_slots, usage.num_pages, usage.free_bytes) == (0, 0, usage.capacity_bytes)
    with pytest.raises(ValueError, match="closed"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2))


def test_a_request_must_fit_beside_the_scratch(llm):
    layout = llm.engine.pool.layout
    memory = layout.slot_bytes * 2 + layout.page_bytes * 6
    engine = _engine(llm, StandIns(), graph_batch_sizes=(1,), memory_bytes=memory, prefix_cache=False)
    fits = (memory - engine.reserved_bytes - layout.slot_bytes) // layout.page_bytes * PAGE_SIZE
    with pytest.raises(ValueError, match="holds for requests"):
        engine.add_request([1] * 4, SamplingParams(max_tokens=fits - 4 + 1))
    engine.add_request([1] * 4, SamplingParams(max_tokens=fits - 4, **GREEDY))
    while engine.has_work:
        engine.step()
        engine.check_invariants()


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs interpreted only where no GPU is visible")
def test_cuda_op_table_replays_without_host_reads():
    """The cuda backend's Triton kernels (interpreted, float32) through the engine, every replay under a guard that
    fails on any host read of a tensor: the step the engine replays is capturable."""
    cuda = LLM("k3-tiny", backend="cuda", device="cpu", dtype="float32", seed=5, prefix_cache=False,
               memory_bytes=2 << 20)
    assert cuda.ops.choices["kda_decode"].provider.startswith("cuda.triton"), cuda.ops.describe()
    prompts = _prompts(5, [5, 9])
    arrivals = {0: [("x", prompts[0], 3), ("y", prompts[1], 3)]}
    options = {"graph_batch_sizes": (1, 2), "prefix_cache": False, "memory_bytes": 2 << 20, "page_size": 16,
               "checkpoint_interval": 64}
    stand_ins = StandIns(guard=forbid_host_reads)
    graphed = Recorder(Engine(cuda, EngineOptions(cuda_graphs=True, **options), graph_runner_factory=stand_ins))
    graphed.run(arrivals, {})
    eager = Recorder(Engine(cuda, EngineOptions(**options)))
    eager.run(arrivals, {})
    _assert_same_results(graphed, eager)
    assert stand_ins.runners[0].replayed == [2, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA/HIP graphs: needs a GPU")
def test_captured_graphs_on_the_gpu_match_eager():
    """The real thing in float32 (where greedy tokens must agree exactly): the backend's GraphRunner captures at
    start and replays; the same kind of script as on the CPU."""
    backend = "rocm" if torch.version.hip else "cuda"
    family = _prompts(1, [9])[0]
    prompts = _prompts(2, [5, 1, 13, 3, 7, 6, 11, 4])
    arrivals = {
        0: [("a", prompts[0], 9), ("b", prompts[1], 4), ("c", family + prompts[2], 6), ("d", prompts[3], 12)],
        2: [("e", family + prompts[4], 5), ("f", prompts[5], 14)],
        9: [("g", prompts[6], 10), ("h", family + prompts[7], 3), ("long", prompts[2] + prompts[6], 40)],
        14: [("i", prompts[4], 30)],
        80: [("j", prompts[3], 5)],                        # after everything else: decodes alone
        # four that prefill in one step and then decode together: the 4-row graph (with overlapped steps the mixed
        # script above never has four decodes without a prefill chunk beside them)
        100: [("k", prompts[3], 6), ("l", prompts[0], 6), ("m", prompts[1], 6), ("n", prompts[5], 6)],
    }
    options = {"graph_batch_sizes": (1, 2, 4), "graph_max_context": 48, "chunked_prefill_tokens": 16,
               "max_running_requests": 8, "memory_bytes": 64 << 20}
    runs = []
    for cuda_graphs in (True, False):
        model = LLM("k3-tiny", backend=backend, device="cuda", dtype="float32", seed=7, cuda_graphs=cuda_graphs,
                    **options)
        recorder = Recorder(model.engine)
        recorder.run(arrivals, {7: ["f"]})
        runs.append(recorder)
    graphed, eager = runs
    assert sorted(graphed.engine.graph_decode.runner.graphs) == [1, 2, 4]
    _assert_same_results(graphed, eager)
    seen = {len(work) for work in graphed.graph_work}
    assert seen >= {1, 2, 3, 4}, f"the script replayed only batches of {sorted(seen)}"
    graphed.engine.close()
    graphed.engine.flush_cache()
    usage = graphed.engine.memory_usage()
    assert (usage.num_slots, usage.num_pages) == (0, 0)


# ---- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_cuda_graphs_without_a_gpu_refuses_at_start(backend):
    from backends.common_graphs import GraphCaptureUnavailable
    with pytest.raises(GraphCaptureUnavailable, match="needs a CUDA or ROCm GPU"):
        LLM("k3-tiny", backend=backend, device="cpu", dtype="float32", memory_bytes=2 << 20, cuda_graphs=True)


def test_cuda_graphs_refused_by_a_backend_without_graphs_or_off_the_gpu(llm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # past the GPU check, to the next ones
    with pytest.raises(ValueError, match="backend 'torch' cannot capture graphs"):
        Engine(llm, EngineOptions(cuda_graphs=True, memory_bytes=2 << 20))
    cuda_on_cpu = LLM("k3-tiny", backend="cuda", device="cpu", dtype="float32", memory_bytes=2 << 20)
    with pytest.raises(ValueError, match="needs the model on the GPU"):
        Engine(cuda_on_cpu, EngineOptions(cuda_graphs=True, memory_bytes=2 << 20))


def test_cuda_graphs_refused_under_a_parallel_plan(llm):
    planned = copy.copy(llm)
    planned.plan = ParallelPlan(tp=2)
    planned.runner = copy.copy(llm.runner)
    planned.runner.plan = planned.plan
    with pytest.raises(ValueError, match="parallel plan"):
        Engine(planned, EngineOptions(cuda_graphs=True, memory_bytes=2 << 20), graph_runner_factory=StandIns())


@pytest.mark.parametrize("options, message", [
    ({"graph_batch_sizes": ()}, "graph_batch_sizes"),
    ({"graph_batch_sizes": (1, 0)}, "graph_batch_sizes"),
    ({"graph_batch_sizes": (1.5,)}, "graph_batch_sizes"),
    ({"graph_max_context": 1}, "graph_max_context"),
    ({"graph_max_context": None}, "graph_max_context"),
])
def test_graph_options_are_validated(options, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**options)


def test_engine_options_sort_batch_sizes():
    assert EngineOptions(graph_batch_sizes=[8, 1, 2, 8]).graph_batch_sizes == (1, 2, 8)


def test_serve_flags_pass_graph_options(tmp_path):
    from k3core.serve.args import parse_args
    options = parse_args(["--cuda-graphs", "--graph-batch-sizes", "1,8,4", "--graph-max-context", "4096"]
                         ).engine_options()
    assert options["cuda_graphs"] is True
    assert options["graph_max_context"] == 4096
    assert EngineOptions(**options).graph_batch_sizes == (1, 4, 8)
    assert parse_args([]).engine_options()["cuda_graphs"] is False
    config = tmp_path / "serve.yaml"
    config.write_text("cuda-graphs: true\ngraph-batch-sizes: [1, 2]\n")
    assert parse_args(["--config", str(config)]).engine_options()["graph_batch_sizes"] == (1, 2)
    with pytest.raises(SystemExit):
        parse_args(["--graph-batch-sizes", "1,x"])
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graphs", "--tp", "2", "--memory-bytes", "1000000"])


def test_prompt_logprobs_chunk_beside_replayed_decodes(llm, monkeypatch):
    """A prompt-logprobs chunk (logits of every position) in a step whose decodes replay the graph: the split step
    puts each of its rows back in place, so its prompt logprobs and everyone's tokens equal the eager engine's."""
    prompts = _prompts(7, [6, 5, 13])

    def run(graphs):
        engine = _engine(llm, graphs, graph_batch_sizes=(1, 2, 4), chunked_prefill_tokens=8, memory_bytes=4 << 20)
        ids = [engine.add_request(prompts[0], SamplingParams(max_tokens=10, **GREEDY)),
               engine.add_request(prompts[1], SamplingParams(max_tokens=10, **GREEDY))]
        for _ in range(3):                                    # both decode before the third arrives
            engine.step()
        ids.append(engine.add_request(prompts[2], SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY)))
        results = engine.run_until_done(ids)
        engine.check_invariants()
        return engine, results, ids

    import k3core.engine as engine_module
    split_works = []

    def recording_split(split, work, *rest):
        split_works.append(list(work))
        return run_split(split, work, *rest)

    run_split = engine_module.run_split
    monkeypatch.setattr(engine_module, "run_split", recording_split)
    graphed_engine, graphed, ids = run(StandIns())
    eager_engine, eager, _ = run(None)
    assert any(w.want_logits == "all" for work in split_works for w in work)     # the case this test is about
    for request_id in ids:
        assert graphed[request_id].token_ids == eager[request_id].token_ids
    got, want = graphed[ids[2]].prompt_logprobs, eager[ids[2]].prompt_logprobs
    assert got.ranks == want.ranks and got.entries[0] is None and want.complete
    for got_entry, want_entry in zip(got.entries[1:], want.entries[1:]):
        assert got_entry.keys() == want_entry.keys()
        for token, logprob in want_entry.items():
            assert abs(got_entry[token] - logprob) < 1e-4        # as LOGIT_TOL: the replay pads the batch
