// Stress driver for the native draft index under sanitizers (no Python).
//
// Runs the same random operations (admissions, extensions, syncs from a
// token table, finishes, rewinds, batch drafts with a back-off index, settles, counts) on two index pairs:
// one with the upkeep on its own thread and one inline, with a small corpus
// cap so evictions happen, and batches big enough that draft_rows spreads its
// rows over threads; every step's drafts then go through the tree kernels
// (plan, match against random outcomes, book into calibration tables) as
// the proposer's planner does. Exits 1 on the first difference between
// the two indexes or a kernel result out of its bounds; built
// with -fsanitize=thread, ThreadSanitizer reports any data race between the
// caller, the upkeep thread and the drafting threads; with
// -fsanitize=address,undefined, any memory error. Usage: upkeep_stress SEED STEPS
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "calibration.h"
#include "draft_index.h"
#include "trees.h"

using lookahead::DraftIndex;
using lookahead::DraftIndexConfig;
using lookahead::DraftRow;

namespace {

struct Pair {
  DraftIndex main, backoff;
  Pair(const DraftIndexConfig& m, const DraftIndexConfig& b, bool thread) : main(m, thread), backoff(b, thread) {}
};

// A step's token table: row i holds sequence i's committed tokens (only
// those a sync reads, past what the index has, are written).
struct Table final : lookahead::TokenSource {
  int64_t width = 0;
  std::vector<int32_t> tokens;
  void read(int64_t row, int64_t begin, int64_t end, std::vector<int32_t>& out) const override {
    out.assign(tokens.begin() + row * width + begin, tokens.begin() + row * width + end);
  }
  const void* address(int64_t row, int64_t col) const override { return tokens.data() + row * width + col; }
};

struct Drafts {
  int64_t width = 1;  // row stride of tokens, parents and confidence
  std::vector<int32_t> tokens, parents, lengths;
  std::vector<double> confidence;
};

Drafts draft(Pair& p, const std::vector<int64_t>& sids, const std::vector<int64_t>& budgets, double floor, bool tree,
             int threads) {
  const int64_t rows = static_cast<int64_t>(sids.size());
  Drafts d;
  for (int64_t b : budgets) d.width = std::max(d.width, b);
  const int64_t width = d.width;
  d.tokens.assign(rows * width, 0);
  d.parents.assign(rows * width, -1);
  d.confidence.assign(rows * width, 0.0);
  d.lengths.assign(rows, 0);
  p.main.draft_rows(sids.data(), budgets.data(), rows, width, floor, tree,
                    DraftRow{d.tokens.data(), d.parents.data(), d.confidence.data()}, d.lengths.data(), threads,
                    &p.backoff);
  return d;
}

// The tree kernels on one step's drafts (`d`, chains or trees): plan with a
// random cost model, budget and tree_ok rows, then walk random outcomes of
// the kept drafts and book them. Returns what is wrong, or nullptr.
const char* tree_kernels(const Drafts& d, std::mt19937& rng, std::vector<double>& tables) {
  const int64_t width = d.width;
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int64_t rows = static_cast<int64_t>(d.lengths.size());
  const std::vector<double> edges = {0.05, 0.1, 0.2, 0.4, 0.7};
  const int64_t bins = static_cast<int64_t>(edges.size()) + 1, kinds = 4;
  std::vector<double> factor(kinds * bins);
  for (auto& f : factor) f = 0.25 * uniform(1, 6);
  const int64_t budget = uniform(0, 2) == 0 ? -1 : uniform(0, 40);
  const lookahead::TreeCost cost{uniform(0, 1) * uniform(1, 64), 0.5 * uniform(1, 40), 0.01 * uniform(0, 10),
                                 0.01 * uniform(0, 10), 0.01 * uniform(0, 10)};
  std::vector<uint8_t> tree_ok(rows);
  for (auto& ok : tree_ok) ok = static_cast<uint8_t>(uniform(0, 1));
  std::vector<int32_t> tokens(d.tokens), parents(d.parents), out_tokens(rows * width, 0), out_parents(rows * width, -1);
  std::vector<double> raw(d.confidence), out_raw(rows * width, 0.0), calibrated(rows * width, 0.0);
  std::vector<int8_t> out_kinds(rows * width, 0);
  std::vector<int64_t> keep(rows, -1);
  std::vector<uint8_t> carries(rows, 0);
  std::vector<double> entry(rows);
  for (auto& e : entry) e = 0.05 * uniform(0, 8);
  const lookahead::TreeRows in{tokens.data(), parents.data(), raw.data(), nullptr, rows, width};
  lookahead::TreeRows out{out_tokens.data(), out_parents.data(), out_raw.data(), out_kinds.data(), rows, width};
  lookahead::plan_trees(in, d.lengths.data(), tree_ok.data(), edges.data(), static_cast<int64_t>(edges.size()),
                        factor.data(), budget, rows, cost, uniform(0, 1) ? entry.data() : nullptr, out,
                        calibrated.data(), keep.data(), carries.data());
  int64_t kept = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (keep[r] < 0 || keep[r] > d.lengths[r]) return "plan_trees: a row keeps more than it drafted";
    if (carries[r] && !tree_ok[r]) return "plan_trees: a tree for a row that may not verify one";
    for (int64_t i = 0; i < keep[r]; ++i) {
      const int32_t p = out_parents[r * width + i];
      if (p < -1 || p >= i) return "plan_trees: a parent after its child";
      if (out_kinds[r * width + i] < 0 || out_kinds[r * width + i] >= kinds) return "plan_trees: a kind out of range";
    }
    kept += keep[r];
  }
  if (budget >= 0 && kept > budget) return "plan_trees: more nodes kept than the budget";
  // Offers: row r's kept draft; outcomes: some rows gone, the rest verified in
  // part, emitting the tokens of a random walk down the offer, then a bonus.
  std::vector<int64_t> offer_slots(rows), slots, scheduled, emitted, starts = {0};
  for (int64_t r = 0; r < rows; ++r) {
    offer_slots[r] = r;
    if (uniform(0, 4) == 0) continue;
    slots.push_back(r);
    scheduled.push_back(uniform(0, static_cast<int>(keep[r]) + 1));
    int64_t node = -1;
    while (uniform(0, 3) != 0) {
      std::vector<int64_t> kids;
      for (int64_t c = node + 1; c < keep[r]; ++c) {
        if (out_parents[r * width + c] == node) kids.push_back(c);
      }
      if (kids.empty()) break;
      node = kids[uniform(0, static_cast<int>(kids.size()) - 1)];
      emitted.push_back(out_tokens[r * width + node]);
    }
    emitted.push_back(uniform(0, 50));
    starts.push_back(static_cast<int64_t>(emitted.size()));
  }
  std::vector<int64_t> at, verified;
  std::vector<uint8_t> hits(rows * width, 0);
  lookahead::match_trees(offer_slots.data(), keep.data(), out, slots.data(), scheduled.data(), emitted.data(),
                         starts.data(), static_cast<int64_t>(slots.size()), at, verified, hits.data());
  for (size_t i = 0; i < at.size(); ++i) {
    if (at[i] < 0 || at[i] >= rows || verified[i] > keep[at[i]] || verified[i] <= 0) {
      return "match_trees: a booking out of its offer";
    }
    for (int64_t j = verified[i]; j < width; ++j) {
      if (hits[at[i] * width + j]) return "match_trees: a hit past what was verified";
    }
  }
  tables.resize(4 * kinds * bins, 0.0);
  lookahead::CalibrationTables t{tables.data(), tables.data() + kinds * bins, tables.data() + 2 * kinds * bins,
                                 tables.data() + 3 * kinds * bins, kinds, bins, edges.data()};
  lookahead::observe_trees(t, out, hits.data(), at.data(), verified.data(), static_cast<int64_t>(at.size()), 1.0,
                           64.0);
  for (int64_t c = 0; c < kinds * bins; ++c) {
    if (t.accepted[c] > t.nodes[c] + 1e-9 || t.nodes[c] < 0) return "observe_trees: more accepted than booked";
  }
  // Greedy walks of the kept drafts (tree verification): random targets, one row more than nodes.
  std::vector<int64_t> targets(rows * (width + 1));
  for (int64_t& x : targets) x = uniform(0, 50);
  std::vector<int32_t> walked(rows * width, -1);
  std::vector<int64_t> counts(rows), bonus(rows);
  lookahead::walk_trees(out, keep.data(), targets.data(), width + 1, walked.data(), counts.data(), bonus.data());
  for (int64_t r = 0; r < rows; ++r) {
    int64_t node = -1;
    for (int64_t i = 0; i < counts[r]; ++i) {
      const int32_t c = walked[r * width + i];
      if (c <= node || c >= keep[r] || out_parents[r * width + c] != node) return "walk_trees: not a path of the tree";
      node = c;
    }
    if (bonus[r] != targets[r * (width + 1) + node + 1]) return "walk_trees: the bonus is not the last row's target";
  }
  return nullptr;
}

