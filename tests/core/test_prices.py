"""OnlinePrices: the forward-cost model's prices fitted to step times (core/prices.py)."""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_vllm.core import prices as P
from lookahead_vllm.core.budget import ForwardCost
from lookahead_vllm.core.prices import OnlinePrices, Prices, bucket_of

CPU_PRIOR = (5, 20.0)


def feed(fitter: OnlinePrices, truth: ForwardCost, steps: int, max_tokens: int, seed: int = 0,
         noise: float = 0.05, outliers: float = 0.0, t0: float = 0.02, draftless: float = 0.0) -> None:
    """``steps`` samples at uniform scored-token counts in [1, max_tokens):
    ``t0 * truth.drafted(T)`` with log-normal noise (a share ``draftless`` of
    them draftless steps, ``t0 * truth(T)``), and a share ``outliers`` of
    them stalled 3-20x."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = int(rng.integers(1, max_tokens))
        drafted = draftless == 0 or rng.random() >= draftless
        seconds = t0 * (truth.drafted(tokens) if drafted else truth(tokens)) * float(np.exp(rng.normal(0.0, noise)))
        if rng.random() < outliers:
            seconds *= float(rng.uniform(3.0, 20.0))
        fitter.observe(tokens, seconds, drafted)


def curve_error(fit: Prices, truth: ForwardCost, max_tokens: int) -> float:
    """Largest relative error over 1..max_tokens of the fitted cost curve of
    drafted steps, each curve relative to its one-token step (what samples
    of drafted steps alone can tell)."""
    fitted = ForwardCost(fit.free_tokens, fit.marginal_tokens, draft_setup=fit.draft_setup)
    return max(abs(fitted.drafted(t) / fitted.drafted(1) / (truth.drafted(t) / truth.drafted(1)) - 1.0)
               for t in range(1, max_tokens))


@pytest.mark.parametrize("truth", [(5, 20.0), (12, 40.0), (2, 8.0), (24, 150.0), (40, 10.0)])
def test_converges_to_the_true_curve(truth):
    cost = ForwardCost(*truth)
    fitter = OnlinePrices(CPU_PRIOR)
    feed(fitter, cost, 1500, 80)
    assert fitter.prices.samples > 0  # refitted from samples, not the prior
    assert curve_error(fitter.prices, cost, 80) < 0.10
    assert fitter.prices.step_seconds == pytest.approx(0.02, rel=0.1)


def test_ignores_outliers():
    cost = ForwardCost(8, 30.0)
    clean, noisy = OnlinePrices(CPU_PRIOR), OnlinePrices(CPU_PRIOR)
    feed(clean, cost, 800, 64, seed=1)
    feed(noisy, cost, 800, 64, seed=1, outliers=0.15)
    assert curve_error(noisy.prices, cost, 64) < 0.10
    # A mean-based fit would be pulled up by the stalls: t0 stays put.
    assert noisy.prices.step_seconds == pytest.approx(clean.prices.step_seconds, rel=0.1)


def test_prior_holds_where_samples_say_nothing():
    fitter = OnlinePrices((64, 64.0))
    assert fitter.fit() == Prices(64, 64.0)  # no samples: the prior itself
    feed(fitter, ForwardCost(64, 64.0), 300, 5)  # flat over 1..4 tokens
    fit = fitter.prices
    # Nothing says where the curve bends or how steep it gets: the prior stands.
    assert fit.free_tokens == 64 and fit.marginal_tokens == pytest.approx(64.0, rel=0.1)


def test_flat_samples_push_free_tokens_past_the_prior():
    fitter = OnlinePrices(CPU_PRIOR)
    feed(fitter, ForwardCost(64, 64.0), 600, 40)  # flat up to 39 tokens, prior says 5
    assert fitter.prices.free_tokens >= 36


def test_adapts_when_the_machine_changes():
    fitter = OnlinePrices(CPU_PRIOR)
    feed(fitter, ForwardCost(16, 64.0), 2000, 64, seed=2)
    assert curve_error(fitter.prices, ForwardCost(16, 64.0), 64) < 0.10
    slower = ForwardCost(4, 8.0)  # another tenant took the machine's spare compute
    feed(fitter, slower, 2000, 64, seed=3)
    assert curve_error(fitter.prices, slower, 64) < 0.10


def test_stale_buckets_leave_the_fit():
    fitter = OnlinePrices(CPU_PRIOR)
    feed(fitter, ForwardCost(4, 4.0), 500, 32, t0=0.05)  # an old, busy workload up to 31 tokens
    for _ in range(P.MAX_AGE_STEPS + P.REFIT_EVERY):
        fitter.observe(40, 0.01)  # then only 40-token steps: one bucket
    tokens, _, _, _, drafted, _ = fitter.buckets()
    assert tokens.tolist() == [40.0] and drafted.tolist() == [True]
    assert fitter.prices == fitter.prior  # one live bucket cannot place a curve


def test_memory_is_bounded():
    fitter = OnlinePrices(CPU_PRIOR)
    shape = fitter._samples.shape
    rng = np.random.default_rng(4)
    for i, tokens in enumerate(np.exp(rng.uniform(0.0, np.log(1 << 20), 5000)).astype(np.int64)):
        rows = int(np.exp(rng.uniform(0.0, np.log(min(tokens, 4096)))))
        fitter.observe(int(tokens), 0.01 + tokens * 1e-7, drafted=i % 3 != 0, rows=rows)
    assert fitter._samples.shape == shape == (P.MAX_BUCKETS, P.RING, 4)
    assert len(fitter._slot) == len(fitter._key) == P.MAX_BUCKETS  # full: old buckets made room
    assert sorted(fitter._slot.values()) == list(range(P.MAX_BUCKETS))
    assert fitter.observed == 5000
    # The latest sample's bucket is live, whatever was evicted before it.
    assert fitter._last_seen.max() == fitter.observed - 1
    assert bucket_of(1) == 0 and bucket_of(P.EXACT_TOKENS) == P.EXACT_TOKENS - 1
    assert bucket_of(P.EXACT_TOKENS + 1) == P.EXACT_TOKENS
    assert bucket_of(10 ** 9) == P.NUM_BUCKETS - 1


@pytest.mark.parametrize("setup", [0.0, 0.1, 0.3])
def test_learns_the_draft_setup_from_draftless_steps(setup):
    """Drafted steps cost ``setup`` forwards more than draftless ones at the
    same token count: with both kinds among the samples the fit finds it,
    and the token curve beside it."""
    truth = ForwardCost(6, 24.0, draft_setup=setup)
    fitter = OnlinePrices((5, 20.0, 0.05))
    feed(fitter, truth, 1500, 40, seed=6, draftless=0.3)
    assert fitter.prices.draft_setup == pytest.approx(setup, abs=0.03)
    assert curve_error(fitter.prices, truth, 40) < 0.10
    assert fitter.prices.step_seconds == pytest.approx(0.02, rel=0.1)


def test_the_setup_prior_holds_without_draftless_steps():
    """Only drafted steps: nothing tells the setup from t0, so the prior stands."""
    fitter = OnlinePrices((5, 20.0, 0.05))
    feed(fitter, ForwardCost(5, 20.0, draft_setup=0.05), 800, 40, seed=7)
    assert fitter.prices.samples > 0
    assert fitter.prices.draft_setup == pytest.approx(0.05, abs=0.025)


def test_identical_fits_from_identical_samples():
    """Tensor-parallel ranks that saw the same samples fit the same prices
    (the proposer also shares rank 0's, see test_proposer)."""
    fits = []
    for _ in range(2):
        fitter = OnlinePrices(CPU_PRIOR)
        feed(fitter, ForwardCost(9, 33.0, draft_setup=0.1), 700, 70, seed=5, outliers=0.1, draftless=0.2)
        fits.append(fitter.prices)
    assert fits[0] == fits[1]


def test_invalid_samples_and_prior_are_refused():
    fitter = OnlinePrices(CPU_PRIOR)
    for tokens, seconds in ((0, 0.01), (5, 0.0), (5, -1.0), (5, float("nan")), (5, float("inf"))):
        assert fitter.observe(tokens, seconds) is False
    assert fitter.observe(4, 0.01, rows=5) is False and fitter.observe(4, 0.01, rows=0) is False
    assert fitter.observed == 0
    with pytest.raises(ValueError, match=r"prior=\(0, 20.0\)"):
        OnlinePrices((0, 20.0))
    with pytest.raises(ValueError, match=r"draft setup in \[0.0, 10.0\]"):
        OnlinePrices((5, 20.0, -0.1))
    with pytest.raises(ValueError, match=r"row price in \[0.0, 1.0\]"):
        OnlinePrices((5, 20.0, 0.05, 2.0))


def test_a_degenerate_solve_keeps_the_prices(monkeypatch):
    """A solve that comes back non-finite (or with a step time of 0) is not adopted: the
    fitter keeps pricing as before rather than handing NaN prices to the planner."""
    fitter = OnlinePrices(CPU_PRIOR)
    feed(fitter, ForwardCost(9, 33.0), 300, 40, seed=1)
    before = fitter.prices
    assert before.samples > 0
    solve = P._solve

    for bad in (np.nan, 0.0):
        def broken(*args, bad=bad):
            theta, sse = solve(*args)
            theta = theta.copy()
            theta[:, 0] = bad
            return theta, sse

        monkeypatch.setattr(P, "_solve", broken)
        assert fitter.fit() == before

    def one_broken(*args):  # only the first candidate free count degenerates: the others still fit
        theta, sse = solve(*args)
        theta, sse = theta.copy(), sse.copy()
        theta[0, 0], sse[0] = np.nan, -1.0
        return theta, sse

    monkeypatch.setattr(P, "_solve", solve)
    normal = fitter.fit()
    assert normal.free_tokens != P.FREE_GRID[0]
    fitter.prices = P.Prices(7, 7.0)  # what a fallback to the prices in use would return
    monkeypatch.setattr(P, "_solve", one_broken)
    assert fitter.fit() == normal


def test_the_profile_prior_stays_within_the_fits_bounds():
    """Every marginal-token prior the profile accepts is one the online fit accepts too."""
    from lookahead_vllm.core.config import resolve

    top = P.MARGINAL_BOUNDS[1]
    assert OnlinePrices((5, top)).prior.marginal_tokens == top
    with pytest.raises(ValueError, match="marginal_tokens"):
        resolve({"_profile": {"marginal_tokens": top + 1}})


def test_refits_every_refit_every_samples():
    fitter = OnlinePrices(CPU_PRIOR)
    refits = [fitter.observe(1 + i % 30, 0.01 * (1 + max(0, 1 + i % 30 - 5) / 20)) for i in range(3 * P.REFIT_EVERY)]
    assert [i + 1 for i, r in enumerate(refits) if r] == [P.REFIT_EVERY, 2 * P.REFIT_EVERY, 3 * P.REFIT_EVERY]


def feed_rows(fitter: OnlinePrices, truth: ForwardCost, steps: int, max_rows: int, seed: int = 0,
              noise: float = 0.05, t0: float = 0.02) -> None:
    """Steps of 1..max_rows rows with 0-3 draft tokens each: ``t0 * (truth's
    cost at those tokens + per_row * (rows - 1))``, draftless when no row drafts."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = int(rng.integers(1, max_rows + 1))
        tokens = rows + int(rng.integers(0, 4)) * int(rng.integers(0, rows + 1))
        drafted = tokens > rows
        cost = (truth.drafted(tokens) if drafted else truth(tokens)) + truth.per_row * (rows - 1)
        fitter.observe(tokens, t0 * cost * float(np.exp(rng.normal(0.0, noise))), drafted, rows)


@pytest.mark.parametrize("row", [0.0, 0.05, 0.2])
def test_learns_the_row_price(row):
    """Rows cost on their own: the fit finds their price beside the tokens',
    which no longer absorb it (a fit without rows reads the steps of many rows
    as dear tokens)."""
    truth = ForwardCost(4, 24.0, draft_setup=0.05, per_row=row)
    fitter = OnlinePrices((5, 20.0, 0.05, 0.04))
    feed_rows(fitter, truth, 2000, 16, seed=3)
    fit = fitter.prices
    assert fit.row_price == pytest.approx(row, abs=0.02)
    # At every batch size, the fitted step cost relative to its draftless
    # base is within 10% of the truth's, up to 4 draft tokens a row.
    fitted = ForwardCost(fit.free_tokens, fit.marginal_tokens, draft_setup=fit.draft_setup, per_row=fit.row_price)
    for rows in (1, 4, 16):
        f, t = fitted.at_rows(rows), truth.at_rows(rows)
        for tokens in range(rows + 1, 5 * rows + 1):
            assert f.drafted(tokens) / f(rows) == pytest.approx(t.drafted(tokens) / t(rows), rel=0.1)


def test_the_row_price_prior_holds_with_one_row_count():
    fitter = OnlinePrices((5, 20.0, 0.05, 0.04))
    feed(fitter, ForwardCost(5, 20.0, draft_setup=0.05), 800, 40, seed=8, draftless=0.2)
    assert fitter.prices.samples > 0 and fitter.prices.row_price == 0.04


def test_at_rows_keeps_the_ranking_of_a_step():
    """A step's model from ``at_rows`` is the full model divided by the
    step's draftless base: every ratio of costs is kept."""
    cost = ForwardCost(5, 20.0, per_path=0.02, path_setup=0.09, draft_setup=0.05, per_row=0.1)
    step = cost.at_rows(8)
    assert step.per_row == 0.0 and step.marginal_tokens == pytest.approx(20.0 * 1.7)
    full = lambda tokens, paths=0: 1.7 + max(0, tokens - 5) / 20.0 + (0.09 + 0.02 * paths if paths else 0.0)
    for tokens, paths in ((8, 0), (12, 0), (30, 2), (64, 5)):
        assert step(tokens, paths) / step(8) == pytest.approx(full(tokens, paths) / full(8))
        assert step.drafted(tokens, paths) / step(8) == pytest.approx((full(tokens, paths) + 0.05) / full(8))
