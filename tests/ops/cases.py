"""Random paged tree-attention batches and an independent dense oracle (shared by CPU and GPU tests).

The oracle deliberately avoids the reference's helpers: it walks block tables
slot by slot, builds visibility from the parent lists (not from the packed
mask), and runs ``torch.nn.functional.scaled_dot_product_attention`` with an
explicit boolean mask.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lookahead_vllm.ops.tree_attention import pack_tree_mask


@dataclass
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]; unused slots NaN
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    tree_mask: torch.Tensor  # [num_tokens, words] int64
    scale: float
    parents: list[list[int]]  # per request, tail node -> parent tail index (-1 for the root)
    contexts: list[int]  # per request, committed tokens before the tail

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.tree_mask, self.scale)

    def to(self, device, dtype: torch.dtype | None = None) -> PagedCase:
        def f(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)

        return PagedCase(f(self.query), f(self.key_cache), f(self.value_cache), self.block_tables.to(device),
                         self.seq_lens.to(device), self.query_start_loc.to(device), self.tree_mask.to(device),
                         self.scale, self.parents, self.contexts)


def random_parents(n: int, rng: random.Random) -> list[int]:
    """A random tree in parent-first order: node 0 is the root, parent(i) < i."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def chain_parents(n: int) -> list[int]:
    return [-1] + list(range(n - 1))


def ancestor_visibility(parents: list[int]) -> torch.Tensor:
    """``[n, n]`` bool: row i sees node i and each of its ancestors."""
    n = len(parents)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return vis


def make_case(tails: list[int], contexts: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0,
              chain: bool = False, spare_blocks: int = 3) -> PagedCase:
    """Requests with ``tails[r]`` tree nodes after ``contexts[r]`` context tokens, blocks shuffled."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + t for c, t in zip(contexts, tails)]
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    order = list(range(num_blocks))
    rng.shuffle(order)
    max_blocks = max(need) + 1
    tables = torch.empty(len(tails), max_blocks, dtype=torch.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(cache_shape, float("nan"))
    value_cache = torch.full(cache_shape, float("nan"))
    it = iter(order)
    for r, (s, nb) in enumerate(zip(seq_lens, need)):
        blocks = [next(it) for _ in range(nb)]
        tables[r, :nb] = torch.tensor(blocks, dtype=torch.int32)
        tables[r, nb:] = rng.randrange(num_blocks)  # padding: any block, never read
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(s)]
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(s, num_kv_heads, head_dim, generator=gen)
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(s, num_kv_heads, head_dim, generator=gen)
    parents = [chain_parents(t) if chain else random_parents(t, rng) for t in tails]
    words = math.ceil(max(tails) / 64)
    masks = []
    for par in parents:
        m = pack_tree_mask(ancestor_visibility(par))
        masks.append(torch.cat([m, torch.zeros(len(par), words - m.shape[1], dtype=torch.int64)], dim=1))
    starts = [0]
    for t in tails:
        starts.append(starts[-1] + t)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    return PagedCase(query.to(dtype), key_cache.to(dtype), value_cache.to(dtype), tables,
                     torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                     torch.cat(masks), head_dim**-0.5, parents, list(contexts))


def gather_slots(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[seq_len, kv_heads, head_dim]``: slot by slot through the block table."""
    bs, blocks = cache.shape[1], table.tolist()
    slots = [blocks[p // bs] * bs + p % bs for p in range(seq_len)]
    return cache.reshape(-1, *cache.shape[2:])[torch.tensor(slots, device=cache.device)]


def dense_oracle(case: PagedCase, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Tree attention via SDPA with an explicit boolean mask, computed in ``dtype``."""
    num_heads = case.query.shape[1]
    kv_head = torch.arange(num_heads, device=case.query.device) // (num_heads // case.key_cache.shape[2])
    out = torch.zeros(case.query.shape, dtype=dtype, device=case.query.device)
    starts = case.query_start_loc.tolist()
    for r, (ctx, par) in enumerate(zip(case.contexts, case.parents)):
        lo, hi, seq_len = starts[r], starts[r + 1], ctx + len(par)
        k = gather_slots(case.key_cache, case.block_tables[r], seq_len).to(dtype)[:, kv_head].transpose(0, 1)
        v = gather_slots(case.value_cache, case.block_tables[r], seq_len).to(dtype)[:, kv_head].transpose(0, 1)
        allowed = torch.ones(hi - lo, seq_len, dtype=torch.bool, device=k.device)
        allowed[:, ctx:] = ancestor_visibility(par).to(k.device)
        q = case.query[lo:hi].to(dtype).transpose(0, 1)  # [H, q, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=case.scale)
        out[lo:hi] = o.transpose(0, 1)
    return out
