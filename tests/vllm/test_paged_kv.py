"""Slot access to vLLM's per-layer paged KV caches (CPU_ATTN and FLASH_ATTN layouts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lookahead_vllm.ops.tree_attention import gather_paged
from lookahead_vllm.vllm.paged_kv import CpuPagedKV, FlashPagedKV

NB, H, BS, D = 6, 3, 128, 64


class _CpuImpl:
    """The two attributes CpuPagedKV uses, writing through vLLM's own op."""

    is_fp8_kv_cache = False

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        from vllm import _custom_ops as ops

        key_cache, value_cache = kv_cache.view(NB, H, 2 * BS, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, layer.isa)


def _tree_impl() -> _CpuImpl:
    """A CPU attention impl with none of the features tree verification refuses."""
    impl = _CpuImpl()
    impl.sliding_window, impl.alibi_slopes, impl.logits_soft_cap, impl.sinks = -1, None, 0, None
    return impl


def _sequence(length: int, table: list[int], dtype):
    gen = torch.Generator().manual_seed(length)
    slots = torch.tensor([table[i // BS] * BS + i % BS for i in range(length)])
    return slots, torch.randn(length, H, D, generator=gen).to(dtype), torch.randn(length, H, D, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_layout_roundtrip_through_vllm_op(dtype):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache = CpuPagedKV(_CpuImpl(), SimpleNamespace(isa=_get_attn_isa(dtype, BS, D)),
                       torch.zeros(NB, H, BS, 2 * D, dtype=dtype))
    table = [4, 1, 3]
    slots, key, value = _sequence(300, table, dtype)
    cache.write_slots(slots, key, value)
    k, v = cache.gather_seq(torch.tensor(table, dtype=torch.int32), 300)
    assert torch.equal(k, key) and torch.equal(v, value)
    pick = torch.tensor([0, 129, 299])
    k, v = cache.gather_slots(slots[pick])
    assert torch.equal(k, key[pick]) and torch.equal(v, value[pick])
    # Compaction-style move: read all sources, then write.
    src, dst = slots[[5, 7]], slots[[3, 4]]
    cache.write_slots(dst, *cache.gather_slots(src))
    k, _ = cache.gather_seq(torch.tensor(table, dtype=torch.int32), 300)
    assert torch.equal(k[3], key[5]) and torch.equal(k[4], key[7]) and torch.equal(k[6], key[6])


def test_flash_layout_matches_flash_attention_view():
    kv_cache = torch.zeros(NB, H, BS, 2 * D)
    cache = FlashPagedKV(SimpleNamespace(head_size=D), None, kv_cache)
    table = [2, 5]
    slots, key, value = _sequence(200, table, torch.float32)
    cache.write_slots(slots, key, value)
    # Where vLLM 0.32's FLASH_ATTN reads them: (B, H, N, 2D) -> (B, N, H, D) x 2.
    fa_k, fa_v = kv_cache.transpose(1, 2).split(D, dim=-1)
    assert torch.equal(fa_k[5, 3], key[128 + 3]) and torch.equal(fa_v[2, 7], value[7])
    k, v = (gather_paged(c, torch.tensor(table, dtype=torch.int32), 200) for c in (cache.key_cache, cache.value_cache))
    assert torch.equal(k, key) and torch.equal(v, value)


def test_tree_steps_reuse_each_layers_accessor_until_its_cache_changes():
    """Tree verification builds a layer's accessor once per engine (kept on the
    layer), not once per step; a new cache tensor on the layer gets a new one."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from lookahead_vllm.vllm import tree_verify

    impl = _tree_impl()
    layer = SimpleNamespace(isa=_get_attn_isa(torch.float32, BS, D))
    kv = torch.zeros(NB, H, BS, 2 * D)
    steps = [SimpleNamespace(caches={}) for _ in range(3)]  # all _cache_accessor reads of a TreeStep
    got = [tree_verify._cache_accessor(step, impl, layer, kv) for step in steps]
    assert isinstance(got[0], CpuPagedKV) and got[0].kv_cache is kv
    assert got[1] is got[0] and got[2] is got[0]
    assert all(step.caches == {kv.data_ptr(): got[0]} for step in steps)  # each step lists it for compaction
    kv2 = torch.zeros(NB, H, BS, 2 * D)
    fresh = tree_verify._cache_accessor(SimpleNamespace(caches={}), impl, layer, kv2)
    assert fresh is not got[0] and fresh.kv_cache is kv2
    impl.sliding_window = 64  # unsupported features are refused when the accessor is built
    with pytest.raises(NotImplementedError, match="sliding window"):
        tree_verify._cache_accessor(SimpleNamespace(caches={}), impl, layer, torch.zeros(NB, H, BS, 2 * D))


def one_tree_step(plan, start: int):
    """A step verifying one greedy tree (``plan``) at batch row 0, its root at token ``start``
    (another request's rows before it)."""
    import numpy as np

    from lookahead_lab.reference.trees import batch_of_plans
    from lookahead_vllm.vllm import tree_verify

    return tree_verify.TreeStep(["a"], np.array([0]), np.array([start]), batch_of_plans([plan]),
                                np.array([plan.chain_prefix_length()]), np.array([True]), [None],
                                start + plan.num_nodes + 1, frozenset())


def test_gpu_tree_rows_keep_the_stock_kernels_leading_chain():
    """The GPU path (here through the kernel's torch reference) writes back only the rows off each
    tree's leading chain: root and chain rows keep the stock kernel's output, bit for bit."""
    from lookahead_lab.reference.trees import DraftTree, StepPlan
    from lookahead_vllm.ops.tree_attention import pack_tree_mask, paged_tree_attention_ref
    from lookahead_vllm.vllm import tree_verify

    plan = StepPlan(DraftTree(tokens=(1, 2, 3, 4, 5, 6), parents=(-1, 0, 1, 1, 0, 4), weights=(6, 5, 4, 3, 2, 1)))
    assert plan.chain_prefix_length() == 3  # rows 0..3 causal, rows 4..6 off the chain
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(NB, H, BS, 2 * D, generator=gen)
    cache = FlashPagedKV(SimpleNamespace(head_size=D), None, kv_cache)
    start, context = 2, 40  # two rows of another request come first in the step
    table, seq_len = torch.tensor([[3, 1]], dtype=torch.int32), context + plan.num_nodes + 1
    step = one_tree_step(plan, start)
    num_rows = plan.num_nodes + 1
    query = torch.randn(start + num_rows, H, D, generator=gen)
    out = torch.full_like(query, 7.0)  # what the stock kernel wrote
    metadata = SimpleNamespace(block_table=table, seq_lens=torch.tensor([seq_len], dtype=torch.int32),
                               max_seq_len=seq_len)
    tree_verify._paged_kernel(step, SimpleNamespace(scale=D**-0.5), query, cache, metadata, out)
    rows = slice(start, start + num_rows)
    expected = paged_tree_attention_ref(query[rows], cache.key_cache, cache.value_cache, table,
                                        metadata.seq_lens, torch.tensor([0, num_rows], dtype=torch.int32),
                                        pack_tree_mask(torch.from_numpy(plan.visibility())), D**-0.5)
    assert torch.equal(out[: start + 4], torch.full_like(out[: start + 4], 7.0))  # other request, root, chain
    assert torch.allclose(out[start + 4:], expected[4:]) and not torch.equal(out[start + 4:], out[:3])


class _FlashRefImpl:
    """vLLM 0.32 FLASH_ATTN's contract in torch (a CPU stand-in for the GPU backend): ``forward``
    is causal paged attention of each request's query tail over its first ``seq_len`` cache
    slots; ``do_kv_cache_update`` writes K/V at slots. Shapes and metadata fields as vLLM's."""

    num_heads, head_size, scale = H, D, D**-0.5

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        FlashPagedKV(self, layer, kv_cache).write_slots(slots, key, value)

    def forward(self, layer, query, key, value, kv_cache, meta, output):
        cache = FlashPagedKV(self, layer, kv_cache)
        qsl = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens.tolist()):
            k, v = (gather_paged(c, meta.block_table[i], seq_len) for c in (cache.key_cache, cache.value_cache))
            q = query[qsl[i]: qsl[i + 1]]
            n = len(q)
            scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
            causal = torch.arange(seq_len)[None, :] <= (seq_len - n + torch.arange(n))[:, None]
            scores = scores.masked_fill(~causal, float("-inf"))
            output[qsl[i]: qsl[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return output


def test_gpu_path_rounds_through_flash_attention_are_tree_attention():
    """On GPU the tree rows off the leading chain come from FlashAttention itself, one
    root-to-leaf path per round (what keeps greedy outputs plain's in bf16): here through the
    backend's contract in torch. Off-chain rows equal tree attention, root and chain rows keep
    the stock kernel's output, and every slot a round borrowed holds its own row's K/V after."""
    from dataclasses import dataclass

    from lookahead_lab.reference.trees import DraftTree, StepPlan
    from lookahead_vllm.ops.tree_attention import pack_tree_mask, paged_tree_attention_ref
    from lookahead_vllm.vllm import tree_verify

    @dataclass
    class Meta:  # the FlashAttentionMetadata fields the rounds replace (dataclasses.replace needs a dataclass)
        num_actual_tokens: int
        max_query_len: int
        query_start_loc: torch.Tensor
        max_seq_len: int
        seq_lens: torch.Tensor
        block_table: torch.Tensor
        slot_mapping: torch.Tensor
        scheduler_metadata: object = None
        causal: bool = True

    # Two branches off the chain: rows 4..6 need two rounds (paths 0-4-6... and 0-1-3).
    plan = StepPlan(DraftTree(tokens=(1, 2, 3, 4, 5, 6), parents=(-1, 0, 1, 1, 0, 4), weights=(6, 5, 4, 3, 2, 1)))
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(NB, H, BS, 2 * D, generator=gen)
    impl, cache = _FlashRefImpl(), FlashPagedKV(SimpleNamespace(head_size=D), None, kv_cache)
    start, context = 2, 130  # another request's two rows first; the tree crosses a block boundary
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    n = 1 + plan.num_nodes
    seq_len = context + n
    tree_slots = torch.tensor([int(table[0, p // BS]) * BS + p % BS for p in range(context, seq_len)])
    slot_mapping = torch.cat([torch.tensor([0, 1]), tree_slots])  # block 0: the other request
    key, value, query = (torch.randn(start + n, H, D, generator=gen) for _ in range(3))
    impl.do_kv_cache_update(None, key, value, kv_cache, slot_mapping)  # the stock step wrote every row
    before = kv_cache.clone()
    step = one_tree_step(plan, start)
    step.slot_mapping = slot_mapping
    meta = Meta(start + n, n, torch.tensor([0, start, start + n], dtype=torch.int32), seq_len,
                torch.tensor([seq_len], dtype=torch.int32), table, slot_mapping)
    out = torch.full_like(query, 7.0)  # what the stock kernel wrote
    tree_verify._flash_path_rounds(step, impl, None, query, key, value, kv_cache, meta, out)
    assert len(step.path_plan.rounds) == 2
    rows = slice(start, start + n)
    expected = paged_tree_attention_ref(query[rows], cache.key_cache, cache.value_cache, table,
                                        meta.seq_lens, torch.tensor([0, n], dtype=torch.int32),
                                        pack_tree_mask(torch.from_numpy(plan.visibility())), D**-0.5)
    assert torch.equal(out[: start + 4], torch.full_like(out[: start + 4], 7.0))  # other request, root, chain
    assert torch.allclose(out[start + 4:], expected[4:], atol=1e-5)
    assert torch.equal(kv_cache, before)  # borrowed slots restored


def test_gpu_kernel_path_reads_every_tree_of_a_step():
    """The kernel path's arguments for several trees of different sizes and leading chains, in one
    call: each tree's off-chain rows equal tree attention over its own blocks and context, every
    root, chain row and other request's row keeps the stock kernel's output."""
    import numpy as np

    from lookahead_lab.reference.trees import DraftTree, StepPlan, batch_of_plans
    from lookahead_vllm.ops.tree_attention import pack_tree_mask, paged_tree_attention_ref
    from lookahead_vllm.vllm import tree_verify

    plans = [StepPlan(DraftTree((1, 2, 3, 4, 5, 6), (-1, 0, 1, 1, 0, 4), (1.0,) * 6)),  # chain of 3
             StepPlan(DraftTree((7, 8, 9), (-1, -1, 1), (1.0,) * 3)),  # chain of 1
             StepPlan(DraftTree((1, 2, 3, 4), (-1, 0, 1, 0), (1.0,) * 4))]  # chain of 3
    gen = torch.Generator().manual_seed(2)
    kv_cache = torch.randn(NB, H, BS, 2 * D, generator=gen)
    cache = FlashPagedKV(SimpleNamespace(head_size=D), None, kv_cache)
    rows, starts = np.array([1, 3, 4]), np.array([2, 9, 14])  # other requests' rows between the trees
    contexts = [40, 7, 100]
    table = torch.tensor([[0, 0], [3, 1], [0, 0], [2, 0], [1, 3]], dtype=torch.int32)
    seq_lens = torch.zeros(5, dtype=torch.int32)
    for plan, row, context in zip(plans, rows, contexts):
        seq_lens[row] = context + plan.num_nodes + 1
    step = tree_verify.TreeStep(["a", "b", "c"], rows, starts, batch_of_plans(plans),
                                np.array([p.chain_prefix_length() for p in plans]), np.ones(3, bool), [None] * 3, 19,
                                frozenset())
    query = torch.randn(19, H, D, generator=gen)
    out = torch.full_like(query, 7.0)  # what the stock kernel wrote
    metadata = SimpleNamespace(block_table=table, seq_lens=seq_lens, max_seq_len=int(seq_lens.max()))
    tree_verify._paged_kernel(step, SimpleNamespace(scale=D**-0.5), query, cache, metadata, out)
    written = torch.zeros(19, dtype=torch.bool)
    for plan, row, start in zip(plans, rows.tolist(), starts.tolist()):
        n = plan.num_nodes + 1
        expected = paged_tree_attention_ref(query[start:start + n], cache.key_cache, cache.value_cache,
                                            table[row:row + 1], seq_lens[row:row + 1],
                                            torch.tensor([0, n], dtype=torch.int32),
                                            pack_tree_mask(torch.from_numpy(plan.visibility())), D**-0.5)
        off = 1 + plan.chain_prefix_length()
        assert torch.allclose(out[start + off:start + n], expected[off:], atol=1e-5)
        written[start + off:start + n] = True
    assert torch.equal(out[~written], torch.full_like(out[~written], 7.0))
    assert written.sum() == 3 + 2 + 1


def test_dense_reference_attention_reads_every_tree_of_a_step(monkeypatch):
    """The dense reference attention (``LOOKAHEAD_TREE_ATTENTION=reference``) over two trees of a
    step, one with a Jacobi window: each tree's rows equal tree attention with its plan's
    visibility over its own context; the other requests' rows keep the stock kernel's output."""
    import numpy as np
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from lookahead_lab.reference.trees import DraftTree, StepPlan, batch_of_plans
    from lookahead_vllm.ops.tree_attention import tree_attention_dense
    from lookahead_vllm.vllm import tree_verify

    monkeypatch.setattr(tree_verify, "TREE_ATTENTION", "reference")
    plans = [StepPlan(DraftTree((1, 2, 3, 4, 5, 6), (-1, 0, 1, 1, 0, 4), (1.0,) * 6)),
             StepPlan(DraftTree((7, 8, 9), (-1, -1, 1), (1.0,) * 3), (False, True, True))]
    impl = _tree_impl()
    impl.num_heads, impl.head_size, impl.scale = H, D, D**-0.5
    layer = SimpleNamespace(isa=_get_attn_isa(torch.float32, BS, D))
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(NB, H, BS, 2 * D, generator=gen)
    rows, starts, num_tokens = np.array([1, 2]), np.array([1, 9]), 13  # another request's row first
    table = torch.tensor([[0, 0], [3, 1], [2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([5, 140 + 7, 9 + 4], dtype=torch.int32)
    step = tree_verify.TreeStep(["a", "b"], rows, starts, batch_of_plans(plans),
                                np.array([p.chain_prefix_length() for p in plans]), np.ones(2, bool), [None] * 2,
                                num_tokens, frozenset())
    verifier = tree_verify.TreeVerifier()
    verifier.current = step
    query = torch.randn(num_tokens, H, D, generator=gen)
    output = torch.full((num_tokens, H * D), 7.0)  # what the stock kernel wrote
    metadata = SimpleNamespace(num_actual_tokens=num_tokens, slot_mapping=torch.arange(num_tokens),
                               seq_lens=seq_lens, block_table=table)
    verifier.fix_tree_rows(impl, layer, query, None, None, kv_cache, metadata, output)
    out = output.view(num_tokens, H, D)
    cache = CpuPagedKV(impl, layer, kv_cache)
    for plan, row, start in zip(plans, rows.tolist(), starts.tolist()):
        n = plan.num_nodes + 1
        k, v = cache.gather_seq(table[row], int(seq_lens[row]))
        visible = torch.from_numpy(plan.visibility())
        expected = tree_attention_dense(query[start:start + n], k, v, visible, D**-0.5)
        assert torch.allclose(out[start:start + n], expected)
    others = out[[0, 8]]  # the rows before and between the trees
    assert torch.equal(others, torch.full_like(others, 7.0))
