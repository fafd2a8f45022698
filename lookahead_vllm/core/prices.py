"""Token prices the engine measures itself: the forward-cost model (core/budget.py) fitted online (docs/prices.md:
why each price is there, how samples are bucketed and the prior held). Every pure decode step is a sample ``(T, R,
K, seconds, drafted)``: ``T`` tokens scored in ``R`` rows, ``K`` thousand context tokens of its drafted rows,
seconds to the start of the next step (as ``benchmarks/bench_forward_cost.py`` times ``engine.step()``).
:class:`OnlinePrices` fits the five prices and a per-step time ``t0``::

    seconds(T, R, K) ~= t0 * (cost(T) + row_price * (R - 1) + draft_setup * drafted + context_price * K)
    cost(T) = 1 + max(0, T - free_tokens) / marginal_tokens

The same samples give the same prices bit for bit (tensor-parallel ranks adopt rank 0's, vllm/proposer.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

RING = 32  # samples a bucket keeps (the median of these enters the fit)
MIN_BUCKET_SAMPLES = 6  # a bucket enters the fit with at least this many samples
MAX_AGE_STEPS = 4096  # buckets visited within this many observed steps enter the fit
# A bucket per count up to EXACT_TOKENS, then GROWTH times wider each up to MAX_TOKENS (then the last).
EXACT_TOKENS = 64
GROWTH = 1.0625
MAX_TOKENS = 1 << 16
NUM_BUCKETS = EXACT_TOKENS + math.ceil(math.log(MAX_TOKENS / EXACT_TOKENS) / math.log(GROWTH)) + 1
# Prior strength: a price a factor of 2 from the prior costs as much as a log-time residual of 0.5 on one sample;
# a full bucket's median scatters by ~0.04 on a busy 2-core CPU, a real slope by ~0.5.
PRIOR_WEIGHT = 0.25
# The candidate free-token counts: every count up to 16, then 25% apart up to 4235 (the others: :func:`_solve`).
FREE_GRID = np.unique(np.concatenate([np.arange(1, 17), np.round(16 * 1.25 ** np.arange(1, 26))]))
MARGINAL_BOUNDS = (1.0, 8192.0)
SETUP_BOUNDS = (0.0, 10.0)
ROW_BOUNDS = (0.0, 1.0)
CONTEXT_BOUNDS = (0.0, 2.0)
# Widths of the normal priors (in forwards): SETUP_WIDTH off costs as much as a token price 2x off.
SETUP_WIDTH = 0.25
ROW_WIDTH = 0.1
CONTEXT_WIDTH = 0.1
# Drafted rows' context (thousands of tokens): one bucket below CONTEXT_FIRST, then CONTEXT_GROWTH wide.
CONTEXT_FIRST = 0.125
CONTEXT_GROWTH = 1.25
CONTEXT_BUCKETS = 48
HELD = 1e6  # the weight that holds a price the samples cannot tell (or one at its bound)
MAX_BUCKETS = 512  # buckets kept at once (each a ring of RING samples): bounded memory whatever the mix of steps
REFIT_EVERY = 64  # refit after this many new samples (docs/prices.md: a fit's time)


def bucket_of(tokens: int) -> int:
    """The bucket of a count (>= 1): a step's scored tokens, or its rows."""
    if tokens <= EXACT_TOKENS:
        return tokens - 1
    b = EXACT_TOKENS + int(math.log(tokens / EXACT_TOKENS) / math.log(GROWTH))
    return min(b, NUM_BUCKETS - 1)


def context_bucket(kilotokens: float) -> int:
    """The bucket of a step's drafted-row context (thousands of tokens, >= 0)."""
    if kilotokens < CONTEXT_FIRST:
        return 0
    return min(CONTEXT_BUCKETS - 1, 1 + int(math.log(kilotokens / CONTEXT_FIRST) / math.log(CONTEXT_GROWTH)))


@dataclass(frozen=True, slots=True)
class Prices:
    """One fit: the cost model's prices and what they rest on."""

    free_tokens: int
    marginal_tokens: float
    draft_setup: float = 0.0  # forwards a step with drafts costs over one without
    row_price: float = 0.0  # forwards every row of a step past the first adds
    context_price: float = 0.0  # forwards a row that carries drafts adds per thousand tokens of its context
    step_seconds: float = 0.0  # seconds of a draftless step within the free tokens (the fit's t0; 0 = prior only)
    buckets: int = 0  # buckets and samples the fit used (0 = the prior alone)
    samples: int = 0


