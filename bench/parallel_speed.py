"""The speed half of bench.parallel_bench: k3-mini prefill and decode per plan, and the exposed communication
of a prefill measured against the same prefill with the plan's collectives swapped for no-ops (see `_NoComm`).
`python -m bench.parallel_bench` drives it after the correctness section; this module has no entry point."""
from __future__ import annotations

import time

import torch

from k3core.parallel.launch import DistSetup, free_port, spawn
from k3core.parallel.plan import ParallelPlan

# most wanted first: a time limit that cuts the run short keeps the TP/PP comparison
SPEED_PLANS = {"tp2": ParallelPlan(tp=2), "pp2": ParallelPlan(pp=2), "1gpu": ParallelPlan(),
               "tp2+dcp2": ParallelPlan(tp=2, dcp=2)}
DECODE_BATCH, DECODE_CONTEXT, DECODE_STEPS = 32, 2048, 16
SPEED_ENGINE = dict(page_size=64, checkpoint_interval=1024, chunked_prefill_tokens=8192, prefix_cache=False,
                    max_running_requests=DECODE_BATCH, memory_bytes=12 << 30)
# smoke decode: prefill spans several steps (6 x 40 tokens in chunks of 32), as 32 x 2048 in chunks of 8192 does
SMOKE = dict(prompt_lens=(64, 128), decode_batch=6, decode_context=40, decode_steps=3, model="k3-tiny",
             engine=dict(page_size=4, checkpoint_interval=16, chunked_prefill_tokens=32, prefix_cache=False,
                         max_running_requests=8, memory_bytes=64 << 20))


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


def dist_setup(device: str) -> DistSetup:
    return DistSetup(f"127.0.0.1:{free_port()}", device=device)


# ---- speed -------------------------------------------------------------------------------------------------------
class _NoComm:
    """Collectives replaced by no-ops of the same shapes (timing only: the outputs become meaningless).

    The torch.distributed functions are swapped, not the Communicator's methods: the network binds
    `comm.tp.all_reduce` when it is built, so patching the group class afterwards changed nothing (the first GPU run
    measured TP with its all-reduces still in place). `swallowed` counts the calls that did not happen, so a run can
    show the swap worked. Token broadcasts after sampling stay real: every rank must agree on the next step.
    """

    def __init__(self, comm):
        self.comm = comm
        self.swallowed = 0

    def __enter__(self):
        import torch.distributed as dist
        self.saved = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_to_all_single")}
        self.saved_send, self.saved_recv = self.comm.send, self.comm.recv

        def all_reduce(tensor, *args, **kwargs):
            self.swallowed += 1

        def all_gather(parts, tensor, *args, **kwargs):
            self.swallowed += 1
            for part in parts:                   # a local stand-in for the peers' parts (same shapes, real values)
                part.copy_(tensor)

        def all_to_all_single(out, inp, *args, **kwargs):
            self.swallowed += 1
            if out.shape == inp.shape:
                out.copy_(inp)

        class _Done:
            def wait(self):
                return None

        def send(tensor, dst):
            self.swallowed += 1
            return _Done()

        def recv(shape, dtype, device, src):
            self.swallowed += 1
            # noise with a realistic spread (zeros would route every token to the same experts)
            return torch.randn(shape, device=device).to(dtype)

        dist.all_reduce, dist.all_gather, dist.all_to_all_single = all_reduce, all_gather, all_to_all_single
        self.comm.send, self.comm.recv = send, recv
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        self.comm.send, self.comm.recv = self.saved_send, self.saved_recv
        return False


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_prefill(llm, prompt, device, repeats: int) -> float:
    from k3core import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        llm.generate([prompt], params)
        _sync(device)
        times.append(time.perf_counter() - started)
    return min(times)


