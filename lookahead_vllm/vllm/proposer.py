"""``LookaheadProposer``: the drafter vLLM builds (docs/how-it-works.md, "The drafting pipeline")."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from itertools import repeat
from operator import attrgetter
from typing import Any, Callable, ClassVar, Iterable

import numpy as np
import vllm.envs as envs
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.sampling_params import _SAMPLING_EPS, SamplingType

from lookahead_vllm.core.budget import ForwardCost, confidence_floor, forward_cost, prices_pinned
from lookahead_vllm.core.calibration import KIND_CONTEXT, KIND_POOL, ConfidenceCalibrator
from lookahead_vllm.core.config import Settings
from lookahead_vllm.core.draft_index import PRIVATE
from lookahead_vllm.core.drafter import Drafter, trailing_contexts
from lookahead_vllm.core.load import load_scaled_budget
from lookahead_vllm.core.prices import OnlinePrices
from lookahead_vllm.core.request_options import draft_cap
from lookahead_vllm.core.tree_plan import StepDrafts, TreeOffers, index_within, plan_trees
from lookahead_vllm.vllm import draft_trace, guards, metrics, persistence
from lookahead_vllm.vllm.config import engine_settings, logs_stats
from lookahead_vllm.vllm.tree_verify import TreeResults, TreeVerifier

logger = init_logger(__name__)


@dataclass(slots=True)
class ProposerStats:
    """Counters for benchmarks and tests; steps, draft tokens and drafter time are read from ``step``."""

    step: metrics.StepStats = field(default_factory=metrics.StepStats, repr=False)
    request_steps: int = 0  # request-steps given a (possibly empty) draft
    rewinds: int = 0  # request-steps whose committed tokens the runner had rewound (preemption)
    max_step_draft_tokens: int = 0  # most draft tokens handed out in one step (whole batch)
    tree_request_steps: int = 0
    tree_nodes: int = 0
    tree_tokens: int = 0  # emitted: accepted + bonus
    tree_off_chain_accepts: int = 0  # accepted nodes off the leading chain (no chain could have had them)
    tree_truncated: int = 0  # trees the scheduler cut to a prefix (token budget / max_model_len)
    jacobi_steps: int = 0  # request-steps that carried a Jacobi window
    pool_ngrams_added: int = 0
    pool_branches: int = 0  # pool branches offered for verification
    pool_accepted_tokens: int = 0
    context_drafts: int = 0  # request-steps whose draft led with a context chain
    context_accepted_tokens: int = 0
    uniform_steps: int = 0  # steps whose rows were filled to exactly k draft tokens (profile uniform_steps)
    fill_tokens: int = 0  # tokens added past the planned drafts

    def counters(self) -> dict[str, int]:
        """Every raw counter (summable across proposers), ``propose_ns`` included."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "step"}
        step = self.step
        return {**own, "steps": step.steps, "draft_tokens": step.draft_tokens, "draftless_steps": step.draftless_steps,
                "propose_ns": round(step.drafter_seconds.total * 1e9)}


@dataclass(slots=True, eq=False)
class RequestState:
    """Everything the proposer keeps for one running request (compared by identity: ``None in states``)."""

    slot: int  # the request's id in the Drafter (its index slot)
    cap: int | None = None  # extra_args' draft cap (None: none; 0: off), kept across rewinds
    partition: int = 0  # its cache_salt's draft index partition (Drafter.partition), kept across rewinds
    max_tokens: int = 1 << 40  # its sampling's max_tokens: no draft runs past its last token
    verifiable: bool | None = None  # tree_verify.tree_verifiable of its sampling; None until the runner knows it


_SLOT, _PARTITION, _CAP, _MAX_TOKENS = map(attrgetter, ("slot", "partition", "cap", "max_tokens"))
_PRICES = attrgetter("free_tokens", "marginal_tokens", "draft_setup", "row_price", "context_price")

# A step in which no row drafts: its (empty) draft rows, lengths and offers.
_NO_TOKENS, _NO_LENGTHS, _NO_OFFERS = np.zeros((0, 1), np.int32), np.zeros(0, np.int64), TreeOffers.none()

# The drafter's memory gauges are read every this many steps: the estimate walks every sequence the index holds.
MEMORY_GAUGE_EVERY = 16


