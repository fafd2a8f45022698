"""Multi-branch tree verification inside vLLM 0.32's V1 model runner (docs/how-it-works.md, "Tree verification")."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any, Callable

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.sampling_params import _SAMPLING_EPS as SAMPLING_EPS  # below it a temperature is greedy, min_p off

from lookahead_vllm.core import native
from lookahead_vllm.core.jacobi import output_nodes
from lookahead_vllm.core.tree_plan import TreeBatch, index_within
from lookahead_vllm.ops.sampling import row_argmax, sample_row
from lookahead_vllm.ops.tree_attention import pack_tree_mask, tree_attention_dense
from lookahead_vllm.vllm.paged_kv import CpuPagedKV, FlashPagedKV

logger = init_logger(__name__)

# "paths" (vLLM's kernel, a root-to-leaf path a round), "reference" (CPU, dense torch) or "kernel" (GPU csrc kernel).
TREE_ATTENTION = os.environ.get("LOOKAHEAD_TREE_ATTENTION", "paths")

IMPL_ATTR = "_lookahead_verifier"  # each tree-mode attention impl's TreeVerifier (patch tree_verification)


@dataclass(slots=True)
class TreeStep:
    """One engine step that verifies at least one tree: its trees as one :class:`TreeBatch` (row ``t``: req_ids[t])."""

    req_ids: list[str]
    rows: np.ndarray  # each request's row in the persistent batch (and in attention metadata)
    starts: np.ndarray  # each request's root's index among the step's flattened tokens
    trees: TreeBatch
    chain: np.ndarray  # each tree's leading nodes that form a chain from the root (TreeBatch.chain_prefix)
    walk: np.ndarray  # False: only the leading chain is verified (history-dependent sampling)
    sampling_params: list[Any]
    num_tokens: int  # tokens scheduled this step (to recognise this step's attention calls)
    disabled: frozenset[str]
    slot_mapping: torch.Tensor | None = None  # [num_tokens] slot of every scheduled token (first attention layer's)
    caches: dict[int, Any] = field(default_factory=dict)  # one slot accessor per distinct KV cache tensor, layer order
    path_plan: PathPlan | None = None  # built lazily and shared by all layers, as kernel_args
    kernel_args: tuple | None = None
    visible: list[torch.Tensor] | None = None  # each tree's visibility among its rows (dense reference attention)

    @property
    def num_rows(self) -> np.ndarray:
        """``[T]``: each tree's rows among the step's tokens (its root and nodes)."""
        return self.trees.lengths + 1


@dataclass(frozen=True, slots=True, eq=False)
class TreeResults:
    """What verification did with one step's trees (tree ``t``: ``req_ids[t]``), for ``on_tree_results``."""

    req_ids: list[str]
    num_nodes: np.ndarray  # [T] int64: plan nodes verified
    accepted: np.ndarray  # [T] int64: nodes accepted
    nodes: np.ndarray  # [sum(accepted)] int64: each tree's accepted nodes (root to leaf), tree after tree
    windows: dict[int, list[int]]  # tree -> its Jacobi window's new tokens, where the whole window was scheduled

    def accepted_nodes(self) -> list[np.ndarray]:
        """Each tree's accepted nodes, tree by tree."""
        return np.split(self.nodes, np.cumsum(self.accepted)[:-1]) if len(self.accepted) else []


def tree_verifiable(sp: Any) -> bool:
    """Whether a request's sampling is per-row (no history along the draft)."""
    return (sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0 and sp.repetition_penalty == 1.0
            and sp.min_p == 0.0 and sp.min_tokens == 0 and sp.logprobs is None and sp.logprob_token_ids is None
            and not sp.logit_bias and sp.allowed_token_ids is None and not sp.bad_words
            and sp.structured_outputs is None and not sp.watermarking and sp.thinking_token_budget is None
            and sp.repetition_detection is None)


