"""CUDA kernels against the pure-torch references (needs a GPU; conftest skips these without CUDA).

Accuracy rule (as in FlashAttention's tests): against the fp32 reference on the
same stored inputs, the kernel's max error is at most 2x that of a plain
PyTorch run in the storage dtype (SDPA with a boolean mask), plus a tiny floor
for fp32 where both errors are rounding noise.
"""

from __future__ import annotations

import pytest
import torch

from lookahead_vllm.ops import cuda as ops_cuda
from lookahead_vllm.ops.tree_attention import compact_kv_ref, paged_tree_attention_ref
from tests.ops.cases import dense_oracle, make_case

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (num_heads, num_kv_heads, head_dim)
HEADS = {"smollm2": (9, 3, 64), "gqa8x2": (8, 2, 64), "llama8b": (32, 8, 128), "mha-d128": (4, 4, 128)}
# (tails, contexts): decode rows, trees of 16/64 nodes, a 2-word mask, a long context (KV split)
BATCHES = {
    "mixed": ([1, 16, 70, 5], [37, 300, 21, 0]),
    "long-ctx": ([64], [3000]),
    "decode-bs8": ([1] * 8, [513, 1, 2048, 64, 100, 7, 1000, 31]),
    "wide": ([16] * 40, list(range(100, 140))),  # many CTAs: no KV split
}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not ops_cuda.kernels_available():
        pytest.fail("CUDA is available but the lookahead_vllm extension failed to build/load (see log)")


def _errors(case, dtype):
    gpu = case.to("cuda", dtype)
    ref32 = paged_tree_attention_ref(*gpu.to("cuda", torch.float32).args())
    kernel = ops_cuda.tree_attention(*gpu.args())
    plain = dense_oracle(gpu, dtype)  # PyTorch in the storage dtype
    torch.cuda.synchronize()
    assert torch.isfinite(kernel.float()).all(), "kernel read a NaN slot (unused cache slots are NaN)"
    return (kernel.float() - ref32).abs().max().item(), (plain.float() - ref32).abs().max().item()


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_attention_kernel_matches_reference(dtype, heads, batch):
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    tails, contexts = BATCHES[batch]
    case = make_case(tails, contexts, num_heads, num_kv_heads, head_dim, block_size=16, dtype=dtype, seed=3)
    kernel_err, torch_err = _errors(case, dtype)
    assert kernel_err <= 2 * torch_err + 1e-5, f"kernel {kernel_err:.3g} vs plain torch {torch_err:.3g}"


@pytest.mark.parametrize("block_size", [1, 32, 128])
def test_tree_attention_kernel_block_sizes(block_size):
    case = make_case([9, 33], [200, 65], 8, 2, 128, block_size=block_size, dtype=torch.bfloat16, seed=block_size)
    kernel_err, torch_err = _errors(case, torch.bfloat16)
    assert kernel_err <= 2 * torch_err + 1e-5


def test_tree_attention_kernel_leaves_rows_outside_requests():
    case = make_case([5, 3], [40, 9], 8, 2, 64, dtype=torch.float16, seed=5).to("cuda")
    pad = torch.randn(4, 8, 64, device="cuda", dtype=torch.float16)  # cuda-graph style padding rows
    case.query = torch.cat([case.query, pad])
    case.tree_mask = torch.cat([case.tree_mask, torch.zeros(4, 1, dtype=torch.int64, device="cuda")])
    out = torch.full_like(case.query, 7.0)
    ops_cuda.tree_attention(*case.args(), out=out)
    assert (out[8:] == 7.0).all()
    torch.testing.assert_close(out[:8], paged_tree_attention_ref(*case.args())[:8], atol=2e-3, rtol=2e-3)


def test_tree_attention_kernel_strided_query():
    """query/out may be views (e.g. q out of a fused qkv): only the last dim must be contiguous."""
    case = make_case([7], [50], 8, 2, 64, dtype=torch.bfloat16, seed=9).to("cuda")
    qkv = torch.randn(7, 8 + 2 * 2, 64, device="cuda", dtype=torch.bfloat16)
    qkv[:, :8] = case.query
    case.query = qkv[:, :8]
    assert not case.query.is_contiguous()
    torch.testing.assert_close(ops_cuda.tree_attention(*case.args()), paged_tree_attention_ref(*case.args()),
                               atol=1.6e-2, rtol=1.6e-2)


def test_tree_attention_kernel_rejects_bad_inputs():
    case = make_case([3], [10], 4, 2, 64, dtype=torch.float16, seed=1).to("cuda")
    bad = make_case([3], [10], 4, 2, 96, dtype=torch.float16, seed=1).to("cuda")
    with pytest.raises(RuntimeError, match="head_dim=96"):
        ops_cuda.tree_attention(*bad.args())
    case.block_tables = case.block_tables.long()
    with pytest.raises(RuntimeError, match="block_tables must be Int"):
        ops_cuda.tree_attention(*case.args())


