"""``LookaheadProposer``: the drafter vLLM builds through ``custom_class``.

Per step, for every request row of the persistent batch that just sampled:

1. admit the request on first sight (its prompt windows go into the trie),
2. insert every committed token not yet inserted (on-the-fly output insertion;
   robust to steps in which vLLM skipped drafting) into the trie and the
   request's context index,
3. draft a tree: the context chain (core/context_match.py) first, the trie's
   tree for the trailing context merged after it, and hand vLLM its best
   chain (``draft_shape="one"``), or the whole tree flattened parent-first
   (``hier``/``par``), keeping its :class:`StepPlan` for ``tree_verify``.

Finished and aborted requests are eliminated from the trie when the runner
reports them (see ``patches.runner_request_ids``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterable

import numpy as np
from vllm.config import VllmConfig
from vllm.logger import init_logger

from lookahead_vllm.core.budget import allocate_step_budget, confidence_floor, forward_cost, opens_path
from lookahead_vllm.core.calibration import KIND_CONTEXT, KIND_POOL, ConfidenceCalibrator, node_kinds
from lookahead_vllm.core.context_match import ContextIndex, with_context
from lookahead_vllm.core.load import load_scaled_budget
from lookahead_vllm.core.request_options import draft_cap
from lookahead_vllm.core.draft_tree import DraftTree
from lookahead_vllm.core.jacobi import PROBE_EVERY, YIELD_PRIOR, JacobiRequest, merge_branches, with_lookahead
from lookahead_vllm.core.step_plan import StepPlan, accepted_path
from lookahead_vllm.core.trie import TokenTrie
from lookahead_vllm.vllm import metrics, patches
from lookahead_vllm.vllm.config import resolve_lookahead_config
from lookahead_vllm.vllm.tree_verify import tree_verifiable

logger = init_logger(__name__)


@dataclass(slots=True)
class ProposerStats:
    """Counters for benchmarks and tests. Steps, draft tokens and drafter time
    are counted once, in the :class:`metrics.StepStats` the server publishes
    (``step``); :meth:`counters` reads them from there."""

    step: metrics.StepStats = field(default_factory=metrics.StepStats, repr=False)
    # Request-steps that were given a (possibly empty) draft.
    request_steps: int = 0
    # Largest number of draft tokens handed out in one step (whole batch).
    max_step_draft_tokens: int = 0
    # Tree verification: request-steps verified as trees, their draft nodes,
    # tokens emitted (accepted + bonus), and accepted nodes that were not on
    # the leading chain (what chain verification could not have accepted).
    tree_request_steps: int = 0
    tree_nodes: int = 0
    tree_tokens: int = 0
    tree_off_chain_accepts: int = 0
    # Trees the scheduler cut to a prefix (token budget / max_model_len).
    tree_truncated: int = 0
    # Jacobi lookahead: request-steps that carried the window, its nodes,
    # n-grams added to the pools, pool branches offered for verification and
    # accepted tokens that came from pool nodes.
    jacobi_steps: int = 0
    jacobi_nodes: int = 0
    pool_ngrams_added: int = 0
    pool_branches: int = 0
    pool_accepted_tokens: int = 0
    # Context match: request-steps whose draft led with a context chain, and
    # accepted tokens that came from context chains.
    context_drafts: int = 0
    context_accepted_tokens: int = 0

    def counters(self) -> dict[str, int]:
        """Every raw counter (summable across proposers), ``propose_ns`` included."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "step"}
        step = self.step
        return {**own, "steps": step.steps, "draft_tokens": step.draft_tokens,
                "propose_ns": round(step.drafter_seconds.total * 1e9)}

    def as_dict(self) -> dict[str, float]:
        c = self.counters()
        per_req = c["request_steps"] or 1
        return {
            "steps": c["steps"],
            "request_steps": c["request_steps"],
            "draft_tokens": c["draft_tokens"],
            "max_step_draft_tokens": c["max_step_draft_tokens"],
            "drafter_ms_per_step": c["propose_ns"] / 1e6 / (c["steps"] or 1),
            "drafter_ms_per_request_step": c["propose_ns"] / 1e6 / per_req,
            "tree_request_steps": c["tree_request_steps"],
            "tree_tokens_per_request_step": c["tree_tokens"] / (c["tree_request_steps"] or 1),
            "tree_off_chain_accepts": c["tree_off_chain_accepts"],
            "jacobi_steps": c["jacobi_steps"],
            "pool_ngrams_added": c["pool_ngrams_added"],
            "pool_branches": c["pool_branches"],
            "pool_accepted_tokens": c["pool_accepted_tokens"],
            "context_drafts": c["context_drafts"],
            "context_accepted_tokens": c["context_accepted_tokens"],
        }