class TreeVerifier:
    """Tree verification's state in one worker (``LookaheadProposer.verifier``): verifies its ``handed_out`` plans."""

    def __init__(self) -> None:
        self.current: TreeStep | None = None  # the step being executed (between begin_step and finish_step)
        self.plan_mismatches = 0  # request-steps whose scheduled drafts differ from the kept plan (verified as chains)
        self.runner_requests: dict[str, Any] = {}  # runner's requests by id (bound by begin_step; tests bind their own)

    def verifiable(self, req_id: str) -> bool:
        """Whether a running request's sampling lets it verify a tree."""
        state = self.runner_requests.get(req_id)
        return state is not None and tree_verifiable(state.sampling_params)

    def begin_step(self, runner: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        """Collect this step's trees (the handed-out plans the scheduler kept) and give their rows tree positions."""
        self.current = None
        self.runner_requests = runner.requests  # the same dict for the runner's lifetime
        drafter = runner.drafter
        handed_out = drafter.handed_out
        spec = scheduler_output.scheduled_spec_decode_tokens
        ids = [req_id for req_id, draft in spec.items() if draft and req_id in handed_out.rows]
        if not ids:
            return
        drafts = list(map(spec.__getitem__, ids))
        counts = np.fromiter(map(len, drafts), np.int64, len(ids))
        trees, full = handed_out.batch(ids, counts)
        truncated = int(np.count_nonzero(counts < full))  # the scheduler's token budget cut the tree
        if truncated:
            drafter.on_tree_truncated(truncated)
        # The scheduled drafts against the plans' tokens (a draft longer than its whole plan differs too).
        flat = np.fromiter(chain.from_iterable(drafts), np.int64, int(counts.sum()))
        sched = np.zeros_like(trees.tokens)
        sched[np.repeat(np.arange(len(ids)), trees.lengths), index_within(trees.lengths)] = flat[
            index_within(counts) < np.repeat(trees.lengths, counts)]
        differs = (sched != trees.tokens).any(axis=1) | (counts > trees.lengths)
        prefix = trees.chain_prefix()
        tree = ~trees.is_chain(prefix)
        for i in np.flatnonzero(tree & differs).tolist():  # vLLM's stock path verifies them as a chain, losslessly
            self.plan_mismatches += 1
            if self.plan_mismatches == 1 or self.plan_mismatches % 1000 == 0:
                logger.warning("lookahead: request %s scheduled drafts %s differ from its tree plan %s; verified as "
                               "a chain (%d such request-steps so far)", ids[i], drafts[i][:16],
                               trees.tokens[i, :min(16, trees.lengths[i])].tolist(), self.plan_mismatches)
        rows = np.fromiter(map(runner.input_batch.req_id_to_index.__getitem__, ids), np.int64, len(ids))
        # Not a decode step of the request: cannot happen (prefill drafts are dropped).
        decode = np.asarray(num_scheduled_tokens)[rows] == trees.lengths + 1
        keep = np.flatnonzero(tree & ~differs & decode)
        if not len(keep):
            return
        starts = np.cumsum(num_scheduled_tokens) - num_scheduled_tokens
        kept_ids = [ids[i] for i in keep.tolist()]
        params = [runner.requests[req_id].sampling_params for req_id in kept_ids]
        disabled = drafter.config.profile.debug_disable
        step = TreeStep(kept_ids, rows[keep], np.asarray(starts, np.int64)[rows[keep]], trees.take(keep), prefix[keep],
                        np.fromiter(map(tree_verifiable, params), bool, len(params)), params,
                        int(num_scheduled_tokens.sum()), frozenset(disabled))
        if "positions" not in disabled:
            _tree_positions(runner.positions, step)
        self.current = step

    def fix_tree_rows(self, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      kv_cache: torch.Tensor, metadata: Any, output: torch.Tensor) -> None:
        """Recompute the current step's tree rows of one attention layer (after the stock kernel)."""
        step = self.current
        if step is None or metadata is None or metadata.num_actual_tokens != step.num_tokens:
            return
        cache = _cache_accessor(step, impl, layer, kv_cache)
        if step.slot_mapping is None:
            step.slot_mapping = metadata.slot_mapping[: step.num_tokens].clone()
        if "mask" in step.disabled:
            return
        out = output.view(-1, impl.num_heads, impl.head_size)
        if isinstance(cache, FlashPagedKV) and TREE_ATTENTION == "kernel":
            _paged_kernel(step, impl, query, cache, metadata, out)
        elif isinstance(cache, FlashPagedKV):
            _flash_path_rounds(step, impl, layer, query, key, value, kv_cache, metadata, out)
        elif TREE_ATTENTION != "reference":
            _cpu_path_rounds(step, impl, layer, query, key, value, kv_cache, metadata, out)
        else:  # the dense reference (LOOKAHEAD_TREE_ATTENTION=reference on the CPU)
            if step.visible is None:  # built once, read by every layer
                vis = step.trees.visibility(int(step.num_rows.max()))
                step.visible = [torch.from_numpy(vis[t, :n, :n]) for t, n in enumerate(step.num_rows.tolist())]
            seq_lens = metadata.seq_lens.tolist()
            for row, start, n, visible in zip(step.rows.tolist(), step.starts.tolist(), step.num_rows.tolist(),
                                              step.visible):
                k, v = cache.gather_seq(metadata.block_table[row], seq_lens[row])
                out[start:start + n] = tree_attention_dense(query[start:start + n], k, v, visible, impl.scale)

    def finish_step(self, runner: Any, logits: torch.Tensor, spec_metadata: Any, sampler_output: Any) -> None:
        """Replace tree requests' rejection-sampler rows by tree walks; compact KV. Greedy targets come from
        ``sampler_output.logits_argmax`` where ``patches.greedy_sample`` took it, else from one argmax here."""
        step, self.current = self.current, None
        if step is None or spec_metadata is None or sampler_output.sampled_token_ids.shape[1] == 1:  # undrafted
            return
        trees, num_rows = step.trees, step.num_rows
        ends = spec_metadata.cu_num_sampled_tokens.cpu().numpy()[step.rows]
        firsts = ends - num_rows  # each tree's first logits row
        lo, hi = int(firsts.min()), int(ends.max())
        handed = getattr(sampler_output, "logits_argmax", None)  # [num_logits_rows], or None
        argmax = row_argmax(logits[lo:hi]) if handed is None else handed[lo:hi]  # every tree row's greedy target
        ats = firsts - lo  # each tree's rows in ``argmax``
        sampled = sampler_output.sampled_token_ids
        chain_only = np.flatnonzero(~step.walk)
        stock = sampled[step.rows[chain_only]].tolist() if len(chain_only) else []
        temps = np.fromiter((sp.temperature for sp in step.sampling_params), np.float64, len(num_rows))
        greedy = np.flatnonzero(step.walk & (temps < SAMPLING_EPS))
        found: list[tuple[list[int], list[int]] | None] = [None] * len(num_rows)
        if len(greedy):
            for t, walk in zip(greedy.tolist(), _greedy_walks(trees.take(greedy), ats[greedy], argmax)):
                found[t] = walk
        for t, chain_row in zip(chain_only.tolist(), stock):  # the stock result cut to the plan's leading chain
            tokens = [token for token in chain_row if token >= 0]
            keep = min(len(tokens) - 1, int(step.chain[t]))  # its rows are exact
            found[t] = list(range(keep)), tokens[: keep + 1]
        for t in np.flatnonzero(step.walk & (temps >= SAMPLING_EPS)).tolist():  # drawn as the walk reaches a row
            rows, sp = logits[int(firsts[t]):int(ends[t])], step.sampling_params[t]  # rows: [1 + k, vocab]
            generator = runner.input_batch.generators.get(int(step.rows[t]))
            found[t] = _walk(trees, t, lambda i: sample_row(rows[i], sp.temperature, sp.top_k, sp.top_p, generator))
        windows = _window_outputs(runner.drafter.config, trees, ats, argmax)
        count = len(found)
        accepted = np.fromiter((len(nodes) for nodes, _ in found), np.int64, count)
        nodes = np.fromiter(chain.from_iterable(nodes for nodes, _ in found), np.int64, int(accepted.sum()))
        lengths = np.fromiter((len(tokens) for _, tokens in found), np.int64, count)  # accepted + bonus
        emitted = np.fromiter(chain.from_iterable(tokens for _, tokens in found), np.int64, int(lengths.sum()))
        out = np.full((count, sampled.shape[1]), -1, np.int64)  # [accepted..., bonus, -1...]
        out[np.repeat(np.arange(count), lengths), index_within(lengths)] = emitted
        rows = torch.from_numpy(step.rows).to(sampled.device)
        sampled[rows] = torch.from_numpy(out).to(device=sampled.device, dtype=sampled.dtype)
        runner.drafter.on_tree_results(TreeResults(step.req_ids, trees.lengths, accepted, nodes, windows))
        # Compaction: an accepted node off its depth's row moves to it (rows among the step's tokens).
        depth = index_within(accepted)
        moved = nodes != depth
        if moved.any() and "compaction" not in step.disabled:
            base = np.repeat(step.starts, accepted)[moved] + 1
            _compact(step, base + nodes[moved], base + depth[moved])


def _tree_positions(positions: torch.Tensor, step: TreeStep) -> None:
    """Give every tree's rows their root's position plus their depth, in one indexed write for the whole step."""
    counts = step.num_rows
    offsets = np.concatenate([np.zeros((len(counts), 1), np.int64), step.trees.depths()], axis=1)
    offsets = offsets[np.arange(offsets.shape[1]) < counts[:, None]]  # each tree's root and nodes, in order
    roots = np.repeat(step.starts, counts)
    rows = roots + index_within(counts)  # a row's place in its tree
    index = torch.from_numpy(np.stack([rows, roots, offsets])).to(positions.device)
    positions[index[0]] = positions[index[1]] + index[2]


def _cpu_path_rounds(step: TreeStep, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any, out: torch.Tensor) -> None:
    """Tree attention with vLLM's CPU kernel, one root-to-leaf path a round (:func:`_run_path_rounds`)."""
    from vllm import _custom_ops as ops

    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    scales = dict(k_scale=layer._k_scale_float, v_scale=layer._v_scale_float, kv_cache_dtype=impl.kv_cache_dtype)

    def write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, layer.isa, **scales)

    def attend(rnd: PathRound, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> None:
        if rnd.kernel_meta is None:
            rnd.kernel_meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(rnd.seq_lens), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                head_dim=impl.head_size, seq_lens=rnd.seq_lens, dtype=query.dtype,
                query_start_loc=rnd.query_start_loc, causal=True, sliding_window_size=-1, isa=layer.isa,
                enable_kv_split=False, kv_cache_dtype=impl.kv_cache_dtype)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=o,
            query_start_loc=rnd.query_start_loc, seq_lens=rnd.seq_lens, scale=impl.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=rnd.block_table, softcap=0,
            scheduler_metadata=rnd.kernel_meta, s_aux=None, **scales)

    _run_path_rounds(_path_plan(step, metadata), query, key, value, out, write, attend)


