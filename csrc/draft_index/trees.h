// Tree kernels: the proposer's per-step tree math for a whole batch (every
// setting but index chains), in a few calls. No Python here
// (bindings.cpp).
//
// Semantics are those of the pure-Python reference
// lab/lookahead_lab/reference/planner.py (DraftTree, calibrate,
// allocate_step_budget with opens_path, trees.accepted_path (lookahead_lab.reference),
// observe_nodes); tests hold the two to identical
// results, confidences bit for bit:
//
//   plan_trees     this step's raw index trees: rows that may not verify a
//                  tree cut to their best path, calibration kinds, calibrated
//                  confidences, the most confident nodes kept (merged
//                  draft-order heads) while the expected tokens per forward
//                  grow, extra attention paths priced.
//   match_trees    last step's offers walked with what this step's rows
//                  emitted: per booked row, its offer, the nodes the
//                  scheduler verified and which of them were accepted.
//   observe_trees  those nodes booked into the calibrator's tables.
//   walk_trees     greedy acceptance of a step's verified trees (tree_verify):
//                  each tree walked from the root with the target model's
//                  token at every reached row (trees.walk_tree).
#pragma once

#include <cstdint>
#include <vector>

#include "calibration.h"

namespace lookahead {

// Calibration kinds of index nodes (core/calibration.py): the leading chain,
// and the nodes off it.
constexpr int8_t kKindBranch = 1;
constexpr int8_t kKindContext = 3;

// Ranking weight of index nodes per unit of confidence (core/drafter.py
// INDEX_WEIGHT): a best path follows the heaviest child.
constexpr double kIndexWeight = 1e18;

struct TreeCost {
  int64_t free_tokens;     // 0: no cost model
  double marginal_tokens;
  double per_path;         // each extra attention path the step runs
  double path_setup;       // a step that runs any
  double draft_setup;      // paid once by a step that keeps any draft token
};

// A batch of trees, [rows, width] row-major; row r holds lens[r] nodes.
struct TreeRows {
  int32_t* tokens;
  int32_t* parents;  // -1: the root; parents come first
  double* raw;       // raw (uncalibrated) confidences
  int8_t* kinds;
  int64_t rows;
  int64_t width;
};

// Plans `in` into `out` (same shape; other cells untouched). Index trees
// (in.kinds null): a row with tree_ok[r] == 0 that is not a chain becomes
// its best path (the heaviest child from the root down), as a chain; kinds
// are those of the drafted tree (kKindContext on its leading chain, else
// kKindBranch). Rows with their kinds given (merged sources, already cut to
// what each request may verify) are planned as they are.
// `factor [kinds, bins]` calibrates into `calibrated [rows, width]`; keep[r]
// is the prefix row r keeps (at most `budget` nodes in all, < 0: no cap) and
// carries_tree[r] whether that prefix is a tree (not a chain) of a tree_ok
// row. `entry[r]` (null: none) is what row r pays, in forwards, once it keeps
// any node (its context's attention); a row whose whole draft is expected to
// emit no more tokens than its entry buys at the draftless rate keeps none,
// and the plan is made again without the rows that cannot pay at the rate
// the first plan reached, the better of the two plans standing.
void plan_trees(const TreeRows& in, const int32_t* lens, const uint8_t* tree_ok, const double* edges,
                int64_t num_edges, const double* factor, int64_t budget, int64_t num_rows, TreeCost cost,
                const double* entry, TreeRows& out, double* calibrated, int64_t* keep, uint8_t* carries_tree);

// Offers (`offer_slots[D]`, `offer_lens[D]`, their rows `offers`) against this
// step's rows (`slots[R]`, `scheduled[R]`, and the tokens each emitted:
// `emitted[starts[i]:starts[i + 1]]`). Per row that verified a node of its
// offer, in row order, appends the offer's index and the nodes verified, and
// marks in `hits [D, width]` the nodes the emitted tokens walk from the root.
void match_trees(const int64_t* offer_slots, const int64_t* offer_lens, const TreeRows& offers, const int64_t* slots,
                 const int64_t* scheduled, const int64_t* emitted, const int64_t* starts, int64_t rows,
                 std::vector<int64_t>& at, std::vector<int64_t>& verified, uint8_t* hits);

// Books row at[i]'s first verified[i] nodes (kinds, raw confidences, hits),
// in order, into the tables.
void observe_trees(CalibrationTables t, const TreeRows& offers, const uint8_t* hits, const int64_t* at,
                   const int64_t* verified, int64_t n, double prior, double half_life);

// Greedy walks: tree d (its first lens[d] nodes, parents first) walked from
// the root, the target at the root targets[d * twidth] and at node c
// targets[d * twidth + 1 + c] (twidth > lens[d]): a reached row's target moves
// the walk to the first child carrying it, else it is the bonus. Writes the
// accepted nodes, root to leaf, to nodes[d * trees.width ...], their count to
// counts[d] and the bonus to bonus[d].
void walk_trees(const TreeRows& trees, const int64_t* lens, const int64_t* targets, int64_t twidth, int32_t* nodes,
                int64_t* counts, int64_t* bonus);

}  // namespace lookahead
