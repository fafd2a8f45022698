"""Dispatchers for the CUDA kernels in ``csrc/``, taking the arguments of their torch references
(:mod:`.tree_attention`), which run instead for CPU tensors, a failed build or ``LOOKAHEAD_VLLM_DISABLE_KERNELS=1``.
Nothing is built at import or inside an engine step: ``lookahead-vllm-build-kernels`` prebuilds, and
:func:`prepare_kernels` loads (or builds) at engine start; a load failure is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import torch

from lookahead_vllm.ops.tree_attention import compact_kv_ref, paged_tree_attention_ref

logger = logging.getLogger(__name__)

DISABLE_ENV = "LOOKAHEAD_VLLM_DISABLE_KERNELS"
_prepared = False  # whether prepare_kernels() ran in this process (engine start)


def prepare_kernels() -> bool:
    """Load (building if needed) the kernels at engine start; False: tree steps run the torch reference."""
    global _prepared
    _prepared = True
    if kernels_available():
        logger.info("lookahead_vllm CUDA kernels ready (tree attention, KV compaction)")
        return True
    logger.warning("lookahead_vllm: tree attention and KV compaction will run the torch reference "
                   "(ops/tree_attention.py) in every tree step; prebuild with lookahead-vllm-build-kernels")
    return False


@functools.cache
def kernels_available() -> bool:
    """Build/load the extension once; False (logged) if that fails or is disabled."""
    if not _prepared:
        logger.warning("lookahead_vllm CUDA kernels loaded on first use, not at engine start "
                       "(call ops.cuda.prepare_kernels() there); a missing build compiles now")
    if os.environ.get(DISABLE_ENV, "0") not in ("", "0"):
        logger.info("%s is set: using the torch reference for tree attention and KV compaction", DISABLE_ENV)
        return False
    try:
        from lookahead_vllm.ops import _build

        _build.load_extension()
        torch.ops.lookahead_vllm.tree_attention  # noqa: B018  (raises if the ops are not registered)
        torch.ops.lookahead_vllm.compact_kv  # noqa: B018
    except Exception as exc:  # noqa: BLE001 - any build/load failure means: fall back
        logger.warning("lookahead_vllm CUDA kernels unavailable, falling back to the torch reference "
                       "for tree attention and KV compaction: %s", exc)
        return False
    return True


def tree_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32: context + tail
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor,  # [num_tokens, num_words] int64
    scale: float, *,
    max_query_len: int | None = None,  # host-side bounds; computed (one sync) if None
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; rows outside requests untouched
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged tree attention: the CUDA kernel for CUDA tensors, else the reference."""
    if not (query.is_cuda and kernels_available()):
        result = paged_tree_attention_ref(query, key_cache, value_cache, block_tables, seq_lens,
                                          query_start_loc, tree_mask, scale)
        return result if out is None else out.copy_(result)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if seq_lens.numel() else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    if out is None:
        out = torch.empty_like(query)
    torch.ops.lookahead_vllm.tree_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                            query_start_loc, tree_mask, float(scale), max_query_len, max_seq_len, out)
    return out


def compact_kv(
    key_caches: Sequence[torch.Tensor],  # per layer [num_blocks, block_size, H, D]
    value_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,  # [n] int: accepted nodes' slots
    dst_slots: torch.Tensor,  # [n] int: the sequence's next contiguous slots
) -> None:
    """Move the accepted path's K/V into place in every given layer (one launch on CUDA)."""
    if len(key_caches) != len(value_caches):
        raise ValueError(f"compact_kv: {len(key_caches)} key caches but {len(value_caches)} value caches")
    if not key_caches:
        return
    # The slots may come from the CPU: move them next to the caches.
    src, dst = (s.to(device=key_caches[0].device, dtype=torch.int64, non_blocking=True) for s in (src_slots, dst_slots))
    if key_caches[0].is_cuda and kernels_available():  # any strides with a contiguous head_dim (vLLM's HND too)
        torch.ops.lookahead_vllm.compact_kv(key_caches, value_caches, src, dst)
        return
    for key, value in zip(key_caches, value_caches):
        compact_kv_ref(key, value, src, dst)
