"""The CPU verification attention (csrc/cpu_attention) against its float64 reference, on both of its
bodies (AVX-512 where the machine has it, and the portable one), over vLLM's transposed-key layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_vllm import _cpu_attention
from lookahead_vllm.ops import cpu_attention as ca

BODIES = ["portable"] + (["avx512"] if _cpu_attention.isa() == "avx512" else [])


@pytest.fixture(params=BODIES)
def body(request):
    _cpu_attention.set_portable(request.param == "portable")
    assert ca.isa() == ("baseline" if request.param == "portable" else "avx512")
    yield request.param
    _cpu_attention.set_portable(False)


def make_case(rows: list[tuple[int, int]], heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
              block_size: int = 32, seed: int = 0):
    """``rows`` as (query tokens, sequence length); a cache in vLLM's fp32 CPU layout with shuffled blocks
    (and NaN in every slot no row owns, which must never reach an output)."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-seq // block_size) for _, seq in rows]
    num_blocks = sum(per_row) + 3
    kv = torch.full((num_blocks, kv_heads, block_size, 2 * head_dim), float("nan"))
    order = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(rows), max(per_row), dtype=torch.int32)
    key, value = ca.split_cache(kv)
    used = 0
    for r, ((_, seq), n) in enumerate(zip(rows, per_row)):
        table[r, :n] = order[used:used + n].to(torch.int32)
        used += n
        for p in range(seq):
            b, o = int(table[r, p // block_size]), p % block_size
            key[b, :, o] = torch.randn(kv_heads, head_dim, generator=g)
            value[b, :, o] = torch.randn(kv_heads, head_dim, generator=g)
    qsl = torch.tensor([0] + torch.tensor([q for q, _ in rows]).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in rows], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), heads, head_dim, generator=g)
    return query, key, value, qsl, seq_lens, table


def run(query, key, value, qsl, seq_lens, table, scale=0.125):
    out = torch.full_like(query, float("nan"))
    ca.verify_attention(query, key, value, out, qsl, seq_lens, table, scale)
    return out


def test_split_cache_views_keys_transposed_then_values():
    kv = torch.arange(2 * 3 * 32 * 128, dtype=torch.float32).view(2, 3, 32, 128)
    key, value = ca.split_cache(kv)
    # Block 1, KV head 2, position 5, element 7: keys at d * block_size + t, values after them, row-major.
    slab = kv[1, 2].reshape(-1)
    assert key[1, 2, 5, 7] == slab[7 * 32 + 5] and value[1, 2, 5, 7] == slab[32 * 64 + 5 * 64 + 7]


@pytest.mark.parametrize("rows", [
    [(1, 1)],                                   # one token, nothing before it
    [(5, 600)],                                 # a drafted row: spans, tiles, the causal tail
    [(1, 700), (4, 129), (17, 17), (2, 256), (3, 257)],  # a batch: span and block edges, a whole prompt
    [(40, 300)],                                # more query vectors than three 16-lane chunks
    [(0, 50), (3, 3)],                          # a row with no query tokens writes nothing
])
def test_matches_the_reference(body, rows):
    case = make_case(rows)
    out = run(*case)
    ref = ca.paged_causal_attention_ref(*case, 0.125)
    assert torch.isfinite(out[: int(case[3][-1])]).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (9, 3, 64)])
def test_head_shapes(body, heads, kv_heads, head_dim):
    case = make_case([(3, 300), (2, 45)], heads, kv_heads, head_dim, block_size=16)
    torch.testing.assert_close(run(*case).double(), ca.paged_causal_attention_ref(*case, 0.125),
                               atol=2e-6, rtol=2e-5)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 400)), min_size=1, max_size=4), st.integers(0, 2**16))
def test_random_batches(rows, seed):
    rows = [(q, q + extra) for q, extra in rows]  # a row's query tokens are the last of its sequence
    case = make_case(rows, seed=seed)
    for portable in (True, False):
        _cpu_attention.set_portable(portable)
        try:
            torch.testing.assert_close(run(*case).double(), ca.paged_causal_attention_ref(*case, 0.125),
                                       atol=2e-6, rtol=2e-5)
        finally:
            _cpu_attention.set_portable(False)


def test_bad_input_is_refused_with_the_reason():
    query, key, value, qsl, seq_lens, table = make_case([(2, 40)])
    out = torch.empty_like(query)
    with pytest.raises(ValueError, match="float32"):
        ca.verify_attention(query.double(), key, value, out, qsl, seq_lens, table, 0.125)
    with pytest.raises(ValueError, match="seq_lens is torch.int64"):
        ca.verify_attention(query, key, value, out, qsl, seq_lens.long(), table, 0.125)
    with pytest.raises(ValueError, match="qsl ends at 2 but query has 1"):
        ca.verify_attention(query[:1], key, value, out, qsl, seq_lens, table, 0.125)
    with pytest.raises(ValueError, match="2 query tokens but seq_len 1"):
        ca.verify_attention(query, key, value, out, qsl, torch.tensor([1], dtype=torch.int32), table, 0.125)