def graph_tokens(vllm_config: Any) -> int:
    """The most tokens one step runs inside a captured CUDA graph (0 where none are captured)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    eager = getattr(getattr(vllm_config, "model_config", None), "enforce_eager", True)
    if eager or mode is None or str(getattr(mode, "name", mode)).upper() == "NONE":
        return 0
    return int(getattr(compilation, "max_cudagraph_capture_size", 0) or 0)


def full_graph_tokens(vllm_config: Any, k: int) -> int:
    """The most tokens a step of rows scoring 1 + ``k`` tokens each may hold and still replay a full CUDA graph (0:
    none captured), rounded as vLLM will (``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``)."""
    largest = graph_tokens(vllm_config)  # > 0: a compilation_config with a cudagraph_mode
    if not largest or not vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs():
        return 0
    compilation = vllm_config.compilation_config
    q = 1 + k
    sizes = {-(-s // q) * q for s in (getattr(compilation, "cudagraph_capture_sizes", None) or [largest])}
    return max((s for s in sizes if s <= largest), default=q if q <= largest else 0)


def separate_decode_graphs(vllm_config: Any) -> bool:
    """Whether decode steps have full graphs of their own (``FULL_AND_PIECEWISE``, ``FULL_DECODE_ONLY``)."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is not None and mode.separate_routine()