def _flash_path_rounds(step: TreeStep, impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, kv_cache: torch.Tensor, metadata: Any, out: torch.Tensor) -> None:
    """The path rounds through FlashAttention's stock ``forward``: every tree row with the kernel, and the rounding,
    plain decoding uses (the tree kernel's rows differed at bf16 near-ties, docs/gpu.md)."""
    forward = getattr(type(impl).forward, "__lookahead_original__", type(impl).forward)  # not our wrapper

    def write(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        impl.do_kv_cache_update(layer, k, v, kv_cache, slots)

    def attend(rnd: PathRound, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> None:
        if rnd.kernel_meta is None:
            rnd.kernel_meta = replace(
                metadata, num_actual_tokens=rnd.q.stop - rnd.q.start,
                max_query_len=int((rnd.query_start_loc[1:] - rnd.query_start_loc[:-1]).max()),
                query_start_loc=rnd.query_start_loc.to(query.device), max_seq_len=int(rnd.seq_lens.max()),
                seq_lens=rnd.seq_lens.to(query.device), block_table=rnd.block_table.to(query.device),
                slot_mapping=rnd.slots, scheduler_metadata=None, causal=True)
        forward(impl, layer, q, k, v, kv_cache, rnd.kernel_meta, o)

    _run_path_rounds(_path_plan(step, metadata), query, key, value, out, write, attend)


def _run_path_rounds(plan: PathPlan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     out: torch.Tensor, write: Any, attend: Any) -> None:
    """Every round: ``write`` its paths' K/V into their slots and ``attend`` their new rows; restore borrowed slots."""
    if not plan.rounds:
        return
    path_k, path_v = key.index_select(0, plan.kv_rows), value.index_select(0, plan.kv_rows)
    path_q = query.index_select(0, plan.query_rows)
    path_out = torch.empty(len(plan.query_rows), *out.shape[1:], dtype=out.dtype, device=out.device)
    for rnd in plan.rounds:
        write(path_k[rnd.kv], path_v[rnd.kv], rnd.slots)
        attend(rnd, path_q[rnd.q], path_k[rnd.kv], path_v[rnd.kv], path_out[rnd.q])
    out.index_copy_(0, plan.query_rows, path_out)
    write(key.index_select(0, plan.restore_rows), value.index_select(0, plan.restore_rows), plan.restore_slots)


def _paged_kernel(step: TreeStep, impl: Any, query: torch.Tensor, cache: FlashPagedKV, metadata: Any,
                  out: torch.Tensor) -> None:
    """All tree rows of the batch in one csrc kernel call; only rows off each leading chain are written back (the
    stock causal call's rows there are exact, with plain decoding's rounding)."""
    from lookahead_vllm.ops import cuda as la_cuda

    if step.kernel_args is None:
        device, num_rows = query.device, step.num_rows
        q_max = int(num_rows.max())
        inside = np.arange(q_max) < num_rows[:, None]  # each tree's rows, then padding
        masks = torch.from_numpy(step.trees.visibility(q_max)[inside])
        within = index_within(num_rows)
        rows = torch.from_numpy(np.repeat(step.starts, num_rows) + within).to(device)
        req_rows = torch.from_numpy(step.rows).to(device)
        qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(num_rows)]).astype(np.int32))
        write = torch.from_numpy(np.flatnonzero(within > np.repeat(step.chain, num_rows))).to(device)
        step.kernel_args = (rows, write, rows[write], dict(
            block_tables=metadata.block_table[req_rows], seq_lens=metadata.seq_lens[req_rows].to(torch.int32),
            query_start_loc=qsl.to(device), tree_mask=pack_tree_mask(masks).to(device),
            scale=impl.scale, max_query_len=q_max, max_seq_len=int(metadata.max_seq_len)))
    rows, write, out_rows, args = step.kernel_args
    if len(write):  # else every tree is its leading chain so far (the scheduler cut the rest)
        out[out_rows] = la_cuda.tree_attention(query[rows], cache.key_cache, cache.value_cache, **args)[write]


