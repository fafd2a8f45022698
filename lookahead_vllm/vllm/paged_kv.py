"""Token slots of vLLM's per-layer paged KV caches ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, for tree
verification. CPU_ATTN's block interiors depend on the ISA kernel: probed through vLLM's own
``cpu_attn_reshape_and_cache`` (which does every write), never hard-coded. FlashAttention's are used directly."""

from __future__ import annotations

import functools
from typing import Any

import torch


class CpuPagedKV:
    """Slot access for one CPU_ATTN layer (``impl``: ``CPUAttentionBackendImpl``)."""

    def __init__(self, impl: Any, layer: Any, kv_cache: torch.Tensor) -> None:
        if impl.is_fp8_kv_cache:
            raise NotImplementedError("lookahead tree verification: fp8 KV cache is not supported")
        self.impl, self.layer, self.kv_cache = impl, layer, kv_cache
        num_blocks, self.num_kv_heads, self.block_size, two_d = kv_cache.shape
        self.head_dim = two_d // 2
        # [num_blocks, kv_heads, 2 (K, V), block_size * head_dim]
        self._flat = kv_cache.view(num_blocks, self.num_kv_heads, 2, -1)
        self._k_index, self._v_index = _discover_layout(kv_cache.dtype, self.block_size, self.head_dim, layer.isa)

    def gather_seq(self, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[seq_len, kv_heads, head_dim]`` of a sequence's first tokens."""
        nblk = (seq_len + self.block_size - 1) // self.block_size
        data = self._flat[block_table[:nblk].long()]  # [nblk, H, 2, bs * D]
        shape = (nblk, self.num_kv_heads, self.block_size, self.head_dim)
        return tuple(data[:, :, which, index.flatten()].view(shape).transpose(1, 2).flatten(0, 1)[:seq_len]
                     for which, index in ((0, self._k_index), (1, self._v_index)))

    def gather_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, kv_heads, head_dim]`` at the given slots."""
        slots = slots.long()
        data = self._flat[slots // self.block_size]  # [n, H, 2, bs * D]
        offs = slots % self.block_size
        return tuple(torch.gather(data[:, :, which], 2, index[offs].unsqueeze(1).expand(-1, self.num_kv_heads, -1))
                     for which, index in ((0, self._k_index), (1, self._v_index)))  # [n, H, D] each

    def write_slots(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.impl.do_kv_cache_update(self.layer, key, value, self.kv_cache, slots)


@functools.cache
def _discover_layout(dtype: torch.dtype, block_size: int, head_dim: int, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``k_index, v_index``: ``[block_size, head_dim]`` flat offsets inside a block's K / V region."""
    from vllm import _custom_ops as ops

    tok = torch.arange(block_size).view(-1, 1, 1).expand(block_size, 1, head_dim)
    dim = torch.arange(head_dim).view(1, 1, -1).expand(block_size, 1, head_dim)
    seen = []
    for code in (tok % 64, tok // 64, dim % 64, dim // 64):  # below 64: exact in every supported dtype (bf16 too)
        cache = torch.full((1, 1, 2 * block_size, head_dim), -1.0, dtype=dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        value = code.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(value, value, key_cache, value_cache, torch.arange(block_size), isa)
        seen.append(cache.view(2, -1).float().round().long())  # [2 (K, V), bs * D]
    token_at = seen[0] + 64 * seen[1]
    dim_at = seen[2] + 64 * seen[3]
    indices = []
    for which in (0, 1):
        index = torch.full((block_size, head_dim), -1, dtype=torch.long)
        index[token_at[which], dim_at[which]] = torch.arange(block_size * head_dim)
        if (index < 0).any():
            raise RuntimeError(f"CPU KV layout for {dtype}/{isa} is not a permutation; tree verification unavailable")
        indices.append(index)
    return indices[0], indices[1]


class FlashPagedKV:
    """Slot access for one FlashAttention layer, by (block, offset) on its strided K/V views (no flattening copy)."""

    def __init__(self, impl: Any, layer: Any, kv_cache: torch.Tensor) -> None:
        by_token = kv_cache.transpose(1, 2)  # [nb, bs, H, 2D]
        self.key_cache, self.value_cache = by_token.split(impl.head_size, dim=-1)
        self.block_size = self.key_cache.shape[1]

    def gather_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blk, off = slots.long() // self.block_size, slots.long() % self.block_size
        return self.key_cache[blk, off], self.value_cache[blk, off]

    def write_slots(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        blk, off = slots.long() // self.block_size, slots.long() % self.block_size
        self.key_cache[blk, off] = key
        self.value_cache[blk, off] = value