class LookaheadProposer:
    """Drafts chains from the engine-wide :class:`TokenTrie`."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        if not patches.apply("runner_request_ids"):
            raise RuntimeError("lookahead needs the runner_request_ids patch, which failed (see log)")
        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        self.config = resolve_lookahead_config(vllm_config.additional_config, self.k)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.trie = TokenTrie(self.config)
        self._input_batch: Any = None
        # request id -> number of its tokens already inserted into the trie.
        self._inserted: dict[str, int] = {}
        # request id -> its per-request draft cap (extra_args; 0 = off).
        self._caps: dict[str, int] = {}
        # Prometheus lookahead_* series and the periodic log line (metrics.py).
        self.metrics = metrics.StepStats()
        self.stats = ProposerStats(self.metrics)
        self._publisher = metrics.StatsPublisher(self, self.metrics)
        self._interval_log = metrics.IntervalLogger(logger, _log_interval_s())
        # request id -> the tree it was handed last step (tree mode only).
        self.plans: dict[str, StepPlan] = {}
        # The runner's request states (sampling params); set by tree_verify.
        self.requests: dict[str, Any] = {}
        # request id -> Jacobi window and n-gram pool (source "jacobi"/"both").
        self.jacobi: dict[str, JacobiRequest] = {}
        # request id -> its tokens indexed for context matching, and how many
        # nodes of this step's draft are its context chain.
        self.contexts: dict[str, ContextIndex] = {}
        self._context_nodes: dict[str, int] = {}
        # What the Jacobi window last yielded (pool tokens per window step)
        # and the probe interval it had reached: new requests start there, so
        # a workload where the window does not pay stops probing it anew for
        # every request.
        self._window_prior: tuple[float, int] = (YIELD_PRIOR, PROBE_EVERY)
        # Draft confidences calibrated from what verification accepted
        # (core/calibration.py): request id -> (the draft it was handed last
        # step with its nodes' kinds), and how many of its draft tokens the
        # scheduler put into the current step.
        self.calibrator = ConfidenceCalibrator() if self.config.calibrate_confidence else None
        self._offered: dict[str, tuple[DraftTree, list[int]]] = {}
        self._scheduled_drafts: dict[str, int] = {}
        self.tree_mode = self.config.draft_shape != "one" or self.config.uses_jacobi
        platform_paths = (0.0, 0.0)  # chains open no extra attention paths
        if self.tree_mode:
            what = f"source={self.config.source!r}" if self.config.uses_jacobi else f"draft_shape={self.config.draft_shape!r}"
            _check_tree_support(vllm_config, what)
            if not patches.apply("tree_verification"):
                raise RuntimeError(f"lookahead {what} needs the tree_verification patch, which failed (see log)")
            from lookahead_vllm.vllm.tree_verify import path_cost

            platform_paths = path_cost()
        self.cost = forward_cost(self.config, platform_paths, _platform())
        logger.info("lookahead proposer ready: %s", self.config)

    def load_model(self, *args, **kwargs) -> None:
        """No draft model: drafts come from the trie."""

    # Called by the runner patch at the start of every step.
    def on_step(self, input_batch: Any, finished_req_ids: Iterable[str],
                scheduled_drafts: dict[str, list[int]] | None = None) -> None:
        self._input_batch = input_batch
        self._scheduled_drafts = {r: len(d) for r, d in (scheduled_drafts or {}).items()}
        for req_id in finished_req_ids:
            self.finish(req_id)

    def on_new_requests(self, new_reqs: Iterable[Any]) -> None:
        """Record per-request caps from ``extra_args`` (validated when the request was made)."""
        for req in new_reqs:
            params = getattr(req, "sampling_params", None)
            cap = draft_cap(params.extra_args) if params is not None else None
            if cap is not None:
                self._caps[req.req_id] = cap

    def reset(self) -> None:
        """Forget everything: a fresh, empty trie, calibration and window
        policy (benchmarks' cold start)."""
        self.trie = TokenTrie(self.config)
        self._inserted.clear()
        self.plans.clear()
        self.jacobi.clear()
        self.contexts.clear()
        self._offered.clear()
        self.calibrator = ConfidenceCalibrator() if self.config.calibrate_confidence else None
        self._window_prior = (YIELD_PRIOR, PROBE_EVERY)

    def num_request_states(self) -> int:
        """Requests the drafter holds state for (0 once the engine drained)."""
        return len(self._inserted)

    def finish(self, req_id: str) -> None:
        """Eliminate a finished or aborted request's prompt counts."""
        self._caps.pop(req_id, None)
        self.plans.pop(req_id, None)
        self.jacobi.pop(req_id, None)
        self.contexts.pop(req_id, None)
        self._offered.pop(req_id, None)
        if self._inserted.pop(req_id, None) is not None:
            self.trie.finish_request(req_id)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,  # [max_num_reqs]
        token_ids_cpu: np.ndarray,  # [max_num_reqs, max_model_len]
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """One draft per batch row (a chain, or a flattened tree in tree mode; ``[]`` = none)."""
        start = time.perf_counter_ns()
        batch = self._input_batch
        assert batch is not None, "runner patch runner_request_ids was not applied"
        for jac in self.jacobi.values():
            jac.x0 = -1  # set again by _draft for the rows that draft this step
        self._context_nodes.clear()
        rows = [
            i for i, sampled in enumerate(sampled_token_ids)
            if sampled and int(num_tokens_no_spec[i]) < self.max_model_len
        ]
        # Load adaptation (core/load.py) and per-request caps shrink each row's budget.
        load_budget = load_scaled_budget(self.config, len(batch.req_ids))
        budgets = {}
        for i in rows:
            num_tokens = int(num_tokens_no_spec[i])
            req_id = batch.req_ids[i]
            self._learn_acceptance(req_id, sampled_token_ids[i])
            self._sync_request(req_id, i, num_tokens, token_ids_cpu, batch)
            cap = self._caps.get(req_id, load_budget)
            budgets[i] = min(load_budget, cap, self.max_model_len - num_tokens - 1)
        drafting = [i for i in rows if budgets[i] > 0]
        floor = confidence_floor(self.config, len(drafting))
        trees = [DraftTree.empty()] * len(sampled_token_ids)
        for i in drafting:
            num_tokens = int(num_tokens_no_spec[i])
            trees[i] = self._draft(batch.req_ids[i], token_ids_cpu[i], num_tokens, budgets[i], floor)
        req_ids = list(batch.req_ids) + [None] * (len(trees) - len(batch.req_ids))
        drafts = self._drafts_within_step_budget(trees, req_ids, len(rows))
        self._record_metrics(drafts, sampled_token_ids, rows, load_budget, start)
        return drafts

    def _record_metrics(self, drafts, sampled_token_ids, rows, load_budget: int, start_ns: int) -> None:
        skipped = {"request": 0, "load": 0}
        for i in rows:
            if load_budget == 0:
                skipped["load"] += 1
            elif self._caps.get(self._input_batch.req_ids[i]) == 0:
                skipped["request"] += 1
        accepted = sum(len(s) - 1 for s in sampled_token_ids if s)
        step_tokens = sum(len(d) for d in drafts)
        self.stats.request_steps += len(rows)
        self.stats.max_step_draft_tokens = max(self.stats.max_step_draft_tokens, step_tokens)
        m = self.metrics
        m.trie_nodes, m.trie_bytes, m.load_budget = self.trie.num_nodes, self.trie.num_bytes, load_budget
        m.record_step(step_tokens, accepted, (time.perf_counter_ns() - start_ns) / 1e9, skipped)
        self._interval_log.maybe_log(m)

    def _drafts_within_step_budget(
        self, trees: list[DraftTree], req_ids: list[str | None], num_rows: int
    ) -> list[list[int]]:
        """Per request its tree (tree mode, verifiable sampling) or best chain,
        cut to the prefix the forward-cost model and step_draft_budget allow
        (judged by calibrated confidences); requests with a Jacobi window get
        its lookahead nodes appended."""
        offers = [self._offer(tree, req_id) for tree, req_id in zip(trees, req_ids)]
        confs = [self._confidences(t, kinds) for t, kinds, _ in offers]
        opens = [opens_path(t.parents) if is_tree else [False] * len(t) for t, _, is_tree in offers]
        keep = allocate_step_budget(confs, self.config.step_draft_budget or None, num_rows, self.cost, opens)
        kept = [t.truncate(n) for (t, _, _), n in zip(offers, keep)]
        for req_id, t, (_, kinds, _), n in zip(req_ids, kept, offers, keep):
            if req_id is not None and n > 0:
                self._offered[req_id] = (t, kinds[:n])
        drafts = [list(t.tokens) for t in kept]
        if not self.tree_mode:
            return drafts
        rounds = max((sum(o[:n]) for o, n in zip(opens, keep)), default=0)
        windows = self._windows_that_pay(offers, keep, confs, req_ids, num_rows, rounds)
        for row, (t, (_, _, is_tree), req_id) in enumerate(zip(kept, offers, req_ids)):
            if req_id is None:
                continue
            self.plans.pop(req_id, None)
            if req_id in windows:
                jac = self.jacobi[req_id]
                plan = StepPlan(*with_lookahead(t, jac.window))
                self.plans[req_id] = plan
                drafts[row] = list(plan.tree.tokens)
                self.stats.jacobi_steps += 1
                self.stats.jacobi_nodes += jac.window.num_nodes
            elif len(t) and is_tree and not StepPlan(t).is_chain():
                self.plans[req_id] = StepPlan(t)
        return drafts

    def _offer(self, tree: DraftTree, req_id: str | None) -> tuple[DraftTree, list[int], bool]:
        """What a request may draft: its whole tree (tree mode, verifiable
        sampling) or the tree's best path as a chain; its nodes' calibration
        kinds; whether it is the tree."""
        jac = self.jacobi.get(req_id) if req_id is not None else None
        context = self._context_nodes.get(req_id, 0) if req_id is not None else 0
        kinds = node_kinds(tree, jac.pool_from if jac is not None else None, context)
        if self.tree_mode and req_id is not None and self._tree_verifiable(req_id):
            return tree, kinds, True
        return tree.best_path_tree(), [kinds[i] for i in tree.best_path()], False

    def _confidences(self, tree: DraftTree, kinds: list[int]) -> list[float]:
        if self.calibrator is None:
            return [tree.node_confidence(i) for i in range(len(tree))]
        return self.calibrator.calibrate(tree, kinds)

    def _learn_acceptance(self, req_id: str, sampled: list[int]) -> None:
        """Book the draft handed to this request last step, cut to what the
        scheduler verified of it (``sampled``: accepted tokens, then the
        bonus): pool tokens accepted, and the calibrator's evidence."""
        offered = self._offered.pop(req_id, None)
        verified = self._scheduled_drafts.get(req_id, 0)
        if offered is None or not verified:
            return
        tree, kinds = offered
        verified = min(verified, len(tree))
        tree, kinds = tree.truncate(verified), kinds[:verified]
        accepted = accepted_path(tree, sampled)
        self.stats.pool_accepted_tokens += sum(1 for n in accepted if kinds[n] == KIND_POOL)
        self.stats.context_accepted_tokens += sum(1 for n in accepted if kinds[n] == KIND_CONTEXT)
        if self.calibrator is not None:
            self.calibrator.observe(tree, kinds, accepted)

    def _windows_that_pay(self, offers, keep, confs, req_ids, num_rows: int, rounds: int) -> set[str]:
        """Requests whose Jacobi window goes out this step.

        The step scores ``tokens`` tokens and is expected to emit ``gain``; a
        window of ``w`` nodes must be expected to add more accepted tokens than
        ``gain * (cost(tokens + w, extra + W) / cost(tokens, extra) - 1)``,
        what its extra tokens and its W column paths cost at the step's rate
        (see JacobiRequest.wants_window); ``extra`` starts at the trees' own
        path ``rounds``.
        """
        tokens, extra = num_rows + sum(keep), rounds
        gain = num_rows + sum(sum(c[:n]) for c, n in zip(confs, keep))
        candidates = []
        for (_, _, is_tree), req_id in zip(offers, req_ids):
            jac = self.jacobi.get(req_id) if req_id is not None else None
            if jac is not None and jac.x0 >= 0 and is_tree:
                candidates.append((req_id, jac))
        chosen = set()
        for req_id, jac in sorted(candidates, key=lambda c: -c[1].yield_est):
            w, cols = jac.window.num_nodes, jac.window.window
            need = gain * (self.cost(tokens + w, extra + cols) / self.cost(tokens, extra) - 1.0)
            if jac.wants_window(need):
                chosen.add(req_id)
                tokens, extra = tokens + w, extra + cols
                gain += jac.yield_est
        return chosen

    def on_lookahead_outputs(self, req_id: str, new_tokens: list[int], accepted_nodes: list[int]) -> None:
        """The window's new tokens for a request (from tree_verify): slide it,
        fill its pool, and book what the window step got from the pool (the
        window's yield, which new requests start from)."""
        jac = self.jacobi.get(req_id)
        if jac is None:
            return
        self.stats.pool_ngrams_added += jac.update(new_tokens)
        jac.credit(sum(1 for n in accepted_nodes if n >= jac.pool_from))
        self._window_prior = (jac.yield_est, jac.probe_every)

    def _tree_verifiable(self, req_id: str) -> bool:
        state = self.requests.get(req_id)
        return state is not None and tree_verifiable(state.sampling_params)

    def _sync_request(self, req_id: str, row: int, num_tokens: int, token_ids: np.ndarray, batch: Any) -> None:
        done = self._inserted.get(req_id)
        if done is not None and num_tokens < done:  # the runner rewound tokens: start over
            self.finish(req_id)
            done = None
        if done is None:
            num_prompt = int(batch.num_prompt_tokens[row])
            prompt = token_ids[row, :num_prompt].tolist()
            self.trie.add_request(req_id, prompt)
            if self.config.context_match and self.config.source != "jacobi":
                self.contexts[req_id] = ContextIndex(self.config.context_match, prompt)
            if self.config.uses_jacobi and self._tree_verifiable(req_id):
                c = self.config
                self.jacobi[req_id] = JacobiRequest.from_prompt(
                    prompt, c.jacobi_window, c.jacobi_ngram, c.jacobi_guesses, *self._window_prior
                )
            done = num_prompt
        if num_tokens > done:
            new = token_ids[row, done:num_tokens].tolist()
            self.trie.extend(req_id, new)
            if req_id in self.contexts:
                self.contexts[req_id].extend(new)
        self._inserted[req_id] = max(done, num_tokens)

    def _draft(self, req_id: str, tokens: np.ndarray, num_tokens: int, budget: int, floor: float) -> DraftTree:
        if budget <= 0:
            return DraftTree.empty()
        lo = max(0, num_tokens - self.config.max_match_length)
        context = tokens[lo:num_tokens].tolist()
        tree = DraftTree.empty()
        if self.config.source != "jacobi":
            tree = self.trie.retrieve(context, budget=budget, req_id=req_id, min_confidence=floor)
        index = self.contexts.get(req_id)
        if index is not None:
            chain = index.draft(budget, floor)
            if len(chain):
                self._context_nodes[req_id] = len(chain)
                self.stats.context_drafts += 1
                tree = with_context(chain, tree, budget)
        jac = self.jacobi.get(req_id)
        if jac is not None:
            # The window rides along only with the full budget (no load shrink,
            # no per-request cap); x0 = -1 marks rows without it this step.
            jac.x0 = context[-1] if budget == self.config.decoding_length else -1
            jac.pool_from = len(tree)
            branches = jac.pool.get(context[-1], self.config.jacobi_guesses)
            self.stats.pool_branches += len(branches)
            tree = merge_branches(tree, branches, budget)
        return tree


def _platform() -> str:
    """The forward-cost model's platform (core.budget.PLATFORM_TOKEN_COSTS)."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "gpu"


def _log_interval_s() -> float:
    import vllm.envs as envs

    return float(envs.VLLM_LOG_STATS_INTERVAL)


def _check_tree_support(vllm_config: VllmConfig, what: str) -> None:
    """Configurations tree verification cannot serve: a clear error at startup."""
    problems = []
    if vllm_config.scheduler_config.async_scheduling:
        problems.append("async scheduling (pass --no-async-scheduling)")
    if str(vllm_config.cache_config.cache_dtype).startswith("fp8"):
        problems.append(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r}")
    if vllm_config.model_config.uses_mrope:
        problems.append("M-RoPE models")
    if problems:
        raise ValueError(
            f"lookahead {what} (tree verification) does not support {', '.join(problems)}; "
            "use draft_shape='one' and source='trie'"
        )


def find_proposers(llm: Any) -> list[LookaheadProposer]:
    """Proposers of an in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    found = []
    seen = set()
    stack = [llm]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, LookaheadProposer):
            found.append(obj)
            continue
        for name in ("llm_engine", "engine_core", "model_executor", "driver_worker", "worker", "model_runner", "drafter"):
            stack.append(getattr(obj, name, None))
    return found
