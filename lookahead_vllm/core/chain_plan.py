"""The chain planner: one engine step's chain math, over the whole batch.

The proposer's default path (chains from the draft index, calibration on)
does three things a step besides syncing and drafting:

1. **book** last step's chains: :meth:`ChainOffers.match` joins them with
   what this step's rows emitted (the nodes the scheduler verified, the
   nodes accepted: verification accepts a prefix of the verified draft and
   emits one token more), and :meth:`ConfidenceCalibrator.observe_chains`
   learns from them;
2. **plan** this step's raw chains: :func:`plan_chains` calibrates them
   (``ConfidenceCalibrator.calibrate_chains``), keeps the most confident
   nodes while the expected tokens per forward grow
   (``budget.allocate_chain_budget``), and cuts each batch row's draft;
3. keeps what it handed out as the next :class:`ChainOffers`.

Done with NumPy these are some forty small array operations, each a few
microseconds right after a forward has evicted the caches: more than the
native index's sync and draft at batch 1. ``native=True`` runs each as one
call into ``lookahead_vllm._draft_index`` (csrc/draft_index/chains.cpp);
``native=False`` runs the pure-Python reference, which composes the
calibrator and the allocator. Tests hold the two to identical results,
confidences bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np

from lookahead_vllm.core.budget import ForwardCost, allocate_chain_budget
from lookahead_vllm.core.native import load_extension

if TYPE_CHECKING:
    from lookahead_vllm.core.calibration import ConfidenceCalibrator


@dataclass(frozen=True, slots=True)
class ChainOffers:
    """The chains the chain planner handed out in one step, one row per drafting
    request: booked against what verification accepted in the next step,
    then replaced."""

    slots: np.ndarray  # [D] int64 request slots, each at most once
    confidence: np.ndarray  # [D, W] raw (uncalibrated) node confidences
    lengths: np.ndarray  # [D] int64 tokens handed out (0: none)

    @classmethod
    def none(cls) -> "ChainOffers":
        return cls(np.zeros(0, np.int64), np.zeros((0, 0)), np.zeros(0, np.int64))

    def match(self, slots: np.ndarray, scheduled: np.ndarray, emitted: np.ndarray, native: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This step's rows (``slots``; ``scheduled``: draft tokens the
        scheduler verified; ``emitted``: tokens the row emitted) against the
        offers. Per row that verified part of its offer, in row order: the
        offer's index, the nodes verified (at most the offer's length) and
        the nodes accepted."""
        if native:
            return load_extension().match_offers(self.slots, self.lengths, slots, scheduled, emitted)
        emitted = np.asarray(emitted).tolist()
        at, verified, accepted = [], [], []
        for i, d, v in verified_offers(self.slots, self.lengths, slots, scheduled):
            at.append(d)
            verified.append(v)
            accepted.append(min(emitted[i] - 1, v))
        return (np.asarray(at, np.int64), np.asarray(verified, np.int64), np.asarray(accepted, np.int64))


def verified_offers(offer_slots: np.ndarray, offer_lengths: np.ndarray, slots: np.ndarray, scheduled: np.ndarray
                    ) -> Iterator[tuple[int, int, int]]:
    """The reference matching of last step's offers (``offer_slots``,
    ``offer_lengths``) with this step's rows (``slots``; ``scheduled``: draft
    tokens the scheduler verified): per row that verified part of its offer,
    in row order, the row, the offer's index and the nodes verified (at most
    the offer's length)."""
    where = {s: d for d, (s, n) in enumerate(zip(offer_slots.tolist(), offer_lengths.tolist())) if n > 0}
    for i, (slot, sched) in enumerate(zip(np.asarray(slots).tolist(), np.asarray(scheduled).tolist())):
        d = where.get(slot)
        if d is not None and sched > 0:
            yield i, d, min(sched, int(offer_lengths[d]))


def plan_chains(
    tokens: np.ndarray, raw: np.ndarray, lengths: np.ndarray, calibrator: "ConfidenceCalibrator", kind: int,
    budget: int | None, num_rows: int, cost: ForwardCost, out_rows: np.ndarray, num_out: int, native: bool,
) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """Row ``r`` of ``tokens``/``raw [R, W]`` holds a chain of ``lengths[r]``
    nodes (all of calibration ``kind``) for batch row ``out_rows[r]``:
    returns the prefix each keeps (at most ``budget`` nodes in all, None = no
    cap; the count that maximises expected tokens per forward of a step of
    ``num_rows`` rows under ``cost``), the calibrated confidences (cells
    past a row's length are unspecified) and the ``num_out`` batch rows'
    drafts (``[]`` where none)."""
    if native:
        return load_extension().plan_chains(
            tokens, raw, lengths, calibrator.bin_edges, calibrator.factors(kind), -1 if budget is None else budget,
            num_rows, cost.free_tokens, float(cost.marginal_tokens), out_rows, num_out, float(cost.draft_setup))
    calibrated = calibrator.calibrate_chains(raw, kind)
    keep = allocate_chain_budget(calibrated, lengths, budget, num_rows, cost)
    drafts: list[list[int]] = [[] for _ in range(num_out)]
    for r, n in enumerate(keep.tolist()):
        drafts[int(out_rows[r])] = tokens[r, :n].tolist()
    return keep, calibrated, drafts
