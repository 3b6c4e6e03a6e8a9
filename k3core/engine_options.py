"""What an engine is built with: `EngineOptions` (every keyword of `LLM` beyond the model's) and the defaults that
depend on the device or the model's state sizes."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineOptions:
    prefix_cache: bool = True
    chunked_prefill_tokens: int | None = None    # tokens per step; None: `default_prefill_budget(device)`
    max_running_requests: int = 64
    page_size: int = 16
    checkpoint_interval: int | None = None   # tokens between cache checkpoints; None: `default_checkpoint_interval`
    overlap: bool = True                     # run the host work of step N+1 while the GPU runs step N (one device)
    memory_bytes: int | None = None          # pool arena size; None: memory_fraction of free device memory
    memory_fraction: float = 0.5             # (CPU: of 1 GiB)
    cuda_graphs: bool = False                # replay decode steps from CUDA/HIP graphs captured at start
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)   # one graph per size; larger batches: eager
    graph_max_context: int = 32768           # longest context a replayed step holds; longer: eager (every row's
                                             # page table is this wide, and MLA decode splits that width)
    split_mixed_steps: bool = True           # with graphs: a step of prefill chunks and decodes replays the decodes
                                             # from their graph beside an eager forward of the chunks (mixed_step.py)

    def __post_init__(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ValueError(message)
        need(self.chunked_prefill_tokens is None or self.chunked_prefill_tokens >= 1,
             "chunked_prefill_tokens must be >= 1")
        need(self.max_running_requests >= 1, "max_running_requests must be >= 1")
        need(self.page_size >= 1, "page_size must be >= 1")
        need(self.checkpoint_interval is None or (
            self.checkpoint_interval >= self.page_size and self.checkpoint_interval % self.page_size == 0),
             f"checkpoint_interval ({self.checkpoint_interval}) must be a positive multiple of page_size "
             f"({self.page_size})")
        need(self.memory_bytes is None or self.memory_bytes > 0, "memory_bytes must be positive")
        need(0 < self.memory_fraction <= 1, "memory_fraction must be in (0, 1]")
        sizes = self.graph_batch_sizes
        need(isinstance(sizes, (tuple, list)) and len(sizes) > 0
             and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes),
             f"graph_batch_sizes must be a non-empty list of positive batch sizes, got {sizes!r}")
        self.graph_batch_sizes = tuple(sorted(set(sizes)))
        need(isinstance(self.graph_max_context, int) and self.graph_max_context >= 2,
             f"graph_max_context must be at least 2 tokens, got {self.graph_max_context!r}")


GPU_PREFILL_BUDGET = 2048      # k3-mini on an H200, 128 x 1K prompts: 4.5x the throughput of 512, within 5% of 8192
CPU_PREFILL_BUDGET = 512       # a CPU step of 2048 tokens would stall every decode for seconds


def default_prefill_budget(device: torch.device | str) -> int:
    """Tokens one engine step may feed when chunked_prefill_tokens is not given. Every step reads all the weights,
    so small chunks multiply that cost; large ones stall the decodes that share the step (ITL)."""
    return CPU_PREFILL_BUDGET if torch.device(device).type == "cpu" else GPU_PREFILL_BUDGET


def default_checkpoint_interval(slot_bytes: int, page_bytes: int, page_size: int) -> int:
    """The cache's checkpoint interval when none is given: the fewest whole pages whose MLA bytes reach one KDA slot,
    so that checkpoints never hold more memory than the tokens they cover (a K3 slot is about 54 MB, 64 tokens of
    its MLA pages about 4 MB: every 64 tokens the checkpoints would take 13x the KV). A longer interval costs a
    recomputation of at most interval - 1 tokens after a hit; a shorter one, memory that could hold other prefixes."""
    return page_size * max(1, -(-slot_bytes // page_bytes))