@dataclass(slots=True)
class PathRound:
    """One kernel call: one more root-to-leaf path of every tree request that has one."""

    kv: slice  # this round's rows of PathPlan.kv_rows (K/V written to ``slots``)
    slots: torch.Tensor  # [n] long: each request's next slots C, C+1, ...
    q: slice  # this round's rows of PathPlan.query_rows (the paths' rows not computed yet)
    query_start_loc: torch.Tensor  # [num_paths + 1] int32, over the round's query rows
    seq_lens: torch.Tensor  # [num_paths] int32: context + path length
    block_table: torch.Tensor  # [num_paths, max_blocks] int32
    kernel_meta: Any = None  # the attention kernel's metadata for the round, built on first use


@dataclass(slots=True)
class PathPlan:
    """The step's path rounds, shared by all layers; row and slot indices live on the slot mapping's device."""

    rounds: list[PathRound]
    kv_rows: torch.Tensor  # [n] long: step rows whose K/V the rounds write, round by round
    query_rows: torch.Tensor  # [m] long: step rows the rounds compute, round by round
    restore_rows: torch.Tensor  # [r] long: rows whose slots the rounds overwrote
    restore_slots: torch.Tensor  # [r] long: their own slots


def _path_plan(step: TreeStep, metadata: Any) -> PathPlan:
    if step.path_plan is not None:
        return step.path_plan
    trees = step.trees
    per_request = [_uncovered_paths(trees.parents[t, :n].tolist(), c)
                   for t, (n, c) in enumerate(zip(trees.lengths.tolist(), step.chain.tolist()))]
    seq_lens = metadata.seq_lens.tolist()
    rounds, all_kv, all_q = [], [], []
    restore: set[int] = set()
    slot_mapping, block_table = step.slot_mapping, metadata.block_table
    requests = list(zip(step.rows.tolist(), step.starts.tolist(), step.num_rows.tolist(), per_request))
    for j in range(max(len(p) for p in per_request)):
        kv0, q0, slot_rows, qsl, lens, table_rows = len(all_kv), len(all_q), [], [0], [], []
        for row, start, num_rows, paths in requests:
            if j >= len(paths):
                continue
            path, tail = paths[j]
            all_kv += [start + r for r in path]
            borrowed = range(start, start + len(path))  # the slots of the request's first rows
            restore.update(borrowed)
            slot_rows += borrowed
            all_q += [start + r for r in path[-tail:]]
            qsl.append(qsl[-1] + tail)
            lens.append(seq_lens[row] - num_rows + len(path))
            table_rows.append(row)
        rounds.append(PathRound(
            slice(kv0, len(all_kv)), slot_mapping[torch.tensor(slot_rows, device=slot_mapping.device)],
            slice(q0, len(all_q)), torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
            block_table[torch.tensor(table_rows, device=block_table.device)]))
    kv_rows, query_rows, restore_rows = (torch.tensor(rows, dtype=torch.long, device=slot_mapping.device)
                                         for rows in (all_kv, all_q, sorted(restore)))
    step.path_plan = PathPlan(rounds, kv_rows, query_rows, restore_rows, slot_mapping[restore_rows])
    return step.path_plan


