"""The public Python API: `LLM(model, backend, device, dtype)` with `prompt_logits` and `generate`.

    from k3core import LLM, SamplingParams
    llm = LLM("k3-demo", backend="torch", device="cpu", dtype="float32")   # the shipped trained demo model
    llm.prompt_logits([1, 2, 3])            # [3, vocab] float32, one full-sequence forward
    outs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, temperature=0.0))
    outs[0].token_ids                       # the generated tokens only

`expert_format="mxfp4"` holds the routed experts packed (MXFP4, W4A16 kernels) even for a bf16 checkpoint or a
preset, `"bf16"` dequantises an MXFP4 checkpoint's experts; the default keeps what the checkpoint has.
Further keywords are engine options (`k3core.engine.EngineOptions`), e.g. `LLM("k3-mini", backend="cuda",
device="cuda", dtype="bf16", cuda_graphs=True)` replays decode steps from CUDA graphs.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from k3core.backend import OpSpec, select_ops
from k3core.config import ModelConfig, list_presets, load_config, resolve_model
from k3core.host_threads import set_engine_threads
from k3core.model.batch import SeqWork, build_forward_batch
from k3core.model.network import Network
from k3core.outputs import CompletionOutput  # re-exported: `from k3core.llm import CompletionOutput`
from k3core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from k3core.parallel.plan import ParallelPlan

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def scratch_forward(config: ModelConfig, token_ids: Sequence[int], dtype: torch.dtype, device: torch.device):
    """(batch, state) for one full-sequence forward from an empty state, all logits wanted: a pool sized for
    exactly one slot and this prompt's pages (so a one-off forward never touches the engine's pool)."""
    from k3core.memory import PoolLayout, UnifiedPool
    page_size = 16
    layout = PoolLayout.from_config(config, page_size=page_size, kv_dtype=dtype, conv_dtype=dtype)
    num_pages = -(-len(token_ids) // page_size)
    slot_in_pages = -(-layout.slot_bytes // layout.page_bytes)        # the arena is a whole number of pages
    pool = UnifiedPool(layout, (slot_in_pages + num_pages) * layout.page_bytes, device=device)
    slot, pages = pool.alloc_slot(), pool.alloc_pages(num_pages)
    pool.zero_slot(slot)
    work = SeqWork(token_ids, prefix_len=0, slot_position=pool.slot_position(slot),
                   page_positions=pool.page_positions(pages), want_logits="all")
    return build_forward_batch([work], page_size, device), pool


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A shard that is a view into the full tensor (a row slice, already on the right device) would keep the whole
    tensor alive: copy it out."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


class LLM:
    def __init__(self, model: str = "k3-demo", backend: str = "torch", device: str = "cpu",
                 dtype: str | torch.dtype = "float32", seed: int = 0, plan: "ParallelPlan | None" = None,
                 rank: int = 0, expert_format: str | None = None, cpu_threads: int | None = None,
                 **engine_options):
        from k3core.parallel.comm import SINGLE, build_communicator
        from k3core.parallel.plan import ParallelPlan
        from k3core.parallel.runner import ModelRunner
        from k3core.parallel.shard import shard_model

        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        # torch intra-op threads: 1 beside a GPU unless cpu_threads or OMP_NUM_THREADS says otherwise (process-wide)
        self.cpu_threads = set_engine_threads(self.device, cpu_threads)
        self.model_name = str(model)
        model = resolve_model(model)                 # a shipped checkpoint's name -> its directory
        self.config: ModelConfig = load_config(model)
        if expert_format is not None:            # "mxfp4" | "bf16": the loader converts a checkpoint's experts
            self.config = self.config.replace(expert_format=expert_format)
        self.plan = plan or ParallelPlan()
        self.plan.check(self.config)
        self.rank = rank
        self.is_random = str(model) in list_presets() or Path(str(model)).suffix in (".yaml", ".yml")
        from k3core.tokenizer import load_tokenizer
        self.tokenizer = load_tokenizer(model, self.config)       # before the weights: a bad tokenizer fails fast
        # Random preset weights are drawn on this rank's device, whatever the plan, so every rank draws the numbers a
        # single-device run of the same seed draws (CPU and CUDA generators differ), and a GPU rank never builds the
        # whole model in host memory. A checkpoint under a plan is streamed: each rank reads only its own slices
        # straight to its device (the loader applies the plan as shard_model would).
        streamed = not self.plan.is_single and not self.is_random
        if self.is_random:
            from k3core.model.weights import init_random_weights
            weights = init_random_weights(self.config, seed=seed, dtype=self.dtype, device=self.device)
        else:
            from k3core.model.loader import load_checkpoint
            weights = load_checkpoint(model, self.config, dtype=self.dtype, device=self.device,
                                      plan=None if self.plan.is_single else self.plan, rank=rank)
        self.ops = select_ops(backend, OpSpec(self.config, self.dtype, self.device))
        if self.plan.is_single:
            self.comm = SINGLE
            self.weights = weights
            self.network = Network(self.config, weights, self.ops)
        else:
            from k3core.parallel.shard import RankShare
            self.comm = build_communicator(self.plan, rank)
            local = (RankShare(self.config, self.plan, rank).local_model(weights) if streamed
                     else shard_model(self.config, weights, self.plan, rank))
            self.weights = {name: _own_storage(t.to(self.device)) for name, t in local.weights.items()}
            local.weights.clear()
            del weights                          # the unsharded tensors go now, not when the LLM does
            self.network = Network(local.config, self.weights, self.ops, self.comm, local.layer_ids,
                                   local.expert_offset)
        self.kv_dtype = self.dtype
        from k3core.engine import Engine, EngineOptions
        options = EngineOptions(**engine_options)
        self.runner = ModelRunner(self.network, self.ops, options.page_size, self.device, self.comm)
        self.engine = Engine(self, options)

    # ---- one-off forward --------------------------------------------------------------------------
    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] (float32) of one full-sequence forward from an empty state."""
        if not self.plan.is_single:
            raise ValueError("prompt_logits runs the whole model on one device; under a parallel plan use generate")
        token_ids = self._check_prompt(token_ids)
        return self.network.forward(*scratch_forward(self.config, token_ids, self.dtype, self.device))

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int] | str],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        if params is None:
            params = SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids = [self.engine.add_request(self._encode(p), sp) for p, sp in zip(prompts, params_list)]
        results = self.engine.run_until_done(ids, use_tqdm=use_tqdm)
        return [results[i] for i in ids]

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def memory_usage(self):
        return self.engine.memory_usage()

    # ---- helpers ---------------------------------------------------------------------------------
    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            return self._check_prompt(self.tokenizer.encode(prompt))
        return self._check_prompt(prompt)

    def _check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if len(token_ids) > self.config.max_position_embeddings:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but the model's maximum context length is "
                             f"{self.config.max_position_embeddings}")
        return token_ids