int fail(const char* what, int step) {
  std::fprintf(stderr, "failed at step %d: %s\n", step, what);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s SEED STEPS\n", argv[0]);
    return 2;
  }
  const unsigned seed = static_cast<unsigned>(std::atoi(argv[1]));
  const int steps = std::atoi(argv[2]);
  DraftIndexConfig main_cfg;
  main_cfg.ngram = 2;
  main_cfg.max_occurrences = 8;
  main_cfg.corpus_bytes = 400000;  // some finished outputs held, most evicted
  DraftIndexConfig back_cfg = main_cfg;
  back_cfg.ngram = 1;
  Pair threaded(main_cfg, back_cfg, true), inline_(main_cfg, back_cfg, false);

  // The same operation on every index: both pairs' main and back-off.
  auto each = [&](auto&& op) {
    for (DraftIndex* index : {&threaded.main, &threaded.backoff, &inline_.main, &inline_.backoff}) op(*index);
  };

  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // Text from a few phrases, so that keys recur within and across sequences.
  std::vector<std::vector<int32_t>> phrases(12);
  for (auto& ph : phrases) {
    ph.resize(uniform(2, 8));
    for (auto& t : ph) t = uniform(0, 40);
  }
  auto text = [&](int n) {
    std::vector<int32_t> out;
    while (static_cast<int>(out.size()) < n) {
      const auto& ph = phrases[uniform(0, 11)];
      out.insert(out.end(), ph.begin(), ph.end());
      if (uniform(0, 4) == 0) out.push_back(uniform(0, 60));
    }
    out.resize(n);
    return out;
  };

  std::vector<double> tables;  // the chain kernels' calibration tables, across steps
  std::vector<int64_t> running;
  std::vector<int64_t> lengths;  // per running sequence
  int64_t next_sid = 0;
  for (int step = 0; step < steps; ++step) {
    const int op = uniform(0, 99);
    if (running.size() < 4 || (op < 12 && running.size() < 160)) {
      const int n = uniform(1, 300);
      const auto t = text(n);
      const int64_t prompt = uniform(0, n);
      each([&](DraftIndex& d) { d.add(next_sid, t.data(), t.size(), prompt); });
      running.push_back(next_sid++);
      lengths.push_back(n);
    } else if (op < 20) {
      const int i = uniform(0, static_cast<int>(running.size()) - 1);
      each([&](DraftIndex& d) { d.finish(running[i]); });
      running.erase(running.begin() + i);
      lengths.erase(lengths.begin() + i);
    } else if (op < 22) {
      const int i = uniform(0, static_cast<int>(running.size()) - 1);
      const int64_t keep = uniform(0, static_cast<int>(lengths[i]));
      each([&](DraftIndex& d) { d.rewind(running[i], keep); });
      lengths[i] = keep;
    } else if (op < 24) {
      each([&](DraftIndex& d) { d.settle(); });
    } else if (op < 27) {
      if (threaded.main.corpus_tokens() != inline_.main.corpus_tokens()) return fail("corpus_tokens", step);
      if (threaded.main.corpus_bytes() != inline_.main.corpus_bytes()) return fail("corpus_bytes", step);
      if (threaded.main.num_sequences() != inline_.main.num_sequences()) return fail("num_sequences", step);
      if (threaded.main.num_live() != inline_.main.num_live()) return fail("num_live", step);
      (void)threaded.main.memory_bytes();
    } else {
      // An engine step: every running sequence gains 1-4 tokens, one at a
      // time or all through one sync from a token table (which also rewinds
      // a few by up to 3 tokens), then the batch drafts.
      if (uniform(0, 1) == 0) {
        for (size_t i = 0; i < running.size(); ++i) {
          const auto t = text(uniform(1, 4));
          each([&](DraftIndex& d) { d.extend(running[i], t.data(), t.size()); });
          lengths[i] += static_cast<int64_t>(t.size());
        }
      } else {
        Table table;
        for (const int64_t n : lengths) table.width = std::max(table.width, n + 4);
        table.tokens.assign(running.size() * table.width, -1);
        std::vector<int64_t> rows(running.size()), num(running.size()), prompts(running.size(), 0);
        for (size_t i = 0; i < running.size(); ++i) {
          rows[i] = static_cast<int64_t>(running.size() - 1 - i);  // rows in another order than sequences
          if (uniform(0, 19) == 0) {
            num[i] = std::max<int64_t>(0, lengths[i] - uniform(0, 3));
          } else {
            const auto t = text(uniform(1, 4));
            std::copy(t.begin(), t.end(), table.tokens.begin() + rows[i] * table.width + lengths[i]);
            num[i] = lengths[i] + static_cast<int64_t>(t.size());
          }
          lengths[i] = num[i];
        }
        each([&](DraftIndex& d) {
          d.sync(running.data(), rows.data(), num.data(), prompts.data(), static_cast<int64_t>(running.size()), table);
        });
      }
      std::vector<int64_t> budgets(running.size());
      for (auto& b : budgets) b = uniform(0, 12);
      const double floor = uniform(0, 3) == 0 ? 0.0 : 0.02 * uniform(1, 5);
      const bool tree = uniform(0, 3) == 0;
      const int threads = uniform(1, 4);
      const Drafts a = draft(threaded, running, budgets, floor, tree, threads);
      const Drafts b = draft(inline_, running, budgets, floor, tree, 1);
      if (a.lengths != b.lengths || a.tokens != b.tokens || a.parents != b.parents) return fail("drafts", step);
      if (std::memcmp(a.confidence.data(), b.confidence.data(), a.confidence.size() * sizeof(double)) != 0) {
        return fail("confidences", step);
      }
      if (const char* wrong = tree_kernels(a, rng, tables)) return fail(wrong, step);
      if (uniform(0, 3) == 0) {
        // The same batch again, right away: it drafts while nothing but the
        // upkeep the first call started has happened in between.
        const Drafts again = draft(threaded, running, budgets, floor, tree, threads);
        const Drafts expect = draft(inline_, running, budgets, floor, tree, 1);
        if (again.lengths != expect.lengths || again.tokens != expect.tokens) return fail("drafts again", step);
      }
    }
  }
  if (threaded.main.corpus_tokens() != inline_.main.corpus_tokens()) return fail("final corpus_tokens", steps);
  std::printf("ok: %d steps, %lld sequences, %zu running, %zu held, corpus charge %lld bytes\n", steps,
              static_cast<long long>(next_sid), running.size(), threaded.main.num_sequences(),
              static_cast<long long>(threaded.main.corpus_bytes()));
  return 0;
}
