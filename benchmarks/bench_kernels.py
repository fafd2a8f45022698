"""Tree-attention kernel vs FlashAttention decode, one GPU, bf16.

Question: what does verifying a draft tree of n nodes cost in attention, next
to the chain-verification kernel vLLM would otherwise run? For each head
config, tree size (1/16/64 nodes: 1 = plain decode) and context length
(512/2048/8192 tokens), both kernels read the same paged KV cache:

* ``tree``: ``lookahead_vllm.ops.cuda.tree_attention`` (csrc/), random tree
  masks, block size 16, shuffled blocks.
* baseline: vLLM's own FlashAttention (``vllm.vllm_flash_attn.flash_attn_varlen_func``,
  FA3 on Hopper) on the same paged cache, ``causal=True`` (n rows = a chain of
  n drafts), where vLLM is installed; else ``flash_attn.flash_attn_with_kvcache``
  with a paged cache (block size 256, which it requires) and ``causal=True``
  if flash-attn is importable; else torch SDPA forced onto its flash
  backend with dense K/V (GQA through ``enable_gqa`` where that backend takes
  it, else KV heads repeated; no mask: same work).

Timings are device time: ``--graph-calls`` calls captured in one CUDA graph
(as vLLM runs decode steps), replayed ``--iters`` times, CUDA-event median per
call; ``*_eager_us`` are medians of single eager calls, host overhead included.
``max_err`` is the kernel's max abs error against the fp32 torch reference.
Writes JSON + a PNG (``--out``, ``--plot``). GPU only: exits with status 2
and a message when CUDA is unavailable.

    python benchmarks/bench_kernels.py                       # full grid, batch 1
    python benchmarks/bench_kernels.py --batch 8 --nodes 16  # a slice
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# name -> (num_heads, num_kv_heads, head_dim)
HEAD_CONFIGS = {"smollm2-135m": (9, 3, 64), "llama-8b": (32, 8, 128)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(HEAD_CONFIGS), choices=list(HEAD_CONFIGS))
    parser.add_argument("--nodes", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--batch", type=int, default=1, help="requests per launch (each with the same shape)")
    parser.add_argument("--block-size", type=int, default=16, help="tree kernel's KV block size")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--graph-calls", type=int, default=20, help="calls captured per CUDA graph")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels_gpu.json")
    parser.add_argument("--plot", type=Path, default=RESULTS / "kernels_gpu.png")
    return parser.parse_args(argv)


def _median_event_us(run, iters: int, per_run: int) -> float:
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_run)
    return statistics.median(times)


def time_us(fn, iters: int, warmup: int, graph_calls: int) -> tuple[float, float]:
    """(device time per call from CUDA-graph replays, eager time per call), microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    eager = _median_event_us(fn, iters, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            fn()
    graph.replay()
    return _median_event_us(graph.replay, iters, graph_calls), eager


def random_tree_mask(nodes: int, rng: random.Random) -> torch.Tensor:
    """``[nodes, words]`` int64 ancestor mask of a random parent-first tree."""
    from lookahead_vllm.ops.tree_attention import pack_tree_mask

    parents = [-1] + [rng.randrange(i) for i in range(1, nodes)]
    visible = torch.zeros(nodes, nodes, dtype=torch.bool)
    for i in range(nodes):
        j = i
        while j >= 0:
            visible[i, j], j = True, parents[j]
    return pack_tree_mask(visible)


def paged_inputs(batch, nodes, context, heads, block_size, rng, gen):
    """A batch of identical-shape requests in a shuffled paged bf16 cache (on the GPU)."""
    num_heads, num_kv_heads, head_dim = heads
    seq_len = context + nodes
    per_seq = math.ceil(seq_len / block_size)
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    dev, bf16 = "cuda", torch.bfloat16
    return {
        "query": torch.randn(batch * nodes, num_heads, head_dim, device=dev, dtype=bf16),
        "key_cache": torch.randn(shape, device=dev, dtype=bf16),
        "value_cache": torch.randn(shape, device=dev, dtype=bf16),
        "block_tables": order.view(batch, per_seq).to(dev),
        "seq_lens": torch.full((batch,), seq_len, dtype=torch.int32, device=dev),
        "query_start_loc": torch.arange(0, (batch + 1) * nodes, nodes, dtype=torch.int32, device=dev),
        "tree_mask": torch.cat([random_tree_mask(nodes, rng) for _ in range(batch)]).to(dev),
        "scale": head_dim**-0.5,
    }


def vllm_flash_fn(inputs, nodes):
    """vLLM's own FlashAttention (``vllm.vllm_flash_attn``, FA3 on Hopper) as its FLASH_ATTN backend
    calls it: varlen, causal, over the very paged cache the tree kernel reads (n rows = a chain
    of n). (name, zero-arg callable), or None where vLLM's FlashAttention does not import."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    except ImportError:
        from vllm.attention.utils.fa_utils import get_flash_attn_version
    version = get_flash_attn_version() or 3
    seq_len = int(inputs["seq_lens"][0])
    out = torch.empty_like(inputs["query"])

    def run():
        return flash_attn_varlen_func(
            q=inputs["query"], k=inputs["key_cache"], v=inputs["value_cache"], out=out,
            cu_seqlens_q=inputs["query_start_loc"], max_seqlen_q=nodes, seqused_k=inputs["seq_lens"],
            max_seqlen_k=seq_len, softmax_scale=inputs["scale"], causal=True,
            block_table=inputs["block_tables"], fa_version=version)

    return f"vllm_flash_attn FA{version} (varlen, paged, causal)", run


def baseline_fn(inputs, batch, nodes, heads):
    """FlashAttention over the same K/V: (name, zero-arg callable). vLLM's own where it imports,
    else flash-attn's decode, else torch SDPA's flash backend."""
    vllm_fa = vllm_flash_fn(inputs, nodes)
    if vllm_fa is not None:
        return vllm_fa
    num_heads, num_kv_heads, head_dim = heads
    seq_len = int(inputs["seq_lens"][0])
    q = inputs["query"].view(batch, nodes, num_heads, head_dim)
    try:
        import flash_attn
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn = None
    if flash_attn is not None:
        bs = 256  # flash-attn's paged KV needs a multiple of 256
        per_seq = math.ceil(seq_len / bs)
        shape = (batch * per_seq, bs, num_kv_heads, head_dim)
        k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(batch * per_seq, device="cuda").to(torch.int32).view(batch, per_seq)
        lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
        return f"flash_attn {flash_attn.__version__} (paged, causal)", lambda: flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lens, block_table=table, causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt = q.transpose(1, 2).contiguous()
    # Dense K/V with the KV heads only (GQA in the kernel) where the flash backend takes enable_gqa;
    # else the KV heads repeated up to num_heads, materialised (more bytes read: a slower baseline).
    k = torch.randn(batch, num_kv_heads, seq_len, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa(qt, k, v, enable_gqa=True)
        name, kwargs = "torch sdpa flash backend (dense, enable_gqa)", {"enable_gqa": True}
    except (RuntimeError, TypeError):
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        name, kwargs = "torch sdpa flash backend (dense, repeated KV heads)", {}

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(qt, k, v, **kwargs)

    return name, run


def measure(args, name, heads, nodes, context, rng, gen) -> dict:
    from lookahead_vllm.ops import cuda as ops_cuda
    from lookahead_vllm.ops.tree_attention import paged_tree_attention_ref

    inputs = paged_inputs(args.batch, nodes, context, heads, args.block_size, rng, gen)
    out = torch.empty_like(inputs["query"])
    seq_len = context + nodes

    def tree():
        ops_cuda.tree_attention(**inputs, max_query_len=nodes, max_seq_len=seq_len, out=out)

    tree()
    fp32 = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    max_err = (out.float() - paged_tree_attention_ref(**fp32).float()).abs().max().item()
    tree_us, tree_eager = time_us(tree, args.iters, args.warmup, args.graph_calls)
    base_name, base = baseline_fn(inputs, args.batch, nodes, heads)
    base_us, base_eager = time_us(base, args.iters, args.warmup, args.graph_calls)
    kv_bytes = 2 * args.batch * seq_len * heads[1] * heads[2] * 2
    row = {
        "config": name, "nodes": nodes, "context": context, "batch": args.batch,
        "tree_us": round(tree_us, 2), "baseline_us": round(base_us, 2),
        "tree_eager_us": round(tree_eager, 2), "baseline_eager_us": round(base_eager, 2),
        "tree_over_baseline": round(tree_us / base_us, 3), "tree_kv_gbps": round(kv_bytes / tree_us / 1e3, 1),
        "max_err": max_err, "baseline": base_name,
    }
    print(f"{name:14s} nodes {nodes:3d} ctx {context:5d}: tree {tree_us:8.1f} us  baseline {base_us:8.1f} us"
          f"  ratio {tree_us / base_us:5.2f}  {row['tree_kv_gbps']:7.1f} GB/s  err {max_err:.2e}"
          f"  (eager: tree {tree_eager:6.1f} us, baseline {base_eager:6.1f} us)")
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.5), squeeze=False)
    for ax, config in zip(axes[0], configs):
        for i, nodes in enumerate(sorted({r["nodes"] for r in rows})):
            sel = sorted((r for r in rows if r["config"] == config and r["nodes"] == nodes), key=lambda r: r["context"])
            ctx = [r["context"] for r in sel]
            color = f"C{i}"
            ax.plot(ctx, [r["tree_us"] for r in sel], "o-", color=color, label=f"tree kernel, {nodes} nodes")
            ax.plot(ctx, [r["baseline_us"] for r in sel], "s--", color=color, label=f"FlashAttention, {nodes} rows")
        ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="time per launch (us)", title=config)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Tree attention vs FlashAttention decode (bf16, batch {rows[0]['batch']}, device time in CUDA graphs)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.",
              file=sys.stderr)
        return 2
    from lookahead_vllm.ops import cuda as ops_cuda

    if not ops_cuda.kernels_available():
        print("the lookahead_vllm CUDA extension failed to build/load (see the log above)", file=sys.stderr)
        return 1
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    rows = [measure(args, name, HEAD_CONFIGS[name], nodes, context, rng, gen)
            for name in args.configs for nodes in args.nodes for context in args.contexts]
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"), "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    plot(rows, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
