// Confidence bins (calibration.h).
#include "calibration.h"

#include <algorithm>

namespace lookahead {

int64_t confidence_bin(const double* edges, int64_t num_edges, double c) {
  return std::lower_bound(edges, edges + num_edges, c) - edges;
}

}  // namespace lookahead
