"""The pure-torch references (tree attention, mask packing, KV compaction) against independent oracles."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from lookahead_vllm.ops import cuda as ops_cuda
from lookahead_vllm.ops.tree_attention import (
    compact_kv_ref,
    pack_tree_mask,
    paged_tree_attention_ref,
    unpack_tree_mask,
)
from tests.ops.cases import ancestor_visibility, dense_oracle, gather_slots, make_case

# Reference and oracle both compute in fp32 from the same stored inputs, so they
# differ by fp32 noise plus at most one rounding step of the output dtype (one ulp).
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},  # fp16 ulp is 2^-10 relative
    torch.bfloat16: {"atol": 8e-3, "rtol": 8e-3},  # bf16 ulp is 2^-7 relative
}
HEADS = {"mha": (4, 4, 64), "gqa8x2": (8, 2, 64), "smollm2": (9, 3, 64), "gqa-d128": (8, 2, 128)}


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("heads", list(HEADS))
def test_reference_matches_dense_oracle(dtype, heads):
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    # decode-only row, a small tree after a long context, a >64-node tree (2 mask words), no context
    case = make_case(tails=[1, 9, 70, 5], contexts=[37, 100, 21, 0], num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16, dtype=dtype, seed=7)
    assert case.tree_mask.shape[1] == 2
    out = paged_tree_attention_ref(*case.args())
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), dense_oracle(case).to(dtype).float(), **TOLERANCES[dtype])


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_reference_block_sizes(block_size):
    case = make_case(tails=[12, 3], contexts=[130, 5], num_heads=8, num_kv_heads=2, head_dim=64,
                     block_size=block_size, seed=block_size)
    torch.testing.assert_close(paged_tree_attention_ref(*case.args()), dense_oracle(case), atol=2e-5, rtol=2e-5)


def test_chain_mask_is_causal_attention():
    case = make_case(tails=[6, 11], contexts=[20, 3], num_heads=8, num_kv_heads=2, head_dim=64, chain=True, seed=3)
    out = paged_tree_attention_ref(*case.args())
    starts = case.query_start_loc.tolist()
    for r, ctx in enumerate(case.contexts):
        for i in range(starts[r + 1] - starts[r]):
            prefix = ctx + i + 1  # causal: every token up to and including this one
            k = gather_slots(case.key_cache, case.block_tables[r], prefix).repeat_interleave(4, dim=1)
            v = gather_slots(case.value_cache, case.block_tables[r], prefix).repeat_interleave(4, dim=1)
            q = case.query[starts[r] + i]  # [H, D]
            w = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * case.scale, dim=-1)
            torch.testing.assert_close(out[starts[r] + i], torch.einsum("hl,lhd->hd", w, v), atol=2e-5, rtol=2e-5)


def test_mask_hides_other_branches():
    """Docstring example: r -> a -> b, r -> c. Changing b's V moves b's row, never a's or c's."""
    case = make_case(tails=[4], contexts=[5], num_heads=2, num_kv_heads=1, head_dim=64, seed=11)
    case.parents = [[-1, 0, 1, 0]]
    case.tree_mask = pack_tree_mask(ancestor_visibility(case.parents[0]))
    before = paged_tree_attention_ref(*case.args())
    table, bs = case.block_tables[0], case.key_cache.shape[1]
    b_pos = 5 + 2
    case.value_cache[int(table[b_pos // bs]), b_pos % bs] += 10.0
    after = paged_tree_attention_ref(*case.args())
    changed = (after - before).abs().amax(dim=(1, 2)) > 1e-3
    assert changed.tolist() == [False, False, True, False]


@pytest.mark.parametrize("q", [1, 7, 63, 64, 65, 130])
def test_pack_unpack_roundtrip_and_bit_layout(q):
    gen = torch.Generator().manual_seed(q)
    visible = torch.rand(5, q, generator=gen) < 0.5
    visible[:, -1] = True  # exercise the last bit (bit 63 makes a word negative)
    packed = pack_tree_mask(visible)
    assert packed.dtype == torch.int64 and packed.shape == (5, (q + 63) // 64)
    assert torch.equal(unpack_tree_mask(packed, q), visible)
    for row in range(5):  # bit j % 64 of word j // 64, as two's-complement int64
        for w in range(packed.shape[1]):
            value = sum(1 << (j - 64 * w) for j in range(64 * w, min(q, 64 * w + 64)) if visible[row, j])
            assert int(packed[row, w]) == (value - (1 << 64) if value >= 1 << 63 else value)


def _compaction_cache(num_layers: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(6, 4, 2, 8, generator=gen) for _ in range(num_layers)]
    values = [torch.randn(6, 4, 2, 8, generator=gen) for _ in range(num_layers)]
    return keys, values


@pytest.mark.parametrize("path", [[0, 1, 2], [0, 2, 5], [0, 1, 3, 4, 7], [0, 6]])
def test_compact_kv_ref_moves_accepted_path(path):
    """Tail of 8 tokens after a 5-token context, in shuffled blocks; overlapping paths included."""
    (key,), (value,) = _compaction_cache(seed=len(path))
    table = [3, 0, 5, 1]  # block_size 4: sequence position p -> slot table[p // 4] * 4 + p % 4
    slot = [table[p // 4] * 4 + p % 4 for p in range(16)]
    ctx = 5
    src = torch.tensor([slot[ctx + j] for j in path])
    dst = torch.tensor([slot[ctx + j] for j in range(len(path))])
    k0, v0 = key.clone(), value.clone()
    compact_kv_ref(key, value, src, dst)
    flat_k, flat_v = key.view(-1, 2, 8), value.view(-1, 2, 8)
    flat_k0, flat_v0 = k0.view(-1, 2, 8), v0.view(-1, 2, 8)
    for j, node in enumerate(path):
        assert torch.equal(flat_k[slot[ctx + j]], flat_k0[slot[ctx + node]])
        assert torch.equal(flat_v[slot[ctx + j]], flat_v0[slot[ctx + node]])
    untouched = [s for s in range(24) if s not in dst.tolist()]
    assert torch.equal(flat_k[untouched], flat_k0[untouched]) and torch.equal(flat_v[untouched], flat_v0[untouched])


def test_compact_kv_ref_reads_before_writes():
    """dst[1] == src[0]-style chains: a naive in-order copy would propagate one value."""
    (key,), (value,) = _compaction_cache(seed=5)
    k0 = key.clone()
    src, dst = torch.tensor([3, 2, 1]), torch.tensor([2, 1, 0])  # shift left by one, reading ahead
    compact_kv_ref(key, value, src, dst)
    flat, flat0 = key.view(-1, 2, 8), k0.view(-1, 2, 8)
    assert torch.equal(flat[[2, 1, 0]], flat0[[3, 2, 1]])


def test_dispatchers_use_reference_on_cpu(monkeypatch):
    def no_kernels():
        raise AssertionError("CPU tensors must not touch the CUDA extension")

    monkeypatch.setattr(ops_cuda, "kernels_available", no_kernels)
    case = make_case(tails=[5, 3], contexts=[9, 17], num_heads=8, num_kv_heads=2, head_dim=64, seed=1)
    expected = paged_tree_attention_ref(*case.args())
    assert torch.equal(ops_cuda.tree_attention(*case.args()), expected)
    out = torch.zeros_like(case.query)
    assert ops_cuda.tree_attention(*case.args(), out=out) is out and torch.equal(out, expected)

    keys, values = _compaction_cache(num_layers=3, seed=2)
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    src, dst = torch.tensor([9, 11, 14], dtype=torch.int32), torch.tensor([9, 10, 11], dtype=torch.int32)
    ops_cuda.compact_kv(keys, values, src, dst)
    for k, v, rk, rv in zip(keys, values, ref_k, ref_v):
        compact_kv_ref(rk, rv, src.long(), dst.long())
        assert torch.equal(k, rk) and torch.equal(v, rv)
    with pytest.raises(ValueError, match="3 key caches but 2 value caches"):
        ops_cuda.compact_kv(keys, values[:2], src, dst)


def test_kernel_loader_falls_back_and_logs(monkeypatch, caplog):
    from lookahead_vllm.ops import _build

    def broken(verbose=False):
        raise RuntimeError("nvcc exploded")

    monkeypatch.setattr(_build, "load_extension", broken)
    monkeypatch.delenv(ops_cuda.DISABLE_ENV, raising=False)
    ops_cuda.kernels_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=ops_cuda.__name__):
            assert ops_cuda.kernels_available() is False
        assert "nvcc exploded" in caplog.text and "torch reference" in caplog.text
        monkeypatch.setenv(ops_cuda.DISABLE_ENV, "1")
        ops_cuda.kernels_available.cache_clear()
        assert ops_cuda.kernels_available() is False
    finally:
        ops_cuda.kernels_available.cache_clear()


def test_sdpa_oracle_is_not_vacuous():
    """The oracle's mask matters: dropping it changes tree rows (guards against a silent all-True mask)."""
    rng = random.Random(0)
    case = make_case(tails=[8], contexts=[4], num_heads=2, num_kv_heads=2, head_dim=64, seed=rng.randrange(99))
    masked = dense_oracle(case)
    k = gather_slots(case.key_cache, case.block_tables[0], 12).transpose(0, 1)
    v = gather_slots(case.value_cache, case.block_tables[0], 12).transpose(0, 1)
    unmasked = F.scaled_dot_product_attention(case.query.transpose(0, 1), k, v, scale=case.scale).transpose(0, 1)
    assert (masked - unmasked).abs().max() > 1e-2
