// Chain kernels: the proposer's per-step chain math for a whole batch, in
// three calls instead of dozens of small array operations. No Python here
// (bindings.cpp).
//
// Semantics are those of the pure-Python reference
// lookahead_vllm/core/chain_plan.py (and the ConfidenceCalibrator and
// allocate_chain_budget it composes); tests hold the two to identical
// results, confidences bit for bit:
//
//   match_offers    last step's chains (offers) joined with what this step's
//                   rows emitted: per booked row, its offer, the nodes the
//                   scheduler verified and the nodes accepted.
//   observe_chains  those nodes booked into the calibrator's tables.
//   plan_chains     this step's raw chains calibrated, the most confident
//                   nodes kept while the expected tokens per forward grow,
//                   and the kept prefixes written out per batch row.
#pragma once

#include <cstdint>
#include <vector>

namespace lookahead {

// The calibrator's tables, [kinds, bins] row-major, updated in place.
struct CalibrationTables {
  double* predicted;
  double* accepted;
  double* nodes;
  double* factor;
  int64_t kinds;
  int64_t bins;          // len(edges) + 1
  const double* edges;   // upper bin edges, ascending
};

// Bin of a raw confidence: the first edge >= c (numpy searchsorted, left).
int64_t confidence_bin(const double* edges, int64_t num_edges, double c);

// Offers (`offer_slots[D]`, `offer_lens[D]`; a slot at most once; length 0 =
// no draft) against this step's rows (`slots[R]`, `scheduled[R]` draft
// tokens the scheduler verified, `emitted[R]` tokens emitted). Appends, per
// row that verified a node of its offer, in row order: the offer's index,
// the nodes verified (min(scheduled, offer length)) and accepted
// (min(emitted - 1, verified)).
void match_offers(const int64_t* offer_slots, const int64_t* offer_lens, int64_t num_offers, const int64_t* slots,
                  const int64_t* scheduled, const int64_t* emitted, int64_t rows, std::vector<int64_t>& at,
                  std::vector<int64_t>& verified, std::vector<int64_t>& accepted);

// Books row `at[i]` of `raw [*, width]`: its first `verified[i]` nodes, the
// first `accepted[i]` of them accepted, all of `kind`.
void observe_chains(CalibrationTables t, int64_t kind, const double* raw, int64_t width, const int64_t* at,
                    const int64_t* verified, const int64_t* accepted, int64_t n, double prior, double half_life);

struct ChainCost {
  int64_t free_tokens;     // 0: no cost model
  double marginal_tokens;
  double draft_setup = 0.0;  // paid once by a step that keeps any draft token
};

// Calibrates row r's first lens[r] confidences of `raw [R, width]` with
// `factors [bins]` into `calibrated` (same shape; other cells untouched) and
// writes into keep[R] the prefix each row keeps: at most `budget` nodes in
// all (< 0: no cap), chosen most confident first, while they raise the
// expected tokens per forward of a step of `num_rows` rows.
void plan_chains(const double* raw, const int32_t* lens, int64_t rows, int64_t width, const double* edges,
                 int64_t num_edges, const double* factors, int64_t budget, int64_t num_rows, ChainCost cost,
                 double* calibrated, int64_t* keep);

}  // namespace lookahead