def test_compact_kv_kernel_rejects_bad_inputs():
    """Messages that format integers raise (a statically linked libstdc++ once crashed here)."""
    k = torch.zeros(4, 16, 2, 64, device="cuda")
    one, two = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="1 key caches but 2 value caches"):
        torch.ops.lookahead_vllm.compact_kv([k], [k.clone(), k.clone()], one, one)
    with pytest.raises(RuntimeError, match="src_slots has 1 entries, dst_slots has 2"):
        torch.ops.lookahead_vllm.compact_kv([k], [k.clone()], one, two)


def _compaction_case(num_layers, dtype, shape=(12, 16, 2, 64)):
    gen = torch.Generator(device="cuda").manual_seed(num_layers)
    keys = [torch.randn(shape, generator=gen, device="cuda").to(dtype) for _ in range(num_layers)]
    values = [torch.randn(shape, generator=gen, device="cuda").to(dtype) for _ in range(num_layers)]
    return keys, values


@pytest.mark.parametrize("num_layers", [1, 3, 70])  # 70 layers: two launches of <= 64
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compact_kv_kernel_matches_reference(num_layers, dtype):
    keys, values = _compaction_case(num_layers, dtype)
    slots = [5 * 16 + p for p in range(16)] + [2 * 16 + p for p in range(16)]  # two shuffled blocks
    ctx, path = 3, [0, 1, 4, 5, 9, 17, 20]  # overlapping: dst j <= src path[j]
    src = torch.tensor([slots[ctx + j] for j in path], device="cuda")
    dst = torch.tensor([slots[ctx + j] for j in range(len(path))], device="cuda")
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    ops_cuda.compact_kv(keys, values, src, dst)
    for k, v, rk, rv in zip(keys, values, ref_k, ref_v):
        compact_kv_ref(rk, rv, src, dst)
        assert torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.parametrize("shape", [(6, 4, 3, 5), (6, 4, 1, 1)])  # 30-byte and 2-byte fp16 rows: narrow units
def test_compact_kv_kernel_odd_rows(shape):
    keys, values = _compaction_case(2, torch.float16, shape)
    src, dst = torch.tensor([7, 9, 10, 13], device="cuda"), torch.tensor([7, 8, 9, 10], device="cuda")
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    ops_cuda.compact_kv(keys, values, src, dst)
    for k, v, rk, rv in zip(keys, values, ref_k, ref_v):
        compact_kv_ref(rk, rv, src, dst)
        assert torch.equal(k, rk) and torch.equal(v, rv)


def test_compact_kv_kernel_many_slots_and_strided_blocks():
    """A [num_blocks, 2, block_size, H, D] cache seen as K/V views: block stride != block_size * row."""
    kv = torch.randn(10, 2, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    key, value = kv[:, 0], kv[:, 1]
    n = 30  # src slots 20, 22, ..., 78 of the 80
    src = torch.arange(20, 20 + 2 * n, 2, device="cuda")
    dst = torch.arange(20, 20 + n, device="cuda")
    expected = kv.clone()  # by hand: compact_kv_ref needs contiguous caches (it flattens with .view)
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[d // 8, :, d % 8] = kv[s // 8, :, s % 8]
    ops_cuda.compact_kv([key], [value], src, dst)
    assert torch.equal(kv, expected)


def test_compact_kv_hnd_cache_layout():
    """vLLM's KV cache on Hopper is HND (heads before slots): a slot's [H, D] row is strided.
    The first H200 run's compaction refused it; compact_kv now moves such caches correctly."""
    physical = torch.randn(2, 10, 2, 8, 64, device="cuda", dtype=torch.bfloat16)  # [2, blocks, H, slots, D]
    kv = physical.permute(0, 1, 3, 2, 4)  # logical [2, blocks, slots, H, D], as vLLM hands it out
    key, value = kv[0], kv[1]
    assert key.stride(2) != key.shape[3]  # rows not contiguous
    src, dst = torch.tensor([21, 23, 30, 41], device="cuda"), torch.tensor([20, 21, 22, 23], device="cuda")
    expected = kv.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[:, d // 8, d % 8] = kv[:, s // 8, s % 8]
    ops_cuda.compact_kv([key], [value], src, dst)
    assert torch.equal(kv, expected)


def test_compact_kv_kernel_on_hnd_caches():
    """vLLM's FLASH_ATTN caches on Hopper are HND (heads before slots): the kernel, not the
    reference fallback, takes them (the first H200 run refused them)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    keys = [torch.randn(12, 2, 16, 64, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
            for _ in range(3)]
    values = [torch.randn(12, 2, 16, 64, generator=gen, device="cuda").to(torch.bfloat16).transpose(1, 2)
              for _ in range(3)]
    src, dst = torch.tensor([37, 38, 41, 50], device="cuda"), torch.tensor([37, 38, 39, 40], device="cuda")
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    torch.ops.lookahead_vllm.compact_kv(keys, values, src, dst)
    for k, v, rk, rv in zip(keys, values, ref_k, ref_v):
        compact_kv_ref(rk, rv, src, dst)
        assert torch.equal(k, rk) and torch.equal(v, rv)