class OnlinePrices:
    """Step-time samples by scored tokens and rows, and the prices they imply (module docstring)."""

    def __init__(self, prior: tuple[float, ...]) -> None:
        free, marginal, setup, row, context = (*prior, 0.0, 0.0, 0.0)[:5]
        bounds = (MARGINAL_BOUNDS, SETUP_BOUNDS, ROW_BOUNDS, CONTEXT_BOUNDS)
        if free < 1 or any(not lo <= v <= hi for v, (lo, hi) in zip((marginal, setup, row, context), bounds)):
            raise ValueError(f"prior={prior!r}: free tokens must be >= 1, marginal tokens in {list(MARGINAL_BOUNDS)}, "
                             f"the draft setup in {list(SETUP_BOUNDS)}, the row price in {list(ROW_BOUNDS)} "
                             f"and the context price in {list(CONTEXT_BOUNDS)}")
        self.prior = Prices(int(free), float(marginal), float(setup), float(row), float(context))
        self.prices = self.prior
        # Bucket key (token bucket, row bucket, drafted, context bucket) -> its row in the arrays.
        self._slot: dict[tuple[int, int, bool, int], int] = {}
        self._key: list[tuple[int, int, bool, int]] = []
        self._samples = np.zeros((MAX_BUCKETS, RING, 4))  # per sample: tokens, rows, seconds, context (kilotokens)
        self._count = np.zeros(MAX_BUCKETS, np.int64)  # samples ever put in (ring position = count % RING)
        self._last_seen = np.full(MAX_BUCKETS, -MAX_AGE_STEPS - 1, np.int64)
        self._drafted = np.zeros(MAX_BUCKETS, bool)
        self.observed = 0  # samples so far
        self._free_grid = np.unique(np.append(FREE_GRID, free)).astype(np.float64)  # the prior's among them

    def observe(self, tokens: int, seconds: float, drafted: bool = True, rows: int = 1, context: int = 0) -> bool:
        """One pure decode step of ``rows`` requests that scored ``tokens`` tokens in ``seconds`` (``drafted``: it
        carried draft tokens, in rows whose contexts sum to ``context`` tokens); True when the prices were refitted."""
        if tokens < 1 or not 1 <= rows <= tokens or not seconds > 0 or not math.isfinite(seconds) or not context >= 0:
            return False
        kilo = context / 1000.0 if drafted else 0.0
        key = (bucket_of(tokens), bucket_of(rows), bool(drafted), context_bucket(kilo))
        b = self._slot[key] if key in self._slot else self._new_slot(key)
        self._samples[b, self._count[b] % RING] = tokens, rows, seconds, kilo
        self._count[b] += 1
        self._last_seen[b] = self.observed
        self.observed += 1
        if self.observed % REFIT_EVERY:
            return False
        self.prices = self.fit()
        return True

    def _new_slot(self, key: tuple[int, int, bool, int]) -> int:
        """A row of the arrays for a new bucket: a free one, else the least recently visited's."""
        if len(self._key) < MAX_BUCKETS:
            b = len(self._key)
            self._key.append(key)
        else:
            b = int(np.argmin(self._last_seen))
            del self._slot[self._key[b]]
            self._key[b] = key
        self._slot[key] = b
        self._count[b], self._drafted[b] = 0, key[2]
        return b

    def buckets(self) -> tuple[np.ndarray, ...]:
        """The buckets that enter the fit: median scored tokens, median rows, median seconds, sample count, whether
        the steps were drafted and the median drafted-row context (thousands of tokens), of each."""
        n = np.minimum(self._count, RING)
        idx = np.flatnonzero((n >= MIN_BUCKET_SAMPLES) & (self.observed - self._last_seen <= MAX_AGE_STEPS))
        tokens, rows, seconds, context = _ring_median(self._samples[idx], n[idx]).T
        return tokens, rows, seconds, n[idx], self._drafted[idx], context

    def fit(self) -> Prices:
        """The prices that best explain the live buckets, under the prior: for every candidate ``free`` the other
        prices in closed form (:func:`_solve`); the best ``free`` (residuals plus its own prior) wins."""
        tokens, rows, seconds, weight, drafted, context = self.buckets()
        if len(tokens) < 2:
            return self.prior
        p = self.prior
        # Per price (row, 1/marginal, setup, context): prior value, prior weight, bounds.
        prior = np.array([p.row_price, 1.0 / p.marginal_tokens, p.draft_setup, p.context_price])
        strength = PRIOR_WEIGHT / np.array([ROW_WIDTH, math.log(2), SETUP_WIDTH, CONTEXT_WIDTH]) ** 2
        if np.ptp(rows) == 0:  # one row count: nothing tells the row price from t0
            strength[0] = HELD
        if drafted.all() or not drafted.any():  # one kind of step: nothing tells the setup from t0
            strength[2] = HELD
        if len(np.unique(np.round(context[drafted], 3))) < 2:  # one context: nothing tells its price from the setup
            strength[3] = HELD
        lower = np.array([ROW_BOUNDS[0], 1.0 / MARGINAL_BOUNDS[1], SETUP_BOUNDS[0], CONTEXT_BOUNDS[0]])
        upper = np.array([ROW_BOUNDS[1], 1.0 / MARGINAL_BOUNDS[0], SETUP_BOUNDS[1], CONTEXT_BOUNDS[1]])
        x = np.stack([np.ones_like(tokens), rows - 1.0, tokens, drafted.astype(np.float64), context], axis=1)
        # Every candidate free count at once: only the scored-tokens column depends on it.
        xs = np.repeat(x[None], len(self._free_grid), axis=0)
        xs[:, :, 2] = np.maximum(0.0, tokens[None, :] - self._free_grid[:, None])
        theta, sse = _solve(xs, seconds, weight, prior, strength, lower, upper)
        score = sse + PRIOR_WEIGHT * (np.log(self._free_grid / p.free_tokens) / math.log(2)) ** 2
        # A degenerate candidate (non-finite, no positive step time or token price) never wins; if all are, prices stay.
        valid = np.isfinite(score) & np.isfinite(theta).all(axis=1) & (theta[:, 0] > 0) & (theta[:, 2] > 0)
        if not valid.any():
            return self.prices
        best = int(np.argmin(np.where(valid, score, np.inf)))  # the first of equal scores: the smallest free count
        free, (t0, row, inv_marginal, setup, per_context) = self._free_grid[best], theta[best]
        marginal = min(MARGINAL_BOUNDS[1], 1.0 / inv_marginal)
        return Prices(int(free), round(float(marginal), 2), round(float(setup), 3), round(float(row), 4),
                      round(float(per_context), 4), float(t0), len(tokens), int(weight.sum()))