def _time_decode(llm, prompts, steps: int, device) -> tuple[float, int]:
    """Seconds per decode step with every request decoding (after all prefills are done), and the batch size."""
    from k3core import SamplingParams
    engine = llm.engine
    # Requests that finish prefill early decode while the others still prefill: max_tokens must outlast every
    # prefill step too, or the first ones finish inside the timed window (the first GPU run timed 9 of 32).
    prefill_steps = -(-sum(len(p) for p in prompts) // engine.options.chunked_prefill_tokens) + len(prompts)
    params = SamplingParams(max_tokens=steps + prefill_steps + 4, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(2 * prefill_steps + 8):        # bounded: a scheduling surprise must fail, not hang the device call
        requests = [engine.requests[i] for i in ids]
        if not any(not r.is_finished and r.num_computed_tokens < len(r.prompt_token_ids) for r in requests):
            break
        engine.step()
    else:
        raise RuntimeError(f"the {len(prompts)} prompts were not prefilled within {2 * prefill_steps + 8} steps")
    engine.step()                                   # first all-decode step (and any lazy setup)
    before = [len(engine.requests[i].output_token_ids) for i in ids]
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    elapsed = (time.perf_counter() - started) / steps
    # requests that decoded in every timed step (fewer means the pool retracted some: the batch was smaller)
    running = sum(len(engine.requests[i].output_token_ids) - b == steps for i, b in zip(ids, before))
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_work:
        engine.step()
    return elapsed, running


def _speed_rank(rank: int, plan: ParallelPlan, device, model: str, backend: str, dtype: str, engine: dict,
                prompt_lens, decode_batch: int, decode_context: int, decode_steps: int):
    from k3core import LLM
    started = time.perf_counter()
    llm = LLM(model, backend=backend, device=str(device), dtype=dtype, seed=11, plan=plan, rank=rank, **engine)
    built_s = time.perf_counter() - started
    vocab = llm.config.vocab_size
    out: dict = {"build_s": round(built_s, 1)}
    # warm-up: compiles every kernel variant the timed runs use (prefill chunks, decode)
    _time_prefill(llm, random_prompts((min(prompt_lens[0], 2048),), vocab, 0)[0], device, 1)
    for length in prompt_lens:
        prompt = random_prompts((length,), vocab, length)[0]
        seconds = _time_prefill(llm, prompt, device, 2 if length <= 8192 else 1)
        out[f"prefill_{length}_s"] = seconds
    if not plan.is_single:
        first = prompt_lens[0]
        prompt = random_prompts((first,), vocab, first)[0]
        with _NoComm(llm.comm) as nocomm:
            out[f"prefill_{first}_nocomm_s"] = _time_prefill(llm, prompt, device, 2)
        out["nocomm_swallowed_calls"] = nocomm.swallowed
    prompts = random_prompts([decode_context] * decode_batch, vocab, 99)
    out["decode_step_s"], out["decode_batch"] = _time_decode(llm, prompts, decode_steps, device)
    out["decode_requests"] = decode_batch
    layout = llm.engine.pool.layout
    # MLA KV per token on this GPU (the radix cache counts logical pages of page_size * dcp tokens)
    out["kv_bytes_per_token"] = layout.page_bytes / (layout.page_size * plan.dcp) if layout.page_bytes else 0.0
    out["slot_bytes"] = layout.slot_bytes
    if device.type == "cuda":
        out["weights_gib"] = round(sum(t.numel() * t.element_size() for t in llm.weights.values()) / 2**30, 2)
        out["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return out


def speed(setup_device: str, backend: str, smoke: bool, log, only: list[str] | None, section: dict):
    """Fills `section` plan by plan (the caller writes it out after each, so a timeout keeps the finished plans)."""
    model = SMOKE["model"] if smoke else "k3-mini"
    dtype = "float32" if smoke else "bfloat16"
    engine = SMOKE["engine"] if smoke else SPEED_ENGINE
    prompt_lens = SMOKE["prompt_lens"] if smoke else (8192, 32768)
    batch = SMOKE["decode_batch"] if smoke else DECODE_BATCH
    context = SMOKE["decode_context"] if smoke else DECODE_CONTEXT
    steps = SMOKE["decode_steps"] if smoke else DECODE_STEPS
    section.update({"model": model, "dtype": dtype, "backend": backend, "engine": dict(engine),
                    "decode": {"batch": batch, "context": context, "steps": steps}, "plans": {}})
    for name, plan in SPEED_PLANS.items():
        if only and name not in only:
            continue
        if smoke and name == "tp2+dcp2":
            continue
        started = time.perf_counter()
        try:
            ranks = spawn(_speed_rank, plan, args=(model, backend, dtype, engine, prompt_lens, batch, context, steps),
                          setup=dist_setup(setup_device), timeout_s=420)
            row = dict(ranks[-1])                      # the last stage's rank saw the whole pipeline finish
            row["per_rank_decode_step_s"] = [r["decode_step_s"] for r in ranks]
        except Exception as exc:
            row = dict(error=f"{type(exc).__name__}: {str(exc)[-800:]}")
        row["seconds"] = round(time.perf_counter() - started, 1)
        _derive(row, prompt_lens, plan)
        section["plans"][name] = row
        log(f"speed {name:9s} " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k != "error")
            + (f"  ERROR {row['error'][:400]}" if "error" in row else ""))
        yield
    return section


def _derive(row: dict, prompt_lens, plan: ParallelPlan) -> None:
    if "error" in row:
        return
    for length in prompt_lens:
        row[f"prefill_{length}_tok_s"] = length / row[f"prefill_{length}_s"]
    first = prompt_lens[0]
    if f"prefill_{first}_nocomm_s" in row:
        exposed = row[f"prefill_{first}_s"] - row[f"prefill_{first}_nocomm_s"]
        row["exposed_comm_ms_per_1k_prefill_tokens"] = 1000.0 * exposed / first * 1000.0
    row["decode_tok_s"] = row["decode_batch"] / row["decode_step_s"]
    if row["decode_batch"] != row.get("decode_requests", row["decode_batch"]):
        row["decode_note"] = (f"only {row['decode_batch']} of {row['decode_requests']} requests decoded through the "
                              "timed steps: not comparable")
    if row.get("kv_bytes_per_token"):
        row["kv_tokens_per_gib"] = int(2**30 / row["kv_bytes_per_token"])
    row["gpus"] = plan.world_size


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
