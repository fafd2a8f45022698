// The calibrator's tables and confidence bins, shared by the tree kernels
// (trees.h) and the bindings. Semantics: lookahead_vllm/core/calibration.py.
#pragma once

#include <cstdint>

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

}  // namespace lookahead
