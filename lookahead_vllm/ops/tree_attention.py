"""Tree attention over a paged KV cache: the pure-torch reference of the ``csrc/`` kernels (same arguments). A request
verifying a draft tree has ``q`` query rows, its *tail*: the root (last committed token) and the ``q - 1`` draft nodes
in flattened DFS order, their K/V already at the sequence's next cache slots. Its cache holds ``seq_len`` tokens: the
*context* (``seq_len - q`` committed tokens), then the tail. Tail row ``i`` attends to the whole context plus the tail
tokens ``j`` set in its mask row (itself and its ancestors, root included). Example: context of 5 tokens, root ``r`` and
nodes ``a`` (parent r), ``b`` (parent a), ``c`` (parent r)::

    tail row   r  a  b  c        visible cache positions
    r          1  .  .  .        0..4, 5
    a          1  1  .  .        0..4, 5, 6
    b          1  1  1  .        0..4, 5, 6, 7
    c          1  .  .  1        0..4, 5, 8      (not a, not b)

``tree_mask`` is int64 ``[num_tokens, num_words]``: bit ``j % 64`` of word ``j // 64`` in row ``t`` says query row
``t`` sees tail token ``j`` of its request. Caches are vLLM's FlashAttention layout ``[num_blocks, block_size,
num_kv_heads, head_dim]``: token ``p`` of request ``r`` lives in block ``block_tables[r, p // block_size]`` at offset
``p % block_size``; query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``. Math in fp32.
"""

from __future__ import annotations

import torch

MASK_WORD_BITS = 64


def pack_tree_mask(visible: torch.Tensor) -> torch.Tensor:
    """``[n, q] bool`` visibility rows -> ``[n, ceil(q / 64)] int64`` bit words."""
    n, q = visible.shape
    words = (q + MASK_WORD_BITS - 1) // MASK_WORD_BITS
    padded = torch.zeros(n, words * MASK_WORD_BITS, dtype=torch.int64)
    padded[:, :q] = visible.to(torch.int64)
    shifts = torch.arange(MASK_WORD_BITS, dtype=torch.int64)
    # Bit 63 makes the word negative; the sum still wraps to the right pattern.
    return (padded.view(n, words, MASK_WORD_BITS) << shifts).sum(dim=-1)


def unpack_tree_mask(tree_mask: torch.Tensor, q: int) -> torch.Tensor:
    """Inverse of :func:`pack_tree_mask`: ``[n, words] int64`` -> ``[n, q] bool``."""
    shifts = torch.arange(MASK_WORD_BITS, dtype=torch.int64, device=tree_mask.device)
    bits = (tree_mask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :q].bool()


def tree_attention_dense(
    query: torch.Tensor,  # [q, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]: context then tail
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    visible: torch.Tensor,  # [q, q] bool: tail row i sees tail token j
    scale: float,
) -> torch.Tensor:  # [q, num_heads, head_dim], query dtype
    """One request's tree attention over dense K/V (fp32 math)."""
    q, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    assert visible.shape == (q, q), f"visible {tuple(visible.shape)} != ({q}, {q})"
    assert seq_len >= q and num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    allowed = torch.ones(q, seq_len, dtype=torch.bool, device=query.device)
    allowed[:, seq_len - q :] = visible
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(query.float().transpose(0, 1), k.transpose(1, 2)) * scale  # [H, q, L]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [H, q, D]
    return out.transpose(0, 1).to(query.dtype)


def gather_paged(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    """A sequence's first ``seq_len`` tokens from a paged cache."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.flatten(0, 1)[:seq_len]


def paged_tree_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32: context + tail
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tree_mask: torch.Tensor,  # [num_tokens, num_words] int64
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Reference paged tree attention for a batch of requests (see module doc)."""
    assert query.dim() == 3 and key_cache.dim() == 4 and key_cache.shape == value_cache.shape
    assert tree_mask.dtype == torch.int64 and tree_mask.shape[0] == query.shape[0]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[r], starts[r + 1]
        if hi == lo:
            continue
        visible = unpack_tree_mask(tree_mask[lo:hi], hi - lo)
        key = gather_paged(key_cache, block_tables[r], seq_len)
        value = gather_paged(value_cache, block_tables[r], seq_len)
        out[lo:hi] = tree_attention_dense(query[lo:hi], key, value, visible, scale)
    return out


def compact_kv_ref(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    src_slots: torch.Tensor,  # [n] int64: accepted nodes' slots
    dst_slots: torch.Tensor,  # [n] int64: the sequence's next contiguous slots
) -> None:
    """Move the accepted path's K/V into place, in place (reference for csrc); all sources are read before any
    write, so overlapping moves (``dst <= src``, as along an accepted path) are safe."""
    assert src_slots.shape == dst_slots.shape
    block_size = key_cache.shape[1]
    src, dst = src_slots.long(), dst_slots.long()
    for cache in (key_cache, value_cache):  # strided views (vLLM's K/V of one tensor) work too
        cache[dst // block_size, dst % block_size] = cache[src // block_size, src % block_size].clone()
