"""FlashInfer's MLA paged decode behind k3core's `mla_decode` signature (NVIDIA only).

FlashInfer (docs: flashinfer.mla.BatchMLAPagedAttentionWrapper) takes the absorbed query and the latent cache as
two halves, [c_kv | k_pe], and the pages as CSR (kv_indptr, kv_indices) instead of our padded page table. Our
kv_cache rows are already [c_kv | k_pe], so the halves are slices of one buffer (FlashInfer reads page/token
strides from the tensors). Limits stated by its documentation and code, and repeated in `reasons`:

* head_dim_ckv 512 and head_dim_kpe 64 (the DeepSeek shapes its MLA kernels are built and tested for);
* float16 / bfloat16 query and cache, compute capability 8.0 or newer;
* its log-sum-exp is base 2 unless `return_lse_base_on_e=True` (newer releases); we convert to natural log;
* `plan()` copies the index arrays to the host, so one call cannot be captured in a CUDA graph as it is.
"""
from __future__ import annotations

import inspect
import math

import torch

from k3core.backend import OpSpec
from k3core.ops import MlaDecodeOut

WORKSPACE_BYTES = 128 * 1024 * 1024     # FlashInfer's recommended split-k workspace
SUPPORTED_CKV, SUPPORTED_KPE = 512, 64
_WRAPPERS: dict[torch.device, object] = {}


def reasons(spec: OpSpec) -> list[str]:
    found = []
    if spec.dtype not in (torch.float16, torch.bfloat16):
        found.append(f"FlashInfer MLA decode needs float16 or bfloat16, not {str(spec.dtype).removeprefix('torch.')}")
    if spec.device.type != "cuda":
        found.append(f"device is {spec.device.type.upper()}; FlashInfer needs a CUDA device")
    elif torch.cuda.is_available() and torch.cuda.get_device_capability(spec.device)[0] < 8:
        found.append("FlashInfer MLA decode needs compute capability 8.0 or newer")
    config = spec.config
    if config is not None and "mla" in config.layer_types and (
            config.kv_lora_rank != SUPPORTED_CKV or config.qk_rope_head_dim != SUPPORTED_KPE):
        found.append(f"latent {config.kv_lora_rank} + rope {config.qk_rope_head_dim}: FlashInfer's MLA kernels serve "
                     f"only {SUPPORTED_CKV} + {SUPPORTED_KPE}")
    return found


def _wrapper(device: torch.device):
    if device not in _WRAPPERS:
        import flashinfer  # noqa: PLC0415  (vendor package: imported on first use only)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _WRAPPERS[device] = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    return _WRAPPERS[device]


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, v_dim: int) -> MlaDecodeOut:
    batch, num_heads, latent_width = q.shape                      # [B, H, D_latent]
    rope_dim = latent_width - v_dim
    if batch == 0:
        return MlaDecodeOut(q.new_empty(0, num_heads, v_dim), torch.empty(0, num_heads, device=q.device))
    page_size = kv_cache.shape[1]
    pages_per_request = (seq_lens.long() + page_size - 1) // page_size           # [B]
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=q.device)
    kv_indptr[1:] = torch.cumsum(pages_per_request, 0)
    used = torch.arange(page_table.shape[1], device=q.device)[None, :] < pages_per_request[:, None]  # [B, max_pages]
    kv_indices = page_table[used].to(torch.int32)                 # row-major order keeps each request's pages in order
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    wrapper = _wrapper(q.device)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, seq_lens.to(torch.int32), num_heads, v_dim, rope_dim,
                 page_size, False, scale, q.dtype, kv_cache.dtype)
    run_args = dict(return_lse=True)
    natural = "return_lse_base_on_e" in inspect.signature(wrapper.run).parameters
    if natural:
        run_args["return_lse_base_on_e"] = True
    output, lse = wrapper.run(q[..., :v_dim], q[..., v_dim:], kv_cache[..., :v_dim], kv_cache[..., v_dim:],
                              **run_args)                          # [B, H, v_dim], [B, H]
    if not natural:
        lse = lse * math.log(2.0)                                  # base 2 -> natural log
    return MlaDecodeOut(output, lse.float())
