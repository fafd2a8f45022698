"""Token prices the engine measures itself: the forward-cost model fitted online.

The forward-cost model (core/budget.py) prices a step that scores ``T``
tokens at ``cost(T) = 1 + max(0, T - free_tokens) / marginal_tokens``
single-token forwards. Its two prices depend on the machine, the model, the
context lengths and what else the host is doing, so :class:`OnlinePrices`
fits them from the engine's own steps: every pure decode step (no prefill
in it) gives one sample ``(T, seconds, drafted)``, the wall time from the
start of that step to the start of the next, as
``benchmarks/bench_forward_cost.py`` times ``engine.step()``. A step that
carries draft tokens builds speculative metadata and runs the rejection
sampler; one that carries none runs as plain decoding
(``patches.patch_draftless_steps``) and is cheaper by a fixed amount, the
third price ``draft_setup`` (in forwards). The fit is the price triple whose
curve, scaled by a free per-step time ``t0``, best explains the samples::

    seconds(T) ~= t0 * (cost(T) + draft_setup * drafted)

* **Robust.** Samples go into buckets by ``T`` (one per token count up to
  64, then ~6% wide; drafted and draftless steps apart); a bucket keeps its last :data:`RING` samples and
  enters the fit by their median, so a stall or a preempted step moves
  nothing. Residuals are taken in log time, so the fit is scale-free.
* **Bounded.** ``2 x`` :data:`NUM_BUCKETS` x :data:`RING` samples at most,
  whatever the traffic; a fit is a grid search over (free, marginal, setup).
* **Adaptive.** Rings forget old samples, and a bucket that has not been
  visited for :data:`MAX_AGE_STEPS` steps leaves the fit, so the prices follow
  a change of load or machine.
* **Prior.** The platform's defaults (the profile's ``free_tokens``,
  ``marginal_tokens`` and ``draft_setup``, core/config.py) are a prior on
  the prices (log-normal, a factor of 2 wide; the setup normal,
  :data:`SETUP_WIDTH` wide), which holds them where the samples say nothing:
  a batch that never scored more than 17 tokens does not tell what 64 cost,
  and without draftless steps nothing tells the setup from ``t0``.
* **Deterministic.** The same samples give the same prices bit for bit, and
  tensor-parallel ranks share rank 0's prices besides (vllm/proposer.py), so
  every rank drafts the same tokens.

Example: samples at ``T = 1..4`` all 10 ms and ``T = 17`` at 16 ms, prior
(5, 20): a flat start then 0.6 forwards over 12 tokens: ``free`` near 5 and
``marginal`` near 20.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Samples a bucket keeps (the median of these enters the fit).
RING = 32
# A bucket enters the fit with at least this many samples.
MIN_BUCKET_SAMPLES = 6
# Buckets visited within this many observed steps enter the fit.
MAX_AGE_STEPS = 4096
# Token counts up to EXACT_TOKENS get a bucket each; past it buckets grow
# geometrically by GROWTH up to MAX_TOKENS (larger counts share the last).
EXACT_TOKENS = 64
GROWTH = 1.0625
MAX_TOKENS = 1 << 16
NUM_BUCKETS = EXACT_TOKENS + math.ceil(math.log(MAX_TOKENS / EXACT_TOKENS) / math.log(GROWTH)) + 1
# Prior strength: a price a factor of 2 from the prior costs as much as a
# log-time residual of 0.5 on one sample (0.09 on every sample of a full
# bucket). A busy 2-core CPU's steps scatter by ~20%, the median of a full
# bucket by ~0.04 in log time: noise alone does not move a price the samples
# cannot tell apart, while a real slope over several buckets does (steps at
# 17 tokens 60% dearer than at 5 differ from a flat curve by ~0.5 per sample).
PRIOR_WEIGHT = 0.25
# The candidate prices. free: every count up to 16, then 25% apart up to
# 4096; marginal: 1 to 8192, 20% apart (a cost curve off by at most ~10%).
FREE_GRID = np.unique(np.concatenate([np.arange(1, 17), np.round(16 * 1.25 ** np.arange(1, 26))]))
MARGINAL_GRID = np.round(np.geomspace(1.0, 8192.0, 50), 2)
# Marginal-token candidates between the grid best's neighbours, second pass.
REFINE = 17
# Draft setup candidates (forwards) and the width of its prior: a setup
# SETUP_WIDTH from the prior costs as much as a price a factor of 2 off.
SETUP_GRID = np.round(np.arange(0.0, 0.505, 0.025), 3)
SETUP_WIDTH = 0.25
# Refit after this many new samples (a fit takes a few ms: ~0.05 ms a step).
REFIT_EVERY = 64


def bucket_of(tokens: int) -> int:
    """The bucket of a step that scored ``tokens`` tokens (>= 1)."""
    if tokens <= EXACT_TOKENS:
        return tokens - 1
    b = EXACT_TOKENS + int(math.log(tokens / EXACT_TOKENS) / math.log(GROWTH))
    return min(b, NUM_BUCKETS - 1)


@dataclass(frozen=True, slots=True)
class Prices:
    """One fit: the cost model's prices and what they rest on."""

    free_tokens: int
    marginal_tokens: float
    # Forwards a step with drafts costs over one without.
    draft_setup: float = 0.0
    # Seconds of a draftless step within the free tokens (the fit's t0; 0 = prior only).
    step_seconds: float = 0.0
    # Buckets and samples the fit used (0 = the prior alone).
    buckets: int = 0
    samples: int = 0