def _uncovered_paths(parents: list[int], chain_prefix: int) -> list[tuple[list[int], int]]:
    """Root-to-leaf paths (rows, root = 0) of a tree (``parents``, its first ``chain_prefix`` nodes a chain) that the
    stock causal call left wrong, each with its count of new rows: its last ones, as ancestors are computed first."""
    done = [True] * (chain_prefix + 1) + [False] * (len(parents) - chain_prefix)
    inner = set(parents)
    out = []
    for leaf in range(len(parents)):
        if leaf in inner:
            continue
        new, node = [], leaf
        while node >= 0 and not done[node + 1]:
            new.append(node + 1)
            done[node + 1] = True
            node = parents[node]
        if new:
            known = [0]
            while node >= 0:
                known.append(node + 1)
                node = parents[node]
            out.append((known[:1] + known[:0:-1] + new[::-1], len(new)))
    return out


def _cache_accessor(step: TreeStep, impl: Any, layer: Any, kv_cache: torch.Tensor) -> Any:
    """The layer's slot accessor (kept on the layer), registered with the step for compaction."""
    key = kv_cache.data_ptr()
    cache = step.caches.get(key)
    if cache is None:
        cache, cached_for = getattr(layer, "_lookahead_kv", (None, None))
        if cached_for is not kv_cache:
            check_supported(impl)
            kind = CpuPagedKV if kv_cache.device.type == "cpu" else FlashPagedKV
            cache = kind(impl, layer, kv_cache)
            layer._lookahead_kv = (cache, kv_cache)
        step.caches[key] = cache
    return cache


