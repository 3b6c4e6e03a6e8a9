"""The step loop: schedule -> run the network -> sample -> emit.

`Engine` owns the unified pool, the radix cache and the scheduler of one model replica. `step()` runs one batch
and returns what each request produced; `run_until_done` drives it for the offline `LLM.generate`, and the
server calls `step()` from its own engine thread. Sampling a step's rows is `k3core.step_sample`; what a step
emits and the rules that finish a request are `k3core.step_output`.

With `EngineOptions.cuda_graphs` the engine captures the decode step once at start (one CUDA/HIP graph per batch
bucket, `k3core.model.graph_decode`) and replays it for every step that is decode only and fits the graphs (batch
within the largest bucket, every context within `graph_max_context`); every other step runs eagerly.

Structured outputs (`SamplingParams.structured`): the engine keeps a grammar matcher per constrained request
(`k3core.structured.matchers.Constraints`, created with the first such request). A step whose rows include
constrained requests fills their token bitmask on the host and the sampler applies it on the device; each sampled
token is accepted into its matcher, and a matcher that terminates finishes its request ("stop"). A row's mask
needs the token the step before sampled, so with overlap the engine reads the step in flight back before it
launches the next whenever that step held a constrained request (`num_resolved_steps` counts those); a batch
without constrained requests runs exactly as before: no mask, no extra wait.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3core.engine_invariants import check_engine_invariants
from k3core.engine_options import (  # noqa: F401 (re-exported: k3core.engine is where callers import them)
    CPU_PREFILL_BUDGET,
    GPU_PREFILL_BUDGET,
    EngineOptions,
    default_checkpoint_interval,
    default_prefill_budget,
)
from k3core.isolation import Quarantine, roll_back
from k3core.mixed_step import run_split, split_mixed
from k3core.model.batch import FutureTokens, SeqWork
from k3core.model.graph_decode import capture_decode_graphs, graph_runner_for
from k3core.prompt_logprob_store import PromptLogprobStore
from k3core.prompt_logprobs import DevicePromptLogprobs, PromptLogprobs, PromptRows, prompt_positions, \
    score_prompt_rows
from k3core.sampler import DeviceSample, Sampler
from k3core.sampling_params import SamplingParams
from k3core.sched.request import UNRESOLVED_TOKEN, Request
from k3core.sched.scheduler import Scheduler, SchedulerOptions
from k3core.step_counts import StepCounts
from k3core.step_output import StepOutput, drop_unresolved, finish_reason
from k3core.step_sample import ResolvedSample, sample_step
from k3core.stop import OutputText
from k3core.transfer import index_tables


@dataclass
class _Launched:
    """A step on the device whose sampled ids the host has not read yet."""
    requests: list[Request]              # the rows of `sample`, in order
    sample: DeviceSample | ResolvedSample | None
    row_of: dict[str, int]               # request id -> row
    prompt: DevicePromptLogprobs | None = None    # the step's prompt logprobs, read before its samples


class Engine:
    def __init__(self, llm, options: EngineOptions, graph_runner_factory: Callable[..., object] | None = None):
        """`graph_runner_factory` stands in for the backend's `graph_runner` when cuda_graphs is on (tests inject
        one that replays by calling the step on its static buffers; leave it None otherwise)."""
        import dataclasses

        from k3core.cache import RadixCache
        from k3core.memory import PoolLayout, UnifiedPool
        self.llm = llm
        self.options = options
        self.runner = llm.runner
        self.config = llm.config
        plan = llm.plan
        if options.cuda_graphs:          # before the pool is allocated: a refused option costs nothing
            graph_runner_factory = graph_runner_for(llm, graph_runner_factory)
        # Every rank makes the same scheduling decisions, so every rank's pool must have the same block sizes: pad
        # to the stage with the most KDA / MLA layers (pipeline stages differ by at most a layer or two).
        stages = plan.layer_ranges(self.config)
        layout = PoolLayout.from_config(llm.network.config, page_size=options.page_size, kv_dtype=llm.kv_dtype,
                                        conv_dtype=llm.dtype)
        layout = dataclasses.replace(
            layout,
            num_kda_layers=max(sum(self.config.layer_types[i] == "kda" for i in r) for r in stages),
            num_mla_layers=max(sum(self.config.layer_types[i] == "mla" for i in r) for r in stages))
        if options.memory_bytes is not None:
            self.pool = UnifiedPool(layout, options.memory_bytes, device=llm.device)
        elif llm.device.type == "cpu":
            self.pool = UnifiedPool(layout, int(options.memory_fraction * (1 << 30)), device=llm.device)
        elif plan.is_single:
            self.pool = UnifiedPool.from_free_memory(layout, options.memory_fraction, device=llm.device)
        else:
            raise ValueError("under a parallel plan give memory_bytes, so that every rank's pool is the same size")
        self.page_size = self.runner.logical_page_size     # tokens per page as the scheduler counts them
        self.chunked_prefill_tokens = options.chunked_prefill_tokens or default_prefill_budget(llm.device)
        interval = options.checkpoint_interval
        if interval is None:
            interval = default_checkpoint_interval(layout.slot_bytes, layout.page_bytes, self.page_size)
        if interval % self.page_size:
            raise ValueError(f"checkpoint_interval ({interval}) must be a multiple of the "
                             f"logical page size {self.page_size} (page_size x dcp)")
        self.checkpoint_interval = interval
        self.cache = RadixCache(self.pool, self.page_size, interval) if options.prefix_cache else None
        # prompt logprobs by prefix: what lets a prompt-logprobs request read the prefix cache at all
        self.prompt_logprob_store = PromptLogprobStore(self.page_size) if options.prefix_cache else None
        self.scheduler = Scheduler(self.pool, self.cache, SchedulerOptions(
            options.max_running_requests, self.chunked_prefill_tokens, self.page_size,
            self.config.max_position_embeddings))
        # Overlap needs the sampled ids on the device of the next step: one device only.
        self.overlap = options.overlap and plan.is_single
        self._in_flight: _Launched | None = None
        self._launching: list | None = None          # the chunks of the step being launched (until its sample)
        self._processing: _Launched | None = None    # the step whose sample is being read
        self._outputs: list[StepOutput] = []         # what this step has emitted so far
        self.quarantine = Quarantine()               # k3core.isolation: failed steps fail their culprit only
        self.requests: dict[str, Request] = {}
        self.output_texts: dict[str, OutputText] = {}     # of the unfinished requests, by request id
        self._ids = itertools.count()
        self.eos_token_ids = set(getattr(llm.tokenizer, "eos_token_ids", []) or [])
        if self.config.eos_token_id is not None:
            self.eos_token_ids.add(self.config.eos_token_id)
        self.sampler = Sampler(self.config.vocab_size, llm.device, self.eos_token_ids, llm.ops)
        self.step_counts = StepCounts()                   # the steps run, by kind (k3core.step_counts)
        self.constraints = None                           # structured outputs' matchers, from the first such request
        self.num_resolved_steps = 0                       # overlapped steps that read the step in flight first
        self.closed = False
        self.graph_decode = None
        if options.cuda_graphs:
            pool_tokens = self.pool.usage().capacity_bytes // self.pool.layout.page_bytes * self.page_size
            self.graph_decode = capture_decode_graphs(
                llm.network, self.pool, min(options.graph_max_context, self.config.max_position_embeddings,
                                            pool_tokens), options.graph_batch_sizes, graph_runner_factory)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        params.validate()
        if self.closed:
            raise ValueError("the engine is closed; start a new one to serve more requests")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests and not self.requests[request_id].is_finished:
            raise ValueError(f"request id {request_id!r} is already running")
        if params.prompt_logprobs is not None and not self.llm.plan.is_single:
            raise ValueError("prompt_logprobs are computed on one device only; leave them out under a parallel plan")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.config.max_position_embeddings:
            raise ValueError(f"prompt ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's maximum context length of {self.config.max_position_embeddings} tokens")
        layout = self.pool.layout
        pages = -(-total // self.page_size)
        room = self.pool.usage().capacity_bytes - self.reserved_bytes
        if layout.slot_bytes + pages * layout.page_bytes > room:
            raise ValueError(f"a request of {total} tokens needs more memory than the pool holds for requests "
                             f"({room} bytes); lower max_tokens or raise memory_bytes")
        request = Request(request_id, list(prompt_token_ids), params, arrival=time.monotonic())
        if params.structured is not None:          # compiles the grammar (cached): StructuredError is a ValueError
            self._constraints().add(request_id, params.structured)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = PromptLogprobs.empty(len(prompt_token_ids))
            if self.prompt_logprob_store is not None:
                known, stored = self.prompt_logprob_store.lookup(request.prompt_token_ids, params.prompt_logprobs)
                if stored is not None:                  # positions 0..known-1 scored by an earlier prompt
                    request.prompt_logprobs.entries[:known] = stored.entries[:known]
                    request.prompt_logprobs.ranks[:known] = stored.ranks[:known]
                    request.num_known_prompt_logprobs = known
        self.sampler.add_request(request_id, params, request.prompt_token_ids)
        self.requests[request_id] = request
        self.output_texts[request_id] = OutputText(self.llm.tokenizer, params.stop, params.include_stop_str_in_output)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        drop_unresolved(request)
        self.scheduler.abort(request)
        self.sampler.remove_request(request_id)
        if self.constraints is not None:
            self.constraints.remove(request_id)
        self.quarantine.cleared(request_id)
        self._close_text(request)
        return True

    @property
    def num_steps(self) -> int:
        return self.step_counts.num_steps

    @property
    def num_graph_steps(self) -> int:
        """Steps whose decodes were replayed from a captured decode graph (whole or split)."""
        return self.step_counts.graph_steps

    @property
    def has_work(self) -> bool:
        """Requests to schedule, or a step in flight whose tokens some unfinished request still waits for."""
        in_flight = self._in_flight
        return self.scheduler.has_work or (in_flight is not None and any(
            not r.is_finished for r in in_flight.requests))

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step. Overlapped (`EngineOptions.overlap`): launch step N+1 on the device, then read and emit step
        N's tokens while the GPU runs N+1; the outputs are those of the plain loop, one step later.

        A failure in the forward pass or the sampler is isolated (k3core.isolation): the step is rolled back, its
        requests recompute, and only the request that fails on its own ends, with finish_reason "error"."""
        self._outputs = []
        try:
            self._step()
        except Exception as exc:
            if not self._recover(exc):
                raise
        outputs, self._outputs = self._outputs, []
        return outputs

    def _step(self) -> None:
        if not self.overlap or self.quarantine.active:     # suspects run alone, one step after the other
            if self._in_flight is not None:
                self._process_step(self._in_flight)
                self._in_flight = None
            self._process_step(self._launch(None))
            return
        previous = self._in_flight
        if previous is not None and self._holds_constrained(previous):
            # its constrained rows' next masks need the tokens it sampled: read them before launching
            self.num_resolved_steps += 1
            self._in_flight = None
            self._process_step(previous)
            self._in_flight = self._launch(None)
            return
        self._in_flight = self._launch(previous)      # before reading `previous`: a failure there leaves no stale record
        self._process_step(previous)

    def _process_step(self, launched: _Launched | None) -> None:
        self._processing = launched
        self._process(launched, self._outputs)
        self._processing = None

    def _recover(self, exc: Exception) -> bool:
        """Roll back the failed step (k3core.isolation); False if it cannot be isolated (then the caller raises)."""
        launching, processing = self._launching, self._processing
        self._launching = self._processing = None
        if not self.llm.plan.is_single or (launching is None and processing is None):
            return False                  # every rank must take the same decisions; or a bookkeeping bug
        message = f"the engine failed while running this request ({type(exc).__name__}: {exc})"
        in_flight, self._in_flight = self._in_flight, None
        culprits = [c.request for c in launching] if launching is not None else processing.requests
        involved = list(culprits)
        for launched in (processing, in_flight):
            if launched is not None:
                involved.extend(launched.requests)
        for chunk in launching or []:
            self.scheduler.unschedule(chunk)      # its snapshot slots were never committed
        alone = len({r.request_id for r in culprits}) == 1
        if alone:                                 # the step held one request: it failed on its own
            self._outputs.append(self._fail(culprits[0], message))
        self.quarantine.num_failures += 1
        for request in roll_back(self, involved):
            if not alone:
                self.quarantine.suspects.add(request.request_id)
        return True

    def _fail(self, request: Request, message: str) -> StepOutput:
        """End a request whose own work failed; its memory is freed as for an abort."""
        drop_unresolved(request)
        request.finish_reason = "error"
        self.scheduler.abort(request)
        self.sampler.remove_request(request.request_id)
        if self.constraints is not None:
            self.constraints.remove(request.request_id)
        self.quarantine.cleared(request.request_id)
        return StepOutput(request.request_id, [], True, "error", new_text=self._close_text(request), error=message)

    def _constraints(self):
        if self.constraints is None:
            from k3core.structured.matchers import Constraints
            self.constraints = Constraints(self.llm.tokenizer, self.config.vocab_size, self.eos_token_ids)
        return self.constraints

    def _holds_constrained(self, launched: _Launched) -> bool:
        constraints = self.constraints
        return bool(constraints) and any(r.request_id in constraints for r in launched.requests
                                         if not r.is_finished)

    def _launch(self, previous: _Launched | None) -> _Launched | None:
        """Schedule, build the batch, run the network and the sampler: device work only, no wait for the GPU.
        A decode whose input token `previous` sampled reads it from the device (FutureTokens)."""
        chunks = self.scheduler.schedule()
        if chunks and self.quarantine.active:
            chunks = self.quarantine.select(chunks, self.scheduler)
        if not chunks:
            return None
        assert len({id(c.request) for c in chunks}) == len(chunks), "the scheduler gave a request two chunks"
        self.step_counts.count(chunks)
        pool = self.pool
        work, positions, rows, flat = [], [], [], 0
        prompt_rows: list[PromptRows] = []
        sample_rows: list[int] = []              # row of the logits each sampled chunk samples from
        num_logit_rows = 0
        for chunk in chunks:
            request = chunk.request
            start = request.num_computed_tokens
            token_ids = request.token_slice(start, start + chunk.num_tokens)
            scored = prompt_positions(len(request.prompt_token_ids), request.needs_prompt_logprobs, start,
                                      chunk.num_tokens)
            want_logits = "all" if scored else "last" if chunk.samples else "none"
            if scored:
                prompt_rows.append(PromptRows(request.prompt_token_ids, request.prompt_logprobs, scored,
                                              num_logit_rows, request.params.prompt_logprobs))
            num_logit_rows += {"all": chunk.num_tokens, "last": 1, "none": 0}[want_logits]
            if chunk.samples:
                sample_rows.append(num_logit_rows - 1)
            if request.num_unresolved:            # its input is the token the step in flight sampled
                assert chunk.num_tokens == 1 and token_ids == [UNRESOLVED_TOKEN] and previous is not None, (
                    f"request {request.request_id} feeds an unresolved token outside a decode")
                positions.append(flat)
                rows.append(previous.row_of[request.request_id])
            work.append(SeqWork(
                new_token_ids=token_ids,
                prefix_len=start,
                slot_position=pool.slot_position(request.working_slot),
                page_positions=pool.page_positions(request.page_handles),
                want_logits=want_logits,
                snapshots=[(s.position - start, -1 if s.slot is None else pool.slot_position(s.slot))
                           for s in chunk.snapshots]))
            flat += chunk.num_tokens
        future = FutureTokens(previous.sample.token_ids, positions, rows) if positions else None
        self._launching = chunks                  # a failure from here to the sample is rolled back (_recover)
        logits = self._forward(work, future)                                             # [R, V] or None
        prompt = None
        if prompt_rows:                        # one device (add_request): every row is here
            prompt = score_prompt_rows(logits, prompt_rows)
            prompt.start_copy()
            if len(sample_rows) != num_logit_rows:
                logits = logits[index_tables([sample_rows], logits.device, torch.int64)[0]]   # [S, V]
        sampled = [c.request for c in chunks if c.samples]
        sample = self._sample(logits, sampled) if sampled else None
        self._launching = None
        for chunk in chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
            if chunk.snapshots:
                self.scheduler.commit_snapshots(chunk)
        for request in sampled:                   # a placeholder until the host reads the id
            request.output_token_ids.append(UNRESOLVED_TOKEN)
            request.num_unresolved += 1
        return _Launched(sampled, sample, {r.request_id: row for row, r in enumerate(sampled)}, prompt)

    def _process(self, launched: _Launched | None, outputs: list[StepOutput]) -> list[StepOutput]:
        """Read a launched step's sampled ids (the one wait for the GPU) and emit them into `outputs`: placeholders
        replaced, logprobs, incremental text and stop checks, finishes. Requests finished or aborted since are
        skipped; a request whose own emission fails is failed alone (on one device)."""
        if launched is None:
            return outputs
        if launched.prompt is not None:
            launched.prompt.result()
        if launched.sample is None:
            return outputs
        host = launched.sample.result()
        for row, request in enumerate(launched.requests):
            if request.is_finished:
                continue
            if row in getattr(launched.sample, "failed", {}):      # under a plan: every rank fails it alike
                outputs.append(self._fail(request, launched.sample.failed[row]))
                continue
            if request.params.max_tokens == 0:     # the prompt only: the token sampled after it is not output
                outputs.append(self._finish_prompt_only(request))
                continue
            index = len(request.output_token_ids) - request.num_unresolved
            request.output_token_ids[index] = host.token_ids[row]
            request.num_unresolved -= 1
            self.quarantine.cleared(request.request_id)
            try:
                outputs.append(self._append_token(request, host.token_ids[row], host.logprobs[row]))
            except Exception as exc:  # noqa: BLE001 (this request's text or stop check: fail it, not the batch)
                if not self.llm.plan.is_single:
                    raise                # a failure on one rank alone would leave the ranks out of step
                outputs.append(self._fail(request, f"the engine failed while emitting this request's token "
                                                   f"({type(exc).__name__}: {exc})"))
        return outputs

    def _forward(self, work: list[SeqWork], future: FutureTokens | None) -> torch.Tensor | None:
        """Logits [R, V] of the rows that want them: replayed from a decode graph when the step fits one."""
        graph = self.graph_decode
        if graph is not None and not graph.accepts(work) and self.options.split_mixed_steps:
            split = split_mixed(work, graph, future)
            if split is not None:
                self.step_counts.graph_steps += 1
                self.step_counts.split_steps += 1
                return run_split(split, work, future, graph, self.runner, self.pool)
        if graph is None or not graph.accepts(work):
            return self.runner.forward(work, self.pool, future)
        self.step_counts.graph_steps += 1
        logits = graph.run(work, future)                          # [len(work), V], valid until the next replay
        wanted = [row for row, item in enumerate(work) if item.want_logits != "none"]
        if len(wanted) == len(work):
            return logits
        return logits[index_tables([wanted], logits.device, torch.int64)[0]]

    def _sample(self, logits: torch.Tensor | None, requests: list[Request]):
        """The batch's next tokens (`k3core.step_sample`)."""
        return sample_step(logits, requests, self.sampler, self.constraints, self.runner, self.llm.plan.is_single)

    def _append_token(self, request: Request, token_id: int, logprobs: dict[int, float] | None) -> StepOutput:
        now = time.monotonic()
        prompt_logprobs = None
        if request.first_token_time is None:
            request.first_token_time = now
            prompt_logprobs = request.prompt_logprobs
            self._store_prompt_logprobs(request)
        new_logprobs = []
        if request.params.logprobs is not None and logprobs is not None:
            request.output_logprobs.append(logprobs)
            new_logprobs = [logprobs]
        output_text = self.output_texts[request.request_id]
        num_output = len(request.output_token_ids) - request.num_unresolved       # this token included
        new_text = output_text.push([token_id], may_stop=num_output >= request.params.min_tokens)
        reason = finish_reason(request, token_id, output_text, self.eos_token_ids,
                               self.config.max_position_embeddings)
        constraints = self.constraints
        if constraints is not None and request.request_id in constraints:
            if constraints.accept(request.request_id, token_id):
                reason = "stop"                             # the grammar has ended
        if reason is not None:
            new_text += self._close_text(request)
            request.finish_reason = "stop" if output_text.stopped else reason
            drop_unresolved(request)
            self.scheduler.finish(request)
            self.sampler.remove_request(request.request_id)
            if constraints is not None:
                constraints.remove(request.request_id)
        return StepOutput(request.request_id, [token_id], reason is not None, request.finish_reason, new_logprobs,
                          new_text, prompt_logprobs=prompt_logprobs)

    def _finish_prompt_only(self, request: Request) -> StepOutput:
        """Finish a max_tokens 0 request once its prompt has run: no token, finish_reason "length"."""
        request.first_token_time = time.monotonic()
        self._store_prompt_logprobs(request)
        drop_unresolved(request)
        request.finish_reason = "length"
        self._close_text(request)
        self.scheduler.finish(request)
        self.sampler.remove_request(request.request_id)
        return StepOutput(request.request_id, [], True, "length", prompt_logprobs=request.prompt_logprobs)

    def _store_prompt_logprobs(self, request: Request) -> None:
        if self.prompt_logprob_store is not None and request.prompt_logprobs is not None:
            self.prompt_logprob_store.put(request.prompt_token_ids, request.prompt_logprobs,
                                          request.params.prompt_logprobs)

    def _close_text(self, request: Request) -> str:
        """Set the request's final text; returns what its output text still held back (nothing after a stop)."""
        output_text = self.output_texts.pop(request.request_id, None)
        if output_text is None:
            return ""
        rest = output_text.finish()
        request.text = output_text.text
        return rest

    # ---- offline driver -------------------------------------------------------------------------
    def run_until_done(self, request_ids: list[str], use_tqdm: bool = False) -> dict:
        from k3core.outputs import CompletionOutput
        progress = None
        if use_tqdm:
            from tqdm import tqdm
            progress = tqdm(total=len(request_ids), desc="generate", unit="req")
        pending = set(request_ids)
        while pending:
            if not self.has_work:
                raise RuntimeError("the engine has no work left but requests are unfinished (this is a bug)")
            for output in self.step():
                if output.finished and output.request_id in pending:
                    pending.discard(output.request_id)
                    if progress is not None:
                        progress.update(1)
            pending = {r for r in pending if not self.requests[r].is_finished}
        if not self.scheduler.has_work:
            self.drain()
        if progress is not None:
            progress.close()
        results = {}
        for request_id in request_ids:
            request = self.requests.pop(request_id)
            self._close_text(request)
            results[request_id] = CompletionOutput(
                request_id, request.prompt_token_ids, list(request.output_token_ids), request.text,
                request.finish_reason or "abort", request.num_cached_tokens,
                request.output_logprobs if request.params.logprobs is not None else None, request.prompt_logprobs)
        return results

    def drain(self) -> list[StepOutput]:
        """Read back the step in flight, if any (overlap), without launching another."""
        launched, self._in_flight = self._in_flight, None
        return self._process(launched, [])

    # ---- memory ---------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        if self.cache is None:
            return True
        self.cache.flush()
        self.prompt_logprob_store.flush()
        return True

    def memory_usage(self):
        """The pool's usage; with cuda_graphs, one slot and one page of it are the decode graphs' scratch."""
        return self.pool.usage()

    @property
    def reserved_bytes(self) -> int:
        """Pool bytes the engine holds for itself (the decode graphs' scratch slot and page), never for requests."""
        if self.graph_decode is None:
            return 0
        return self.pool.layout.slot_bytes + self.pool.layout.page_bytes

    def close(self) -> None:
        """Abort every unfinished request and give back the decode graphs and their scratch slot and page; the
        cached prefixes stay in the pool. add_request refuses work afterwards."""
        for request_id, request in list(self.requests.items()):
            if not request.is_finished:
                self.abort(request_id)
        self.drain()
        if self.graph_decode is not None:
            self.graph_decode.close()
            self.graph_decode = None
        self.closed = True

    def check_invariants(self) -> None:
        """Pool, cache and prompt-logprob store structure, and the ownership rules between requests and the cache
        (k3core.engine_invariants)."""
        check_engine_invariants(self)
