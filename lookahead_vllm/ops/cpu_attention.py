"""Verification attention on the CPU: causal attention of short query rows over vLLM's paged KV cache
(fp32), natively (csrc/cpu_attention/verify_attention.cpp) with :func:`paged_causal_attention_ref` as
its reference.

vLLM 0.32's CPU kernel runs a row of several query tokens (a drafted row) far slower than a
one-token row: at 3000 tokens of context, 63.6 against 12.1 ms of attention a step for 5 tokens
against 1 (docs/prices.md, "A drafted row pays for its context"). The native kernel reads each key
and value once for all of a row's query vectors and splits every row's context over the threads.

Layout: ``key_cache``/``value_cache`` are logical ``[num_blocks, num_kv_heads, block_size, head_dim]``
views with any strides (:func:`split_cache` makes them from vLLM's fp32 CPU cache, whose blocks
keep their keys transposed); ``query``/``out`` ``[num_tokens, num_heads, head_dim]``;
row ``r``'s query tokens are ``query[qsl[r]:qsl[r+1]]``, the last of its ``seq_lens[r]`` tokens,
already in the cache; query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import torch

from lookahead_vllm import _cpu_attention

# The head sizes the kernel is instantiated for; keys per tile (a tile never crosses a cache block).
HEAD_DIMS = (64, 128)
TILE = _cpu_attention.TILE


def isa() -> str:
    """The instruction set the native kernel runs with here (``avx512``, ``avx2`` or ``baseline``)."""
    return _cpu_attention.isa()


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether :func:`verify_attention` takes these tensors: fp32 on the CPU, a head size it is built
    for, queries of unit stride along the head dimension, cache blocks of whole tiles."""
    return (query.dtype == key_cache.dtype == value_cache.dtype == torch.float32
            and query.device.type == key_cache.device.type == "cpu" and query.shape[-1] in HEAD_DIMS
            and query.stride(-1) == 1 and key_cache.shape[2] % TILE == 0)


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logical ``[num_blocks, num_kv_heads, block_size, head_dim]`` key and value views of vLLM
    0.32's fp32 CPU cache (``"vec"`` ISA), ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``:
    each (block, KV head) holds its keys transposed (``[head_dim, block_size]``), then its values
    (``[block_size, head_dim]``), as ``cpu_attn_reshape_and_cache`` writes them (tests/vllm checks it)."""
    blocks, kv_heads, block_size, two_d = kv_cache.shape
    slab = kv_cache.view(blocks, kv_heads, 2, block_size * (two_d // 2))
    key = slab[:, :, 0].view(blocks, kv_heads, two_d // 2, block_size).transpose(2, 3)
    return key, slab[:, :, 1].view(blocks, kv_heads, block_size, two_d // 2)


class StepRows:
    """A step's rows for :meth:`attend`, checked once: every attention layer of a step shares them.
    ``qsl [rows + 1]``, ``seq_lens [rows]``, ``block_table [>= rows, max_blocks]``, int32 and contiguous."""

    __slots__ = ("qsl", "seq_lens", "block_table", "rows")

    def __init__(self, qsl: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor) -> None:
        for name, t in (("qsl", qsl), ("seq_lens", seq_lens), ("block_table", block_table)):
            if t.dtype != torch.int32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"verify_attention: {name} is {t.dtype} on {t.device}, contiguous="
                                 f"{t.is_contiguous()}: needs contiguous int32 on the CPU")
        self.rows = seq_lens.shape[0]
        if qsl.shape[0] != self.rows + 1 or block_table.dim() != 2 or block_table.shape[0] < self.rows:
            raise ValueError(f"verify_attention: {self.rows} rows but qsl {tuple(qsl.shape)}, block_table "
                             f"{tuple(block_table.shape)}")
        self.qsl, self.seq_lens, self.block_table = qsl, seq_lens, block_table

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
               scale: float) -> None:
        """Writes ``out[:qsl[-1]]`` (``[tokens, heads, head_dim]``) for tensors :func:`supports` takes."""
        _cpu_attention.attend(
            query.data_ptr(), query.stride(0), query.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
            key_cache.data_ptr(), *key_cache.stride(), value_cache.data_ptr(), *value_cache.stride(),
            self.qsl.data_ptr(), self.seq_lens.data_ptr(), self.block_table.data_ptr(), self.block_table.stride(0),
            self.rows, query.shape[1], key_cache.shape[1], query.shape[2], key_cache.shape[2], float(scale))


def verify_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                     qsl: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float) -> None:
    """Writes ``out[:qsl[-1]]``: every row's causal attention (module docstring), natively, all checked."""
    if not supports(query, key_cache, value_cache) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"verify_attention: query {query.dtype} {tuple(query.shape)}, cache {key_cache.dtype}, "
                         f"out {out.dtype}: needs float32 CPU tensors, head size in {HEAD_DIMS}, queries and out of "
                         f"unit last stride, block size a multiple of {TILE}")
    rows = StepRows(qsl, seq_lens, block_table)
    if int(qsl[-1]) > min(query.shape[0], out.shape[0]):
        raise ValueError(f"verify_attention: qsl ends at {int(qsl[-1])} but query has {query.shape[0]} tokens, "
                         f"out {out.shape[0]}")
    rows.attend(query, key_cache, value_cache, out, scale)


def paged_causal_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               qsl: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """What :func:`verify_attention` writes, in float64 torch: ``[qsl[-1], num_heads, head_dim]``."""
    num_heads, block_size = query.shape[1], key_cache.shape[2]
    group = num_heads // key_cache.shape[1]
    out = torch.zeros(int(qsl[-1]), num_heads, query.shape[2], dtype=torch.float64)
    for r in range(seq_lens.shape[0]):
        q0, q1, n = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        if q1 == q0:
            continue
        pos = torch.arange(n)
        blocks = block_table[r, pos // block_size].long()
        k = key_cache[blocks, :, pos % block_size].double().repeat_interleave(group, dim=1)  # [n, H, D]
        v = value_cache[blocks, :, pos % block_size].double().repeat_interleave(group, dim=1)
        q = query[q0:q1].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        last = n - (q1 - q0) + torch.arange(q1 - q0)  # each query token's own position
        scores = scores.masked_fill(pos[None, None, :] > last[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out