def check_supported(impl: Any) -> None:
    """Attention features tree verification does not implement: a clear error."""
    unsupported = {
        "sliding window": getattr(impl, "sliding_window", -1) not in (-1, None, (-1, -1)),
        "ALiBi": getattr(impl, "alibi_slopes", None) is not None,
        "logits soft-cap": bool(getattr(impl, "logits_soft_cap", 0)),
        "attention sinks": getattr(impl, "sinks", None) is not None}
    bad = [name for name, yes in unsupported.items() if yes]
    if bad:
        raise NotImplementedError(f"lookahead tree verification does not support {', '.join(bad)}; "
                                  "use draft_shape='one'")


def _walk(trees: TreeBatch, t: int, target_at: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Tree ``t``'s walk from the root: a reached row's ``target_at(row)`` (called once a row, in walk order) is
    accepted where a child carries it, else it is the bonus. Returns the accepted nodes and the tokens to emit."""
    v = int(trees.verify[t])
    tokens, parents = trees.tokens[t, :v].tolist(), trees.parents[t, :v].tolist()
    accepted, node = [], -1
    while True:
        target = target_at(node + 1)
        child = next((c for c in range(node + 1, v) if parents[c] == node and tokens[c] == target), None)
        if child is None:
            return accepted, [tokens[c] for c in accepted] + [target]
        accepted.append(child)
        node = child


def _greedy_walks(trees: TreeBatch, ats: np.ndarray, argmax: np.ndarray) -> list[tuple[list[int], list[int]]]:
    """Greedy trees' :func:`_walk` results in one ``walk_trees`` call, tree t's targets ``argmax`` from ``ats[t]``."""
    lens, width = trees.verify, trees.tokens.shape[1]
    # A tree of n verify nodes has at least n + 1 rows: row j of tree t is argmax[ats[t] + j].
    targets = argmax[np.minimum(np.asarray(ats, np.int64)[:, None] + np.arange(width + 1), len(argmax) - 1)]
    nodes, counts, bonus = native.extension().walk_trees(trees.tokens, trees.parents, lens, targets)
    accepted = np.take_along_axis(trees.tokens, np.maximum(nodes, 0), axis=1).tolist()
    return [(path[:c], emitted[:c] + [b]) for path, emitted, c, b in zip(nodes.tolist(), accepted, counts.tolist(),
                                                                          bonus.tolist())]


def _window_outputs(cfg: Any, trees: TreeBatch, ats: np.ndarray, argmax: np.ndarray) -> dict[int, list[int]]:
    """Per tree whose whole Jacobi window was scheduled, the window's new tokens (its last level's ``argmax``)."""
    full = np.flatnonzero((trees.lengths - trees.verify == cfg.lookahead_nodes) & (trees.lengths > trees.verify))
    if not len(full):
        return {}
    on = np.asarray(output_nodes(cfg.profile.jacobi_window, cfg.profile.jacobi_ngram), np.int64)
    at = ats[full, None] + np.where(on < 0, 0, 1 + trees.verify[full, None] + on)
    return dict(zip(full.tolist(), argmax[at].tolist()))


def _compact(step: TreeStep, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
    """Move the K/V of the step's rows ``src_rows`` to the slots of ``dst_rows``."""
    assert step.slot_mapping is not None, "no attention layer saw this step"
    src, dst = (step.slot_mapping[torch.from_numpy(r).to(step.slot_mapping.device)] for r in (src_rows, dst_rows))
    caches = list(step.caches.values())
    if caches and isinstance(caches[0], FlashPagedKV):
        from lookahead_vllm.ops import cuda as la_cuda

        la_cuda.compact_kv([c.key_cache for c in caches], [c.value_cache for c in caches], src, dst)
        return
    for cache in caches:  # every source read before any write
        cache.write_slots(dst, *cache.gather_slots(src))