class LookaheadProposer:
    """Drafts for the whole batch through one engine-wide :class:`Drafter`."""

    # Set by the plugin in every process (patches.prepare_engine); None: no plugin (lookahead_lab.standalone).
    prepare_engine: ClassVar[Callable[[Settings], None] | None] = None

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.config = engine_settings(vllm_config)  # resolved once where the engine's config was built, carried in it
        if self.prepare_engine is not None:
            self.prepare_engine(self.config)
        elif isinstance(vllm_config, VllmConfig):
            raise RuntimeError("lookahead cannot start: lookahead-vllm's plugin is not registered in this process "
                               "(vLLM's general plugin 'lookahead'; VLLM_PLUGINS, if set, must name it)")
        guards.check_engine_start(vllm_config, self.config)
        self.tree_mode = guards.is_tree_mode(self.config)
        self._index_only = self.config.sources == ("index",)  # the index alone drafts through one call
        self._uses_jacobi = self.config.uses_jacobi
        self._trace_dir = draft_trace.directory()  # $LOOKAHEAD_DRAFT_TRACE_DIR; None: no trace
        if self.tree_mode:
            from vllm.platforms import current_platform

            if current_platform.is_cuda():  # load (or build) the CUDA kernels now, not in the first tree step
                from lookahead_vllm.ops import cuda as la_cuda

                la_cuda.prepare_kernels()
        self.max_model_len = vllm_config.model_config.max_model_len
        # The largest step CUDA graphs cover (0: none): drafts stop short of it (past it a step runs eager).
        full = full_graph_tokens(vllm_config, self.k)
        self._graph_tokens = full or graph_tokens(vllm_config)
        self._input_batch: Any = None
        self._plugin_logitsprocs: list[str] = []  # logits processor plugins the runner loaded (on_step)
        self._states: dict[str, RequestState] = {}  # request id -> its drafting state (the only per-request store)
        self._next_slot = 0
        self._rows_version = 0
        self._rows_cache: tuple[int, list[str], tuple] | None = None
        self.reset()  # the Drafter, calibrator, window prior and last step's drafts
        self.metrics = metrics.StepStats()  # Prometheus lookahead_* series and the periodic log line
        self.stats = ProposerStats(self.metrics)
        self._publisher = metrics.StatsPublisher(self, self.metrics)
        # One line an interval from tensor-parallel rank 0 (all ranks draft the same tokens) unless stats logs are off.
        logs = metrics.tp_rank() == 0 and logs_stats(vllm_config)
        self._interval_log = metrics.IntervalLogger(
            logger, float(envs.VLLM_LOG_STATS_INTERVAL) if logs else float("inf"))
        self.verifier = TreeVerifier()  # the runner patches and the attention wrapper reach it from here
        # Steps up to this many tokens whose every row scores 1 + k tokens replay a full CUDA graph (0: fill nothing).
        self._uniform_tokens = (full if self.config.profile.uniform_steps and not self.tree_mode
                                and separate_decode_graphs(vllm_config) else 0)
        self.cost = forward_cost(self.config, paths=self.tree_mode)  # chains open no extra attention paths
        # Token prices fitted to this engine's own step times (core/prices.py) unless pinned or the cost model is off.
        self.prices = None if prices_pinned(self.config) else OnlinePrices(_PRICES(self.config.profile))
        self._last_step: tuple[StepShape, float] | None = None  # the last step's shape and start time, for the fit
        self.metrics.set_prices(self.cost, "pinned" if self.prices is None else "prior")
        self._scheduled: dict[str, list[int]] = {}  # draft tokens vLLM scheduled per request this step (on_step)
        logger.info("lookahead proposer ready: %s", self.config)
        # Warm start and snapshot: learned now, written again at engine shutdown (close()), else at exit.
        dp_rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_index", 0) or 0
        self._persistence = persistence.Persistence(self.config, vllm_config.model_config, dp_rank)
        self._persistence.start(self.drafter)
        if self.tree_mode and (self.config.snapshot_path or self.config.warm_start):
            self._agree_on_what_was_learned()
        if self.config.snapshot_path:
            persistence.close_at_exit(self)

    def _agree_on_what_was_learned(self) -> None:
        """Tree mode: ranks verify their own drafters' trees, so unless every rank learned alike all start cold."""
        trie = self.drafter.trie
        learned = (sorted(self._persistence.learned.items()), self.drafter.partition_stats(),
                   0 if trie is None else trie.num_nodes)
        if _differs_across_ranks(learned):
            logger.warning("lookahead: the tensor-parallel ranks learned different things at start (a snapshot "
                           "or warm-start file one of them could not read); every rank starts cold, and no "
                           "snapshot is written this run")
            self.reset()
            self._persistence.writes = False

    def load_model(self, *args, **kwargs) -> None:
        """No draft model: drafts come from the Drafter."""

    # Called by the runner patch at the start of every step.
    def on_step(self, input_batch: Any, finished_req_ids: Iterable[str],
                scheduled_drafts: dict[str, list[int]] | None = None, shape: "StepShape | None" = None) -> None:
        if self._input_batch is None and hasattr(input_batch, "logitsprocs"):  # a runner's, first step
            self._plugin_logitsprocs = guards.check_logits_processors(input_batch)  # any: no request drafts
        self._input_batch = input_batch
        for req_id in finished_req_ids:
            self.finish(req_id)
        self._scheduled = scheduled_drafts or {}
        if shape is not None and self.prices is not None:
            self._time_step(shape, time.perf_counter())

    def on_draftless_step(self) -> None:
        """This step carries no draft token and runs as plain decoding (patches.patch_draftless_steps)."""
        self.metrics.draftless_steps += 1

    def _time_step(self, shape: "StepShape", now: float) -> None:
        """The last step's time (its start to this one's) is a price sample if it was pure decode and the engine did
        not idle in between. Draftless steps run plain's cheaper sampler path: the fit learns it as the draft setup."""
        last, self._last_step = self._last_step, (shape, now)
        if last is None or not shape.continuing or not last[0].pure_decode:
            return
        if self.prices.observe(last[0].tokens, now - last[1], last[0].drafted, last[0].rows, last[0].context):
            self._adopt_prices()

    def _adopt_prices(self) -> None:
        """Price the next steps with the new fit; tensor-parallel ranks take rank 0's, so every rank drafts the same
        tokens (a refit falls on the same step everywhere: the samples' count depends on the schedule alone)."""
        fit = self.prices.prices
        free, marginal, setup, row, context = _shared_across_ranks(_PRICES(fit))
        self.cost = ForwardCost(free, marginal, self.cost.per_path, self.cost.path_setup, setup, row, context)
        self.metrics.set_prices(self.cost, "fitted" if fit.samples else "prior", fit.step_seconds, fit.samples)

    def on_new_requests(self, new_reqs: Iterable[Any]) -> None:
        """Create newly admitted requests' states with their options (core/request_options.py; options that fail are
        logged and the request drafts nothing). Embedded prompts and :func:`samples_plain_only` draft nothing."""
        for req in new_reqs:
            params = getattr(req, "sampling_params", None)
            st = self._state(req.req_id)
            try:
                seeded = getattr(params, "sampling_type", None) == SamplingType.RANDOM_SEED  # sampled, seed set
                st.cap = draft_cap(params.extra_args, seeded) if params is not None else None
                st.max_tokens = getattr(params, "max_tokens", None) or st.max_tokens
            except Exception as exc:  # noqa: BLE001 - one request's options never stop the engine
                logger.warning("lookahead: request %s: %s; it drafts nothing", req.req_id, exc)
                st.cap = 0
            if self._plugin_logitsprocs or (params is not None and samples_plain_only(params)):
                st.cap = 0
            if _has_embedded_prompt(req):
                st.cap, st.partition = 0, PRIVATE
            else:  # cache_salt: carried by the request_cache_salt patch (required at start)
                st.partition = self.drafter.partition(getattr(req, "cache_salt", None))
            self._rows_version += 1
        if self.drafter.partitions.sweep_due():  # salts that hold nothing any more give their ids back
            self.drafter.release_partitions(st.partition for st in self._states.values())

    def _state(self, req_id: str) -> RequestState:
        st = self._states.get(req_id)
        if st is None:
            st = self._states[req_id] = RequestState(self._next_slot, partition=self.drafter.partition(None))
            self._next_slot += 1
            self._rows_version += 1
        return st

    def _rows_of(self, req_ids: list[str]) -> tuple[list[RequestState], np.ndarray, np.ndarray, list, np.ndarray]:
        """The rows' states (made where missing), slots, partitions, caps, max_tokens; cached per ``_rows_version``."""
        cached = self._rows_cache
        if cached is not None and cached[0] == self._rows_version and cached[1] == req_ids:
            return cached[2]
        states = list(map(self._states.get, req_ids))
        if None in states:  # requests the proposer has not seen yet
            states = list(map(self._state, req_ids))
        facts = (states, np.fromiter(map(_SLOT, states), np.int64, len(states)),
                 np.fromiter(map(_PARTITION, states), np.int64, len(states)), list(map(_CAP, states)),
                 np.fromiter(map(_MAX_TOKENS, states), np.int64, len(states)))
        self._rows_cache = (self._rows_version, list(req_ids), facts)
        return facts

    def request_ids(self) -> list[str]:
        """Requests holding state, in admission order."""
        return list(self._states)

    def request_state(self, req_id: str) -> RequestState | None:
        """A running request's state (read-only use: tests, tools)."""
        return self._states.get(req_id)

    @property
    def trie(self) -> Any:
        """The Drafter's trie (sources with "trie"), else None."""
        return self.drafter.trie

    def num_request_states(self) -> int:
        """Requests holding drafting state (0 once the engine drained)."""
        return len(self._states)

    def _step_budget(self, num_rows: int) -> int | None:
        """Draft tokens the whole step may carry: ``step_draft_budget`` (0 = no cap), within the largest CUDA graph."""
        room = max(0, self._graph_tokens - num_rows)
        return min((cap for cap in (self.config.profile.step_draft_budget, room) if cap), default=None)

    def reset(self) -> None:
        """Forget everything learned (benchmarks' cold start). Running requests keep their options and partitions
        (numbered afresh where none runs, alike on every rank), and are indexed anew on their next step."""
        old = getattr(self, "drafter", None)  # None: called from __init__
        running = old is not None and bool(self._states)
        self.drafter = Drafter(self.config, old.partitions if running else None)
        self.calibrator = ConfidenceCalibrator(learns=self.config.profile.calibrate_confidence)  # core/calibration.py
        self.handed_out = StepDrafts.none()  # last step's drafts: tree verification reads them, the next books them

    def warm_start(self, texts: Iterable[list[int]]) -> None:
        """Learn past responses (token ids) before serving (``Drafter.warm``)."""
        for tokens in texts:
            self.drafter.warm(tokens)

    def save_snapshot(self) -> None:
        """Write the snapshot (``snapshot_path``) now, e.g. periodically."""
        if self.config.snapshot_path:
            self._persistence.save(self.drafter)

    def close(self) -> None:
        """Engine shutdown: write the snapshot once, after finishing the requests still held (the last step's
        finished ids would only come with the next step)."""
        keeper = getattr(self, "_persistence", None)
        if keeper is None or keeper.closed:
            return
        if self.config.snapshot_path:
            for req_id in list(self._states):
                self.finish(req_id)
        keeper.close(self.drafter)

    def __del__(self) -> None:
        self.close()

    def finish(self, req_id: str) -> None:
        """The request finished or was aborted: drop its state (one removal)."""
        st = self._states.pop(req_id, None)
        if st is not None:
            self.drafter.finish(st.slot)
            self._rows_version += 1

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
        if self.metrics.steps % MEMORY_GAUGE_EVERY == 0:
            self._read_memory_gauges()
        sampled_lens = np.fromiter(map(len, sampled_token_ids), np.int64, len(sampled_token_ids))
        drafts, num_rows, skipped, load_budget = self._draft_and_plan(sampled_token_ids, sampled_lens,
                                                                      num_tokens_no_spec, token_ids_cpu, batch)
        accepted = int(sampled_lens.sum()) - int(np.count_nonzero(sampled_lens))  # the bonus tokens are not
        step_tokens = sum(map(len, drafts))
        self.stats.request_steps += num_rows
        self.stats.max_step_draft_tokens = max(self.stats.max_step_draft_tokens, step_tokens)
        self.metrics.load_budget = load_budget
        self.metrics.record_step(step_tokens, accepted, (time.perf_counter_ns() - start) / 1e9, skipped)
        self._interval_log.maybe_log(self.metrics)
        if self._persistence.waiting:  # another engine holds the snapshot file: try its lock now and then
            self._persistence.poll()
        if self._trace_dir:
            draft_trace.record(self.metrics.steps, batch.req_ids, drafts, self._trace_dir)
        return drafts

    def _budgets(self, room: np.ndarray, caps: list[int | None], batch: Any) -> tuple[np.ndarray, dict[str, int], int]:
        """Per row its draft budget (load, ``draft_pays``, ``room``), and the rows skipped by load, cost and request."""
        load_budget = load_scaled_budget(self.config, len(batch.req_ids))
        skipped = dict.fromkeys(metrics.SKIP_REASONS, 0)
        stop = ("request" if getattr(batch, "logprob_token_ids", None) else "load" if load_budget == 0
                else None if self.cost.at_rows(len(room)).draft_pays(len(room)) else "cost")  # patches.sample_undrafted
        if stop:
            skipped[stop] = len(caps)
            return np.zeros(len(caps), np.int64), skipped, load_budget
        skipped["request"] = caps.count(0)
        return np.minimum(load_budget, room), skipped, load_budget

    def _draft_and_plan(self, sampled_token_ids: list[list[int]], sampled_lens: np.ndarray,
                        num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray, batch: Any
                        ) -> tuple[list[list[int]], int, dict[str, int], int]:
        """Book last step's drafts, sync, draft and plan the batch's rows, then the Jacobi windows that pay."""
        num_out = len(sampled_lens)
        rows = np.flatnonzero((sampled_lens > 0) & (num_tokens_no_spec[:num_out] < self.max_model_len))
        if len(rows) == num_out:  # every row (the usual step): no per-row gathering in Python
            req_ids, emitted = batch.req_ids[:num_out], sampled_token_ids
        else:
            row_list = rows.tolist()
            req_ids, emitted = [batch.req_ids[i] for i in row_list], [sampled_token_ids[i] for i in row_list]
        states, slots, partitions, caps, max_tokens = self._rows_of(req_ids)
        num_tokens, prompt_lens, fresh = num_tokens_no_spec[rows], batch.num_prompt_tokens[rows], sampled_lens[rows]
        self._book_trees(slots, req_ids, emitted)
        self.stats.rewinds += self.drafter.sync(slots, rows, token_ids_cpu, num_tokens, prompt_lens, partitions, fresh)
        if self._uses_jacobi:
            self._track_windows(req_ids, states, slots, rows, token_ids_cpu, num_tokens, prompt_lens)
        room = self._room(num_tokens, prompt_lens + max_tokens, caps)
        budgets, skipped, load_budget = self._budgets(room, caps, batch)
        drafting = np.flatnonzero(budgets > 0)
        floor = confidence_floor(self.config, len(drafting))
        picked = drafting.tolist()
        tree_ok = (np.fromiter((self._verifiable(req_ids[j], states[j]) for j in picked), bool, len(picked))
                   if self.tree_mode else np.zeros(len(picked), bool))
        cost = self.cost.at_rows(len(rows))
        entry = cost.entry(num_tokens[drafting]) if cost.per_context else None
        if not picked:  # no row drafts (load, cost, the requests' caps): nothing to draft or plan
            tok, lens, offers, calibrated = _NO_TOKENS, _NO_LENGTHS, _NO_OFFERS, _NO_TOKENS
            drafts = [[] for _ in range(num_out)]
        else:
            if self._index_only:
                tok, par, raw, lens = self.drafter.draft_rows(slots[drafting], budgets[drafting], floor, self.tree_mode)
                kinds = None
                self.stats.context_drafts += int(np.count_nonzero(lens))
            else:
                tok, par, raw, kinds, lens = self._merged_rows(slots[drafting], picked, budgets[drafting],
                                                               floor, tree_ok, token_ids_cpu, rows, num_tokens)
            offers, calibrated, drafts = plan_trees(tok, par, raw, lens, tree_ok, self.calibrator,
                                                    self._step_budget(len(rows)), len(rows), cost,
                                                    slots[drafting], rows[drafting], num_out, kinds, entry)
        if self._can_fill(drafts, rows, num_tokens, states):
            self._fill_uniform(drafts, rows, rows[drafting], tok, lens, token_ids_cpu, num_tokens)
        windows = (self._send_windows(offers, drafts, calibrated, tree_ok, rows[drafting], len(rows),
                                      np.zeros(len(picked)) if entry is None else entry, room[drafting])
                   if self._uses_jacobi and picked else {})
        planned = np.flatnonzero(offers.trees).tolist() + list(windows)
        p = self.config.profile
        self.handed_out = StepDrafts(offers, {req_ids[picked[d]]: d for d in planned}, windows, p.jacobi_window,
                                     p.jacobi_ngram)
        return drafts, len(rows), skipped, load_budget

    def _room(self, num_tokens: np.ndarray, ends: np.ndarray, caps: list[int | None]) -> np.ndarray:
        """Per row, the draft nodes it may carry: what fits before max_model_len and its ``ends``, within its cap."""
        room = np.minimum(self.max_model_len, ends) - 1 - np.asarray(num_tokens, np.int64)
        if caps.count(None) == len(caps):  # no request caps its drafts (the usual step)
            return room
        return np.minimum(room, [r if cap is None else cap for r, cap in zip(room.tolist(), caps)])

    def _can_fill(self, drafts: list[list[int]], rows: np.ndarray, num_tokens: np.ndarray,
                  states: list[RequestState]) -> bool:
        """Whether every batch row decodes with room and cap for k tokens, and the step so filled fits a full graph."""
        k = self.k
        return bool(self._uniform_tokens and len(rows) and len(rows) == len(drafts)
                    and len(rows) * (1 + k) <= self._uniform_tokens and int(num_tokens.max()) + k < self.max_model_len
                    and all(st.cap is None or st.cap >= k for st in states))

    def _fill_uniform(self, drafts: list[list[int]], rows: np.ndarray, drafted_rows: np.ndarray, tok: np.ndarray,
                      lens: np.ndarray, token_ids_cpu: np.ndarray, num_tokens: np.ndarray) -> None:
        """Fill every row's chain to exactly k tokens, in place: its draft's unplanned continuation, then its last
        token repeated. Verification keeps the output identical; booking reads only the planned part."""
        k = self.k
        raw = {int(r): tok[j, :lens[j]] for j, r in enumerate(drafted_rows.tolist())}
        added = 0
        for i, r in enumerate(rows.tolist()):
            chain = drafts[r]
            if len(chain) >= k:
                continue
            more = raw[r].tolist() if r in raw else []
            fill = chain + (more[len(chain):k] if more[:len(chain)] == chain else [])
            last = fill[-1] if fill else int(token_ids_cpu[r, num_tokens[i] - 1])
            fill += [last] * (k - len(fill))
            added += k - len(chain)
            drafts[r] = fill
        self.stats.uniform_steps += 1
        self.stats.fill_tokens += added

    def _merged_rows(self, slots: np.ndarray, picked: list[int], budgets: np.ndarray,
                     floor: float, tree_ok: np.ndarray, token_ids_cpu: np.ndarray, rows: np.ndarray,
                     num_tokens: np.ndarray) -> tuple[np.ndarray, ...]:
        """The drafting rows' trees from every source (``Drafter.draft``), with their nodes' calibration kinds."""
        contexts = (trailing_contexts(token_ids_cpu, rows[picked], num_tokens[picked],
                                      self.config.profile.max_match_length) if self.drafter.trie is not None else None)
        pool = self._pool_rows(slots, picked, budgets, token_ids_cpu, rows, num_tokens) if self._uses_jacobi else None
        tok, par, _, conf, kinds, lens = self.drafter.draft(slots, contexts, budgets, floor, self.tree_mode,
                                                            ~tree_ok, pool)
        self.stats.context_drafts += int(np.count_nonzero((kinds == KIND_CONTEXT).any(axis=1)))
        if pool is not None:  # where each row's pool nodes start: the window credits what they get accepted
            self.drafter.jacobi.set_pool_from(slots, lens - np.count_nonzero(kinds == KIND_POOL, axis=1))
        return tok, par, conf, kinds, lens

    def _pool_rows(self, slots: np.ndarray, picked: list[int], budgets: np.ndarray, token_ids_cpu: np.ndarray,
                   rows: np.ndarray, num_tokens: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per drafting row, the Jacobi pool's branches keyed by its last token; windows only with the full budget."""
        lasts = token_ids_cpu[rows[picked], num_tokens[picked] - 1]
        pool, branches = self.drafter.jacobi.pool_rows(slots, lasts, budgets == self.config.decoding_length)
        self.stats.pool_branches += branches
        return pool

    def _verifiable(self, req_id: str, st: RequestState) -> bool:
        """Whether the request may verify a tree (asked of the verifier once the runner knows it, then kept)."""
        if st.verifiable is None:
            if req_id not in self.verifier.runner_requests:
                return False
            st.verifiable = self.verifier.verifiable(req_id)
        return st.verifiable

    def _book_trees(self, slots: np.ndarray, req_ids: list[str], emitted: list[list[int]]) -> None:
        """Book last step's :class:`TreeOffers` against what this step's rows emitted, cut to what was verified."""
        offers = self.handed_out.offers
        if not len(offers.slots):
            return
        verified = np.fromiter(map(len, map(self._scheduled.get, req_ids, repeat((), len(req_ids)))), np.int64,
                               len(req_ids))
        at, verified, hits = offers.match(slots, verified, emitted)
        if len(at):
            context, pool = offers.observe(self.calibrator, at, verified, hits)
            self.stats.context_accepted_tokens += context
            self.stats.pool_accepted_tokens += pool

    def _track_windows(self, req_ids: list[str], states: list[RequestState], slots: np.ndarray, rows: np.ndarray,
                       token_ids_cpu: np.ndarray, num_tokens: np.ndarray, prompt_lens: np.ndarray) -> None:
        """Open the Jacobi window of each request admitted or rewound, on verifiable requests only (one the runner
        does not know yet is asked again next step)."""
        jacobi = self.drafter.jacobi
        stale = jacobi.track(slots, num_tokens).tolist()
        if not stale:
            return
        known = [i for i in stale if self._verifiable(req_ids[i], states[i]) or states[i].verifiable is not None]
        windowed = np.fromiter((states[i].verifiable for i in known), bool, len(known))
        jacobi.open(slots[known], rows[known], token_ids_cpu, np.minimum(prompt_lens[known], num_tokens[known]),
                    num_tokens[known], windowed)

    def _send_windows(self, offers: TreeOffers, drafts: list[list[int]], calibrated: np.ndarray,
                      tree_ok: np.ndarray, out_rows: np.ndarray, num_rows: int, entry: np.ndarray,
                      room: np.ndarray) -> dict[int, tuple[int, ...]]:
        """Append the Jacobi windows that pay to their rows' drafts (in place); returns their lookahead tokens by
        offer row. A window of ``w`` nodes and ``W`` paths must add more expected accepted tokens than ``gain *
        (cost(tokens + w, extra + W) / cost(tokens, extra) - 1)`` (the step scoring ``tokens``, emitting ``gain``;
        ``extra`` from ``rounds``; draft setup and ``entry`` where due; ``JacobiTable.choose``) and fit its ``room``."""
        cols = np.arange(offers.parents.shape[1])
        kept = cols < offers.lengths[:, None]
        # A tree's extra attention paths: its kept nodes that are not their parent's first child.
        opens = np.count_nonzero((offers.parents + 1 != cols) & kept, axis=1)
        rounds = int(opens[tree_ok].max(initial=0))
        tokens, cost = num_rows + int(offers.lengths.sum()), self.cost.at_rows(num_rows)
        # Paid where the cost model is on (cost_free_tokens 0: every window goes, as every draft does).
        drafted, priced = offers.lengths > 0, bool(cost.free_tokens)
        fees = np.where(drafted | (not priced), 0.0, entry)
        jacobi = self.drafter.jacobi
        cands = np.flatnonzero(tree_ok & (offers.lengths + jacobi.num_nodes <= room))
        m = np.arange(len(cands) + 1)
        costs = cost.many(tokens + m * jacobi.num_nodes, rounds + m * jacobi.window)
        chosen, ahead = jacobi.choose(offers.slots[cands], fees[cands], costs,
                                      cost.draft_setup if priced and tokens == num_rows else 0.0,
                                      float(entry[drafted].sum()) if priced else 0.0,
                                      num_rows + float(np.where(kept, calibrated, 0.0).sum()))
        went = cands[chosen]
        windows = ahead.tolist()
        for r, kept_tokens, n, window in zip(out_rows[went].tolist(), offers.tokens[went].tolist(),
                                             offers.lengths[went].tolist(), windows):
            drafts[r] = kept_tokens[:n] + window
        self.stats.jacobi_steps += len(chosen)
        return dict(zip(went.tolist(), map(tuple, windows)))

    def _read_memory_gauges(self) -> None:
        """The drafter's size, read before the step's drafting: the last step's upkeep is done by then."""
        trie = self.drafter.trie
        self.metrics.trie_nodes = trie.num_nodes if trie is not None else 0
        self.metrics.drafter_bytes = self.drafter.memory_bytes()
        self.metrics.draft_sharing = self.config.draft_sharing
        self.metrics.draft_partitions, self.metrics.corpus_bytes = self.drafter.partition_stats()

    def on_tree_truncated(self, count: int) -> None:
        """``count`` trees of this step were cut by the scheduler's token budget."""
        self.stats.tree_truncated += count

    def on_tree_results(self, results: TreeResults) -> None:
        """Book what verification did with this step's trees; feed the Jacobi windows their new tokens in one call."""
        s, accepted = self.stats, results.accepted
        s.tree_request_steps += len(accepted)
        s.tree_nodes += int(results.num_nodes.sum())
        s.tree_tokens += int(accepted.sum()) + len(accepted)
        s.tree_off_chain_accepts += int(np.count_nonzero(results.nodes != index_within(accepted)))
        held = [t for t in results.windows if results.req_ids[t] in self._states]
        if held:
            nodes = results.accepted_nodes()
            s.pool_ngrams_added += self.drafter.jacobi.update(
                np.fromiter((self._states[results.req_ids[t]].slot for t in held), np.int64, len(held)),
                np.array([results.windows[t] for t in held], np.int32),
                np.concatenate([nodes[t] for t in held]), np.concatenate([[0], np.cumsum(accepted[held])]))


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the scheduler put into one engine step, as the price fit needs it."""

    tokens: int  # tokens the forward scores (prefill chunks, decode rows, draft tokens)
    pure_decode: bool  # no prefill: every scheduled request scores its one new token and its draft
    continuing: bool  # the step runs a request that the step before it ran too (no idle gap)
    drafted: bool = True  # some request carries draft tokens (else the step runs as plain decoding)
    rows: int = 1  # requests in the step
    context: int = 0  # the drafted rows' context tokens (computed before this step), summed

    @classmethod
    def of(cls, scheduler_output: Any) -> "StepShape":
        spec = scheduler_output.scheduled_spec_decode_tokens
        rows = len(scheduler_output.num_scheduled_tokens)
        tokens = scheduler_output.total_num_scheduled_tokens
        drafts = sum(map(len, spec.values()))
        cached = scheduler_output.scheduled_cached_reqs
        context = 0
        if drafts:
            computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
            context = sum(computed.get(req_id, 0) for req_id, d in spec.items() if d)
        return cls(tokens, not scheduler_output.scheduled_new_reqs and tokens == rows + drafts,
                   bool(cached.req_ids), drafts > 0, rows, context)


def samples_plain_only(params: Any) -> bool:
    """Whether a request samples with ``min_p`` or ``logit_bias``, which vLLM's rejection sampler does not apply at
    draft positions: such a request drafts nothing (patches ``plain_sampling_params``)."""
    return getattr(params, "min_p", 0.0) > _SAMPLING_EPS or bool(getattr(params, "logit_bias", None))


def _has_embedded_prompt(req: Any) -> bool:
    """Whether a new request's prompt is (partly) embeddings (``NewRequestData``)."""
    if getattr(req, "prompt_embeds", None) is not None:
        return True
    token_ids = getattr(req, "prompt_is_token_ids", None)
    return token_ids is not None and not all(token_ids)


def _tp_group() -> Any:
    """vLLM's tensor-parallel group, or None where there is one rank (or no distributed state: unit tests)."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    try:
        return get_tp_group() if get_tensor_model_parallel_world_size() > 1 else None
    except AssertionError:
        return None


def _differs_across_ranks(value: Any) -> bool:
    """Whether ``value`` differs between tensor-parallel ranks (rank 0's broadcast, every rank's verdict summed)."""
    group = _tp_group()
    if group is None:
        return False
    import torch
    import torch.distributed as dist

    differs = torch.tensor([int(group.broadcast_object(value, src=0) != value)], dtype=torch.int64)
    dist.all_reduce(differs, group=group.cpu_group)
    return bool(differs.item())


def _shared_across_ranks(prices: tuple[int, float, float, float, float]) -> tuple[int, float, float, float, float]:
    """Tensor-parallel rank 0's prices on every rank (the same values where there is one rank)."""
    group = _tp_group()
    return prices if group is None else tuple(group.broadcast_object(prices, src=0))
