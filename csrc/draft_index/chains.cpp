// Chain kernels (chains.h); reference: lookahead_vllm/core/chain_plan.py.
#include "chains.h"

#include <algorithm>
#include <unordered_map>

namespace lookahead {

int64_t confidence_bin(const double* edges, int64_t num_edges, double c) {
  return std::lower_bound(edges, edges + num_edges, c) - edges;
}

void match_offers(const int64_t* offer_slots, const int64_t* offer_lens, int64_t num_offers, const int64_t* slots,
                  const int64_t* scheduled, const int64_t* emitted, int64_t rows, std::vector<int64_t>& at,
                  std::vector<int64_t>& verified, std::vector<int64_t>& accepted) {
  if (num_offers == 0) return;
  std::unordered_map<int64_t, int64_t> where;  // slot -> its offer with a draft
  where.reserve(static_cast<size_t>(num_offers) * 2);
  for (int64_t d = 0; d < num_offers; ++d) {
    if (offer_lens[d] > 0) where.emplace(offer_slots[d], d);
  }
  for (int64_t i = 0; i < rows; ++i) {
    if (scheduled[i] <= 0) continue;
    const auto it = where.find(slots[i]);
    if (it == where.end()) continue;
    const int64_t d = it->second;
    const int64_t v = std::min(scheduled[i], offer_lens[d]);
    at.push_back(d);
    verified.push_back(v);
    accepted.push_back(std::min(emitted[i] - 1, v));
  }
}

void observe_chains(CalibrationTables t, int64_t kind, const double* raw, int64_t width, const int64_t* at,
                    const int64_t* verified, const int64_t* accepted, int64_t n, double prior, double half_life) {
  // One step's sums per bin first, in node order, then added to the tables
  // (as the reference adds one bincount per table).
  const int64_t bins = t.bins;
  std::vector<double> predicted(bins, 0.0), hits(bins, 0.0);
  std::vector<int64_t> count(bins, 0);
  for (int64_t i = 0; i < n; ++i) {
    const double* row = raw + at[i] * width;
    for (int64_t j = 0; j < verified[i]; ++j) {
      const int64_t b = confidence_bin(t.edges, bins - 1, row[j]);
      predicted[b] += row[j];
      hits[b] += j < accepted[i] ? 1.0 : 0.0;
      ++count[b];
    }
  }
  for (int64_t b = 0; b < bins; ++b) {
    if (count[b] == 0) continue;
    const int64_t cell = kind * bins + b;
    t.predicted[cell] += predicted[b];
    t.accepted[cell] += hits[b];
    t.nodes[cell] += static_cast<double>(count[b]);
    if (t.nodes[cell] >= half_life) {
      t.predicted[cell] /= 2;
      t.accepted[cell] /= 2;
      t.nodes[cell] /= 2;
    }
    t.factor[cell] = (t.accepted[cell] + prior) / (t.predicted[cell] + prior);
  }
}

namespace {

struct Node {
  double conf;
  int32_t row;
  int32_t pos;
};

// Most confident first; ties by row, then position (the reference's lexsort).
bool before(const Node& a, const Node& b) {
  if (a.conf != b.conf) return a.conf > b.conf;
  if (a.row != b.row) return a.row < b.row;
  return a.pos < b.pos;
}

double step_cost(const ChainCost& cost, int64_t tokens) {
  return 1.0 + static_cast<double>(std::max<int64_t>(0, tokens - cost.free_tokens)) / cost.marginal_tokens;
}

}  // namespace

void plan_chains(const double* raw, const int32_t* lens, int64_t rows, int64_t width, const double* edges,
                 int64_t num_edges, const double* factors, int64_t budget, int64_t num_rows, ChainCost cost,
                 double* calibrated, int64_t* keep) {
  std::vector<Node> nodes;
  for (int64_t r = 0; r < rows; ++r) {
    const double* in = raw + r * width;
    double* out = calibrated + r * width;
    double prev = 1.0;
    for (int64_t j = 0; j < lens[r]; ++j) {
      const double c = std::min(prev, std::min(1.0, in[j] * factors[confidence_bin(edges, num_edges, in[j])]));
      out[j] = prev = c;
      nodes.push_back({c, static_cast<int32_t>(r), static_cast<int32_t>(j)});
    }
    keep[r] = lens[r];
  }
  if (budget < 0 && cost.free_tokens == 0) return;  // every node is free: keep them all
  const int64_t total = static_cast<int64_t>(nodes.size());
  const int64_t limit = budget < 0 ? total : std::min(budget, total);
  // Only the first `limit` of the merged order matter.
  std::partial_sort(nodes.begin(), nodes.begin() + limit, nodes.end(), before);
  int64_t take = limit;
  if (cost.free_tokens != 0 && limit > 0) {
    const double base = static_cast<double>(num_rows);
    double gained = 0.0, best = 0.0;
    int64_t best_at = -1;
    for (int64_t m = 0; m < limit; ++m) {
      gained += nodes[m].conf;
      const double rate = (base + gained) / (step_cost(cost, num_rows + m + 1) + cost.draft_setup);
      if (best_at < 0 || rate > best) best = rate, best_at = m;
    }
    take = best > base / step_cost(cost, num_rows) ? best_at + 1 : 0;
  }
  std::fill(keep, keep + rows, 0);
  for (int64_t m = 0; m < take; ++m) ++keep[nodes[m].row];
}

}  // namespace lookahead