class OnlinePrices:
    """Step-time samples by scored tokens, and the prices they imply (module docstring)."""

    def __init__(self, prior: tuple[int, float] | tuple[int, float, float]) -> None:
        free, marginal, setup = (*prior, 0.0)[:3]
        if free < 1 or marginal <= 0 or not 0 <= setup <= SETUP_GRID[-1]:
            raise ValueError(f"prior={prior!r}: free tokens must be >= 1, marginal tokens > 0 and the draft "
                             f"setup in [0, {SETUP_GRID[-1]}]")
        self.prior = Prices(int(free), float(marginal), float(setup))
        self.prices = self.prior
        # Buckets [0, NUM_BUCKETS) hold drafted steps, the next NUM_BUCKETS draftless ones.
        self._tokens = np.zeros((2 * NUM_BUCKETS, RING))  # the samples' scored tokens
        self._seconds = np.zeros((2 * NUM_BUCKETS, RING))
        self._count = np.zeros(2 * NUM_BUCKETS, np.int64)  # samples ever put in (ring position = count % RING)
        self._last_seen = np.full(2 * NUM_BUCKETS, -MAX_AGE_STEPS - 1, np.int64)
        self.observed = 0  # samples so far
        self._since_fit = 0
        # The candidates, the prior's own prices among them, and the prior's
        # penalty on each triple: [F, M, S].
        self._free_grid = np.unique(np.append(FREE_GRID, free)).astype(np.float64)
        self._marginal_grid = np.unique(np.append(MARGINAL_GRID, marginal))
        self._setup_grid = np.unique(np.append(SETUP_GRID, setup))
        self._penalty = self._prior_penalty(self._free_grid, self._marginal_grid, self._setup_grid)

    def observe(self, tokens: int, seconds: float, drafted: bool = True) -> bool:
        """One pure decode step that scored ``tokens`` tokens in ``seconds``
        (``drafted``: it carried draft tokens); True when the prices were
        refitted (every :data:`REFIT_EVERY` samples)."""
        if tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return False
        b = bucket_of(tokens) + (0 if drafted else NUM_BUCKETS)
        pos = self._count[b] % RING
        self._tokens[b, pos], self._seconds[b, pos] = tokens, seconds
        self._count[b] += 1
        self._last_seen[b] = self.observed
        self.observed += 1
        self._since_fit += 1
        if self._since_fit < REFIT_EVERY:
            return False
        self._since_fit = 0
        self.prices = self.fit()
        return True

    def buckets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The buckets that enter the fit: median scored tokens, median
        seconds, sample count and whether the steps were drafted, of each."""
        n = np.minimum(self._count, RING)
        idx = np.flatnonzero((n >= MIN_BUCKET_SAMPLES) & (self.observed - self._last_seen <= MAX_AGE_STEPS))
        return (_ring_median(self._tokens[idx], n[idx]), _ring_median(self._seconds[idx], n[idx]), n[idx],
                idx < NUM_BUCKETS)

    def fit(self) -> Prices:
        """The prices that best explain the live buckets, under the prior: the
        best triple of the grid, then ``marginal`` refined between its grid
        neighbours (free tokens and setup at the grid's best and its neighbours)."""
        tokens, seconds, weight, drafted = self.buckets()
        if len(tokens) < 2:
            return self.prior
        data = (tokens, drafted.astype(np.float64), np.log(seconds), weight.astype(np.float64))
        free, marginal, setup, penalty = self._free_grid, self._marginal_grid, self._setup_grid, self._penalty
        if drafted.all() or not drafted.any():  # one kind of step: nothing tells the setup from t0
            at = int(np.searchsorted(setup, self.prior.draft_setup))
            setup, penalty = setup[at:at + 1], penalty[:, :, at:at + 1]
        f, m, s, _ = self._best(free, marginal, setup, penalty, *data)
        free, setup = free[max(0, f - 1):f + 2], setup[max(0, s - 1):s + 2]
        marginal = np.geomspace(marginal[max(0, m - 1)], marginal[min(len(marginal) - 1, m + 1)], REFINE)
        f, m, s, log_t0 = self._best(free, marginal, setup, self._prior_penalty(free, marginal, setup), *data)
        return Prices(int(free[f]), round(float(marginal[m]), 2), round(float(setup[s]), 3), float(np.exp(log_t0)),
                      len(tokens), int(weight.sum()))

    def _prior_penalty(self, free: np.ndarray, marginal: np.ndarray, setup: np.ndarray) -> np.ndarray:
        """The prior's penalty on every (free, marginal, setup) triple: [F, M, S]."""
        p = self.prior
        return PRIOR_WEIGHT * (((np.log(free)[:, None, None] - math.log(p.free_tokens)) / math.log(2)) ** 2
                               + ((np.log(marginal)[None, :, None] - math.log(p.marginal_tokens)) / math.log(2)) ** 2
                               + ((setup[None, None, :] - p.draft_setup) / SETUP_WIDTH) ** 2)

    @staticmethod
    def _best(free: np.ndarray, marginal: np.ndarray, setup: np.ndarray, penalty: np.ndarray, tokens: np.ndarray,
              drafted: np.ndarray, log_seconds: np.ndarray, w: np.ndarray) -> tuple[int, int, int, float]:
        """Indices of the best (free, marginal, setup) candidate and its log t0."""
        over = np.maximum(0.0, tokens[None, :] - free[:, None])  # [F, B]
        cost = 1.0 + over[:, None, :] / marginal[None, :, None]  # [F, M, B]
        log_cost = np.log(cost[:, :, None, :] + setup[None, None, :, None] * drafted)  # [F, M, S, B]
        resid = log_seconds - log_cost
        log_t0 = (resid @ w) / w.sum()  # each candidate's best t0, closed form: [F, M, S]
        sse = ((resid - log_t0[..., None]) ** 2) @ w
        f, m, s = np.unravel_index(int(np.argmin(sse + penalty)), sse.shape)
        return int(f), int(m), int(s), float(log_t0[f, m, s])


def _ring_median(rings: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per row of ``rings [B, RING]``, the median of its first ``n[b]`` cells."""
    filled = np.where(np.arange(rings.shape[1]) < n[:, None], rings, np.inf)
    ordered = np.sort(filled, axis=1)
    rows = np.arange(len(n))
    return (ordered[rows, (n - 1) // 2] + ordered[rows, n // 2]) / 2