def _solve(x: np.ndarray, seconds: np.ndarray, weight: np.ndarray, prior: np.ndarray, strength: np.ndarray,
           lower: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each candidate ``f`` of ``x [F, n, 5]``: ``seconds ~= t0 * x[f] @ (1, c1, c2, c3, c4)`` on relative errors
    weighted by ``weight`` (``c1``..``c4``: row price, ``1 / marginal``, setup, context price), each ``c`` pulled to
    ``prior[j]`` with ``strength[j]`` (normal priors, ``c2``'s log-normal) and kept within ``[lower, upper]``. Linear in
    ``theta = t0 * (1, c1, ..., c4)`` once each prior is a pseudo-observation ``(theta_j - target_j * theta_0) / t0`` at
    the last pass's ``t0`` (``c2``'s prior a normal one around the last ``c2``): three batched QR passes; a price past a
    bound is held there from the next pass on. Returns ``[F, 5]`` rows ``(t0, c1, ..., c4)`` and ``[F]`` weighted sums
    of squared relative residuals plus the priors' penalty on the prices they do not hold."""
    f, k = x.shape[0], len(prior)
    sw = np.sqrt(weight) / seconds
    c = np.repeat(prior[None], f, axis=0)
    t0 = np.median(seconds / np.einsum("fnj,fj->fn", x, np.concatenate([np.ones((f, 1)), c], axis=1)), axis=1)
    bound = np.zeros((f, k), bool)
    eye = np.zeros((k, k + 1))
    eye[np.arange(k), np.arange(1, k + 1)] = 1.0
    # The samples' block is the same in every pass: reduce it once to its R (least squares on [R; pseudo] equals
    # least squares on [samples; pseudo]), so each pass solves 5 + 4 rows.
    q0, r0 = np.linalg.qr(x * sw[None, :, None])
    rhs = np.concatenate([np.einsum("fnj,n->fj", q0, seconds * sw), np.zeros((f, k))], axis=1)
    for _ in range(3):
        target, pull = np.repeat(prior[None], f, axis=0), np.repeat(strength[None], f, axis=0)
        # log-normal around the last c2: penalty s * log(c2 / prior)^2 ~ s / c^2 * (c2 - target)^2
        target[:, 1] = c[:, 1] * (1.0 - np.log(c[:, 1] / prior[1]))
        pull[:, 1] = np.minimum(strength[1] / c[:, 1] ** 2, HELD)
        target, pull = np.where(bound, c, target), np.where(bound, HELD, pull)
        pseudo = np.repeat(eye[None], f, axis=0)
        pseudo[:, :, 0] = -target
        a = np.concatenate([r0, pseudo * (np.sqrt(pull) / t0[:, None])[:, :, None]], axis=1)
        q, r = np.linalg.qr(a)  # full column rank: every price has its pseudo-observation row
        theta = np.linalg.solve(r, np.einsum("fmj,fm->fj", q, rhs)[..., None])[..., 0]
        t0 = theta[:, 0]
        c = theta[:, 1:] / t0[:, None]
        bound |= (c < lower) | (c > upper)
        c = np.clip(c, lower, upper)
    fitted = t0[:, None] * np.einsum("fnj,fj->fn", x, np.concatenate([np.ones((f, 1)), c], axis=1))
    resid = (seconds - fitted) / seconds
    penalty = strength * (c - prior) ** 2
    penalty[:, 1] = strength[1] * np.log(c[:, 1] / prior[1]) ** 2
    return np.concatenate([t0[:, None], c], axis=1), resid ** 2 @ weight + penalty[:, strength < HELD].sum(axis=1)


def _ring_median(rings: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Per row of ``rings [B, RING, F]``, the median of its first ``n[b]`` samples: ``[B, F]``."""
    filled = np.where((np.arange(rings.shape[1]) < n[:, None])[:, :, None], rings, np.inf)
    ordered = np.sort(filled, axis=1)
    rows = np.arange(len(n))
    return (ordered[rows, (n - 1) // 2] + ordered[rows, n // 2]) / 2
