// Tree kernels (trees.h); reference: lab/lookahead_lab/reference/planner.py.
#include "trees.h"

#include <algorithm>
#include <unordered_map>

namespace lookahead {

namespace {

// Kinds of a drafted index tree: kKindContext on its leading chain (node i's
// parent is i - 1 from the root on), kKindBranch off it. Returns whether the
// whole tree is a chain.
bool index_kinds(const int32_t* parents, int32_t n, int8_t* kinds) {
  bool chain = true;
  for (int32_t i = 0; i < n; ++i) {
    chain = chain && parents[i] == i - 1;
    kinds[i] = chain ? kKindContext : kKindBranch;
  }
  return chain;
}

// The path that follows the heaviest child from the root (the first of equal
// weights, as Python's max); children come after their parent.
void best_path(const int32_t* parents, const double* raw, int32_t n, std::vector<int32_t>& path) {
  path.clear();
  int32_t node = -1;
  while (true) {
    int32_t best = -1;
    double best_weight = 0.0;
    for (int32_t c = node + 1; c < n; ++c) {
      if (parents[c] != node) continue;
      const double w = kIndexWeight * raw[c];
      if (best < 0 || w > best_weight) best = c, best_weight = w;
    }
    if (best < 0) return;
    path.push_back(best);
    node = best;
  }
}

// Row r of `in` into `out` as drafted (a tree_ok row, a chain, or any row
// whose kinds `in` gives) or as its best path; returns the nodes written.
int32_t offer_row(const TreeRows& in, int64_t r, int32_t n, bool tree_ok, TreeRows& out, std::vector<int8_t>& kinds,
                  std::vector<int32_t>& path) {
  const int64_t base = r * in.width;
  const int32_t* par = in.parents + base;
  kinds.resize(static_cast<size_t>(n));
  const bool given = in.kinds != nullptr;  // rows as offered, their kinds given
  const bool chain = given || index_kinds(par, n, kinds.data());
  if (given) std::copy(in.kinds + base, in.kinds + base + n, kinds.begin());
  if (tree_ok || chain) {
    std::copy(in.tokens + base, in.tokens + base + n, out.tokens + base);
    std::copy(par, par + n, out.parents + base);
    std::copy(in.raw + base, in.raw + base + n, out.raw + base);
    std::copy(kinds.begin(), kinds.end(), out.kinds + base);
    return n;
  }
  best_path(par, in.raw + base, n, path);
  const int32_t m = static_cast<int32_t>(path.size());
  for (int32_t j = 0; j < m; ++j) {
    out.tokens[base + j] = in.tokens[base + path[j]];
    out.parents[base + j] = j - 1;
    out.raw[base + j] = in.raw[base + path[j]];
    out.kinds[base + j] = kinds[path[j]];
  }
  return m;
}

struct Head {
  double conf;
  int32_t row;
  int32_t pos;
};

// Max-heap order of draft-order heads: most confident first, ties by row (the
// reference's heap of (-confidence, row, position)).
bool lower(const Head& a, const Head& b) {
  if (a.conf != b.conf) return a.conf < b.conf;
  return a.row > b.row;
}

double step_cost(const TreeCost& cost, int64_t tokens, int64_t paths) {
  const double extra = paths ? cost.path_setup + static_cast<double>(paths) * cost.per_path : 0.0;
  return 1.0 + static_cast<double>(std::max<int64_t>(0, tokens - cost.free_tokens)) / cost.marginal_tokens + extra;
}

// Empties (size 0) every row whose draft, all of it, is expected to emit no
// more tokens than its entry buys at `rate` tokens per forward.
void drop_unpaid(const double* calibrated, int64_t width, const double* entry, double rate,
                 std::vector<int32_t>& sizes) {
  for (size_t r = 0; r < sizes.size(); ++r) {
    if (entry[r] <= 0.0) continue;
    double sum = 0.0;
    for (int32_t i = 0; i < sizes[r]; ++i) sum += calibrated[static_cast<int64_t>(r) * width + i];
    if (!(sum > entry[r] * rate)) sizes[r] = 0;
  }
}

// Fills keep[r] with the prefix each row keeps: the merged order of the rows'
// draft-order heads (most confident first) cut to `budget` nodes (< 0: no
// cap) and, with a cost model, to the prefix with the best expected tokens
// per forward (a node that is not its parent's first child opens an
// attention path, the step pays for the most paths any row opens, a drafted
// step the draft setup once, a row its entry with its first node). Returns
// that best rate (the draftless rate when nothing pays; 0 without a cost model).
double best_prefix(const double* calibrated, int64_t width, const std::vector<int32_t>& sizes,
                   const uint8_t* tree_ok, const int32_t* parents, const double* entry, int64_t budget,
                   int64_t num_rows, const TreeCost& cost, int64_t* keep) {
  const int64_t rows = static_cast<int64_t>(sizes.size());
  int64_t total = 0;
  for (const int32_t n : sizes) total += n;
  const int64_t limit = budget < 0 ? total : std::min(budget, total);
  std::vector<Head> heap;
  for (int64_t r = 0; r < rows; ++r) {
    if (sizes[r]) heap.push_back({calibrated[r * width], static_cast<int32_t>(r), 0});
  }
  std::make_heap(heap.begin(), heap.end(), lower);
  std::vector<int32_t> order;
  order.reserve(static_cast<size_t>(limit));
  while (static_cast<int64_t>(order.size()) < limit) {
    std::pop_heap(heap.begin(), heap.end(), lower);
    Head h = heap.back();
    heap.pop_back();
    order.push_back(h.row);
    if (++h.pos < sizes[h.row]) {
      h.conf = calibrated[h.row * width + h.pos];
      heap.push_back(h);
      std::push_heap(heap.begin(), heap.end(), lower);
    }
  }
  int64_t take = limit;
  double best = 0.0;
  std::fill(keep, keep + rows, 0);
  if (cost.free_tokens != 0) {
    const double base = static_cast<double>(num_rows);
    double gained = 0.0, fees = 0.0;
    best = base / step_cost(cost, num_rows, 0);
    std::vector<int64_t> paths(static_cast<size_t>(rows), 0);
    int64_t rounds = 0;
    take = 0;
    for (int64_t m = 0; m < limit; ++m) {
      const int32_t r = order[m];
      const int64_t at = r * width + keep[r];
      gained += calibrated[at];
      if (tree_ok[r] && parents[at] + 1 != keep[r]) rounds = std::max(rounds, ++paths[r]);
      if (entry != nullptr && keep[r] == 0) fees += entry[r];
      ++keep[r];
      const double rate = (base + gained) / (step_cost(cost, num_rows + m + 1, rounds) + cost.draft_setup + fees);
      if (rate > best) best = rate, take = m + 1;
    }
    std::fill(keep, keep + rows, 0);
  }
  for (int64_t m = 0; m < take; ++m) ++keep[order[m]];
  return best;
}

}  // namespace

void plan_trees(const TreeRows& in, const int32_t* lens, const uint8_t* tree_ok, const double* edges,
                int64_t num_edges, const double* factor, int64_t budget, int64_t num_rows, TreeCost cost,
                const double* entry, TreeRows& out, double* calibrated, int64_t* keep, uint8_t* carries_tree) {
  const int64_t rows = in.rows, width = in.width, bins = num_edges + 1;
  std::vector<int32_t> sizes(static_cast<size_t>(rows));
  std::vector<int8_t> kinds;
  std::vector<int32_t> path;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t n = offer_row(in, r, lens[r], tree_ok[r] != 0, out, kinds, path);
    const int64_t base = r * width;
    for (int32_t i = 0; i < n; ++i) {
      const double raw = out.raw[base + i];
      const double f = factor[out.kinds[base + i] * bins + confidence_bin(edges, num_edges, raw)];
      double c = std::min(1.0, raw * f);
      const int32_t p = out.parents[base + i];
      if (p >= 0) c = std::min(c, calibrated[base + p]);
      calibrated[base + i] = c;
    }
    sizes[r] = n;
    keep[r] = n;
  }
  if (budget >= 0 || cost.free_tokens != 0) {
    if (entry == nullptr || cost.free_tokens == 0) {
      best_prefix(calibrated, width, sizes, tree_ok, out.parents, nullptr, budget, num_rows, cost, keep);
    } else {
      // A row whose expected tokens cannot buy its entry at a rate the step
      // already reaches would only dilute it: first at the draftless rate,
      // then again at the rate the first plan reached, keeping the better.
      const double draftless = static_cast<double>(num_rows) / step_cost(cost, num_rows, 0);
      std::vector<int32_t> first(sizes), second(sizes);
      drop_unpaid(calibrated, width, entry, draftless, first);
      const double rate =
          best_prefix(calibrated, width, first, tree_ok, out.parents, entry, budget, num_rows, cost, keep);
      drop_unpaid(calibrated, width, entry, rate, second);
      if (second != first) {
        std::vector<int64_t> other(static_cast<size_t>(rows));
        if (best_prefix(calibrated, width, second, tree_ok, out.parents, entry, budget, num_rows, cost,
                        other.data()) > rate) {
          std::copy(other.begin(), other.end(), keep);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    bool tree = false;
    const int32_t* par = out.parents + r * width;
    for (int64_t i = 0; tree_ok[r] && !tree && i < keep[r]; ++i) tree = par[i] != i - 1;
    carries_tree[r] = tree;
  }
}

void match_trees(const int64_t* offer_slots, const int64_t* offer_lens, const TreeRows& offers, const int64_t* slots,
                 const int64_t* scheduled, const int64_t* emitted, const int64_t* starts, int64_t rows,
                 std::vector<int64_t>& at, std::vector<int64_t>& verified, uint8_t* hits) {
  if (offers.rows == 0) return;
  std::unordered_map<int64_t, int64_t> where;  // slot -> its offer with a draft
  where.reserve(static_cast<size_t>(offers.rows) * 2);
  for (int64_t d = 0; d < offers.rows; ++d) {
    if (offer_lens[d] > 0) where.emplace(offer_slots[d], d);
  }
  for (int64_t i = 0; i < rows; ++i) {
    if (scheduled[i] <= 0) continue;
    const auto it = where.find(slots[i]);
    if (it == where.end()) continue;
    const int64_t d = it->second, v = std::min(scheduled[i], offer_lens[d]);
    at.push_back(d);
    verified.push_back(v);
    // Walk from the root: each emitted token (then none: -1) moves to the
    // first verified child that carries it.
    const int32_t* tok = offers.tokens + d * offers.width;
    const int32_t* par = offers.parents + d * offers.width;
    int64_t node = -1;
    for (int64_t e = starts[i];; ++e) {
      const int64_t target = e < starts[i + 1] ? emitted[e] : -1;
      int64_t child = -1;
      for (int64_t c = node + 1; c < v; ++c) {
        if (par[c] == node && tok[c] == target) {
          child = c;
          break;
        }
      }
      if (child < 0) break;
      hits[d * offers.width + child] = 1;
      node = child;
    }
  }
}

void observe_trees(CalibrationTables t, const TreeRows& offers, const uint8_t* hits, const int64_t* at,
                   const int64_t* verified, int64_t n, double prior, double half_life) {
  // One step's sums per (kind, bin) cell first, in node order, then added
  // to the tables (as the reference adds one bincount per table).
  const int64_t cells = t.kinds * t.bins;
  std::vector<double> predicted(cells, 0.0), accepted(cells, 0.0);
  std::vector<int64_t> count(cells, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t base = at[i] * offers.width;
    for (int64_t j = 0; j < verified[i]; ++j) {
      const double raw = offers.raw[base + j];
      const int64_t cell = offers.kinds[base + j] * t.bins + confidence_bin(t.edges, t.bins - 1, raw);
      predicted[cell] += raw;
      accepted[cell] += hits[base + j] ? 1.0 : 0.0;
      ++count[cell];
    }
  }
  for (int64_t cell = 0; cell < cells; ++cell) {
    if (count[cell] == 0) continue;
    t.predicted[cell] += predicted[cell];
    t.accepted[cell] += accepted[cell];
    t.nodes[cell] += static_cast<double>(count[cell]);
    if (t.nodes[cell] >= half_life) {
      t.predicted[cell] /= 2;
      t.accepted[cell] /= 2;
      t.nodes[cell] /= 2;
    }
    t.factor[cell] = (t.accepted[cell] + prior) / (t.predicted[cell] + prior);
  }
}

void walk_trees(const TreeRows& trees, const int64_t* lens, const int64_t* targets, int64_t twidth, int32_t* nodes,
                int64_t* counts, int64_t* bonus) {
  for (int64_t d = 0; d < trees.rows; ++d) {
    const int32_t* tok = trees.tokens + d * trees.width;
    const int32_t* par = trees.parents + d * trees.width;
    const int64_t* target = targets + d * twidth;
    int32_t* out = nodes + d * trees.width;
    int64_t node = -1, count = 0;
    for (;;) {
      const int64_t t = target[node + 1];
      int64_t child = -1;
      for (int64_t c = node + 1; c < lens[d]; ++c) {  // a child comes after its parent
        if (par[c] == node && tok[c] == t) {
          child = c;
          break;
        }
      }
      if (child < 0) {
        bonus[d] = t;
        break;
      }
      out[count++] = static_cast<int32_t>(child);
      node = child;
    }
    counts[d] = count;
  }
}

}  // namespace lookahead
