"""The real csrc/ kernels and launchers, run on the CPU under tests/ops/emu/cuda_emu.h, against the references.

g++ compiles csrc/tree_attention.cu and csrc/kv_compaction.cu as host C++ with
the emulation header force-included (CTA = host threads, barriers, shuffles
through shared slots), and ctypes calls the same extern "C" launchers the torch
bindings call, on CPU tensors. This checks indexing, masking, online softmax,
the KV-split plan and merge, GQA row mapping and compaction ordering on a
machine without a GPU; it cannot check GPU-specific behaviour (memory model,
occupancy, speed): tests/ops/test_kernels_gpu.py does that where CUDA exists.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from lookahead_vllm.ops.tree_attention import compact_kv_ref, paged_tree_attention_ref
from tests.ops.cases import dense_oracle, make_case

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class TreeAttnParams(ctypes.Structure):  # mirrors LookaheadTreeAttnParams (csrc/lookahead_api.h)
    _fields_ = [
        *[(name, ctypes.c_void_p) for name in ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
                                               "query_start_loc", "tree_mask", "out")],
        *[(name, ctypes.c_int) for name in ("dtype", "num_tokens", "num_heads", "num_kv_heads", "head_dim",
                                            "num_reqs", "max_blocks_per_seq", "block_size", "mask_words",
                                            "max_query_len", "max_seq_len")],
        *[(name, ctypes.c_int64) for name in ("q_stride_token", "q_stride_head", "o_stride_token", "o_stride_head",
                                              "kv_stride_block", "kv_stride_token", "kv_stride_head")],
        ("scale", ctypes.c_float),
    ]


class CompactParams(ctypes.Structure):  # mirrors LookaheadCompactParams
    _fields_ = [
        ("key_caches", ctypes.POINTER(ctypes.c_void_p)), ("value_caches", ctypes.POINTER(ctypes.c_void_p)),
        ("num_layers", ctypes.c_int), ("num_blocks", ctypes.c_int64), ("block_size", ctypes.c_int),
        ("stride_block_bytes", ctypes.c_int64), ("stride_token_bytes", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
        ("src_slots", ctypes.c_void_p), ("dst_slots", ctypes.c_void_p), ("num_slots", ctypes.c_int),
        ("stride_head_bytes", ctypes.c_int64), ("head_bytes", ctypes.c_int64),
    ]


@pytest.fixture(scope="module")
def lib(emu_kernels_path):  # built in the background (tests/ops/conftest.py)
    lib = ctypes.CDLL(str(emu_kernels_path))
    lib.lookahead_tree_attention.argtypes = [ctypes.POINTER(TreeAttnParams), ctypes.c_void_p, ctypes.c_size_t,
                                             ctypes.c_void_p]
    lib.lookahead_tree_attention_workspace.argtypes = [ctypes.POINTER(TreeAttnParams),
                                                       ctypes.POINTER(ctypes.c_size_t)]
    lib.lookahead_compact_kv.argtypes = [ctypes.POINTER(CompactParams), ctypes.c_void_p]
    return lib


def run_tree_attention(lib, case, num_sms: int, major: int = 9) -> tuple[torch.Tensor, int]:
    """Kernel output and the number of kernel launches (2 = split + merge) on an emulated sm_<major>x GPU.

    fp16/bf16 take the tensor-core (WMMA) kernel from sm_80 on and the SIMT kernel before.
    """
    q, kc = case.query, case.key_cache
    out = torch.full_like(q, float("nan"))
    p = TreeAttnParams(
        q.data_ptr(), kc.data_ptr(), case.value_cache.data_ptr(), case.block_tables.data_ptr(),
        case.seq_lens.data_ptr(), case.query_start_loc.data_ptr(), case.tree_mask.data_ptr(), out.data_ptr(),
        DTYPES[q.dtype], q.shape[0], q.shape[1], kc.shape[2], q.shape[2], case.seq_lens.numel(),
        case.block_tables.shape[1], kc.shape[1], case.tree_mask.shape[1], max(len(par) for par in case.parents),
        int(case.seq_lens.max()), q.stride(0), q.stride(1), out.stride(0), out.stride(1), kc.stride(0), kc.stride(1),
        kc.stride(2), case.scale,
    )
    lib.emu_set_num_sms(num_sms)
    lib.emu_set_compute_capability(major)
    size = ctypes.c_size_t(0)
    assert lib.lookahead_tree_attention_workspace(ctypes.byref(p), ctypes.byref(size)) == 0
    workspace = torch.empty(max(size.value, 1), dtype=torch.uint8)
    before = lib.emu_launches()
    rc = lib.lookahead_tree_attention(ctypes.byref(p), workspace.data_ptr() if size.value else None, size.value, None)
    assert rc == 0, f"launcher returned {rc}"
    return out, lib.emu_launches() - before


CASES = {
    # (tails, contexts, heads, head_dim): decode row + tree + 2-word mask; GQA 9/3 (SmolLM2); d128 MHA
    "mixed-gqa3": ([1, 6, 66], [40, 260, 3], (9, 3), 64),
    "long-ctx-d128": ([5], [300], (4, 2), 128),
}


# (case, dtype, emulated SM count, compute capability major): 132 SMs split these grids' KV range (split +
# merge kernels), 1 SM does not; fp16/bf16 run the WMMA kernel on sm_90 and the SIMT kernel on sm_75.
RUNS = [("mixed-gqa3", torch.float32, 132, 9), ("mixed-gqa3", torch.float16, 132, 9),
        ("mixed-gqa3", torch.bfloat16, 132, 9), ("mixed-gqa3", torch.bfloat16, 1, 9),
        ("mixed-gqa3", torch.float16, 132, 7), ("long-ctx-d128", torch.float32, 132, 9),
        ("long-ctx-d128", torch.float16, 1, 9), ("long-ctx-d128", torch.bfloat16, 132, 9),
        ("long-ctx-d128", torch.bfloat16, 1, 7)]


@pytest.mark.parametrize("name,dtype,num_sms,major", RUNS,
                         ids=[f"{n}-{str(d)[6:]}-{s}sm-sm{m}x" for n, d, s, m in RUNS])
def test_emulated_tree_attention_matches_reference(lib, name, dtype, num_sms, major):
    tails, contexts, (heads, kv_heads), head_dim = CASES[name]
    case = make_case(tails, contexts, heads, kv_heads, head_dim, block_size=16, dtype=dtype, seed=len(name))
    out, launches = run_tree_attention(lib, case, num_sms, major)
    assert launches == (2 if num_sms > 1 else 1)  # the split path must really run the merge kernel
    assert torch.isfinite(out.float()).all()
    ref32 = paged_tree_attention_ref(*case.to("cpu", torch.float32).args())
    kernel_err = (out.float() - ref32).abs().max().item()
    torch_err = (dense_oracle(case, dtype).float() - ref32).abs().max().item()
    assert kernel_err <= 2 * torch_err + 1e-5, f"kernel {kernel_err:.3g} vs plain torch {torch_err:.3g}"


@pytest.mark.parametrize("block_size", [12, 1])  # not a power of two (integer division); one slot per block
def test_emulated_wmma_kernel_odd_block_sizes(lib, block_size):
    case = make_case([1, 6, 66], [40, 260, 3], 9, 3, 64, block_size=block_size, dtype=torch.bfloat16, seed=4)
    out, _ = run_tree_attention(lib, case, 132, 9)
    ref32 = paged_tree_attention_ref(*case.to("cpu", torch.float32).args())
    torch_err = (dense_oracle(case, torch.bfloat16).float() - ref32).abs().max().item()
    assert (out.float() - ref32).abs().max().item() <= 2 * torch_err + 1e-5


def test_emulated_tree_attention_rejects_head_dim(lib):
    p = TreeAttnParams(dtype=0, num_tokens=2, num_heads=2, num_kv_heads=1, head_dim=96, num_reqs=1,
                       max_blocks_per_seq=2, block_size=16, mask_words=1, max_query_len=2, max_seq_len=7)
    assert lib.lookahead_tree_attention(ctypes.byref(p), None, 0, None) == 2  # LOOKAHEAD_ERR_HEAD_DIM
    p.head_dim, p.num_kv_heads = 64, 3  # 3 does not divide 2 query heads
    assert lib.lookahead_tree_attention(ctypes.byref(p), None, 0, None) == 3  # LOOKAHEAD_ERR_HEADS


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (8, 4, 2, 64)), (torch.float16, (8, 4, 3, 5)),
                                         (torch.float32, (8, 4, 1, 8))], ids=["16B-units", "2B-units", "fp32"])
def test_emulated_compaction_matches_reference(lib, dtype, shape):
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]
    values = [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]
    src = torch.tensor([9, 10, 13, 14, 19, 27])  # an accepted path: dst <= src, overlapping
    dst = torch.tensor([9, 10, 11, 12, 13, 14])
    k_ptrs = (ctypes.c_void_p * 3)(*(k.data_ptr() for k in keys))
    v_ptrs = (ctypes.c_void_p * 3)(*(v.data_ptr() for v in values))
    es = keys[0].element_size()
    p = CompactParams(k_ptrs, v_ptrs, 3, shape[0], shape[1], keys[0].stride(0) * es, keys[0].stride(1) * es,
                      shape[2] * shape[3] * es, src.data_ptr(), dst.data_ptr(), src.numel())
    assert lib.lookahead_compact_kv(ctypes.byref(p), None) == 0
    for k, v, rk, rv in zip(keys, values, ref_k, ref_v):
        compact_kv_ref(rk, rv, src, dst)
        assert torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 5)], ids=["16B-units", "2B-units"])
def test_emulated_compaction_of_hnd_caches(lib, dtype, head_dim):
    """vLLM's FLASH_ATTN cache on Hopper is HND: [num_blocks, heads, block_size, head_dim] in memory,
    viewed as [num_blocks, block_size, heads, head_dim], so a slot's heads are block_size * head_dim
    apart. The kernel copies head by head at that stride; against the reference on the same view."""
    gen = torch.Generator().manual_seed(1)
    nb, bs, heads = 8, 4, 3

    def hnd():
        return torch.randn(nb, heads, bs, head_dim, generator=gen).to(dtype).transpose(1, 2)

    keys, values = [hnd() for _ in range(2)], [hnd() for _ in range(2)]
    assert keys[0].stride(2) == bs * head_dim  # heads strided, not a contiguous row
    ref_k, ref_v = [k.clone() for k in keys], [v.clone() for v in values]  # clone keeps the strides
    src = torch.tensor([9, 10, 13, 14, 19, 27])  # an accepted path: dst <= src, overlapping
    dst = torch.tensor([9, 10, 11, 12, 13, 14])
    k_ptrs = (ctypes.c_void_p * 2)(*(k.data_ptr() for k in keys))
    v_ptrs = (ctypes.c_void_p * 2)(*(v.data_ptr() for v in values))
    es = keys[0].element_size()
    p = CompactParams(k_ptrs, v_ptrs, 2, nb, bs, keys[0].stride(0) * es, keys[0].stride(1) * es,
                      heads * head_dim * es, src.data_ptr(), dst.data_ptr(), src.numel(),
                      keys[0].stride(2) * es, head_dim * es)
    assert lib.lookahead_compact_kv(ctypes.byref(p), None) == 0
    for k, v, rk, rv in zip(keys, values, ref_k, ref_v):
        compact_kv_ref(rk, rv, src, dst)
        assert torch.equal(k, rk) and torch.equal(v, rv)
        assert not torch.equal(k, torch.zeros_like(k))
    p.head_bytes = 7 * es  # does not divide the row
    assert lib.lookahead_compact_kv(ctypes.byref(p), None) != 0
