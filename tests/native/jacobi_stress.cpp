// Random steps on the native Jacobi table (csrc/draft_index/jacobi.h), no
// Python: admissions, growth, rewinds, finishes, windows that open or not,
// pool rows, choices, updates and credits, for several window shapes; every
// answer checked against its bounds (window sizes, pools at most `guesses`
// continuations a key, draft rows inside their width with parents first,
// chosen windows riding and distinct). Exits non-zero on the first
// violation. Built with AddressSanitizer + UBSan by
// tests/core/test_draft_index_sanitizers.py.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "jacobi.h"

namespace {

int fail(const char* what, long step) {
  std::printf("violation at step %ld: %s\n", step, what);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const unsigned seed = argc > 1 ? static_cast<unsigned>(std::atoi(argv[1])) : 1;
  const long steps = argc > 2 ? std::atol(argv[2]) : 2000;
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int shapes[][3] = {{3, 2, 2}, {3, 3, 2}, {4, 3, 3}, {5, 4, 2}, {2, 5, 4}};
  for (const auto& shape : shapes) {
    lookahead::JacobiTable table(shape[0], shape[1], shape[2]);
    const int window = shape[0], length = shape[1] - 1, guesses = shape[2];
    const int64_t nodes = table.num_nodes();
    std::map<int64_t, int64_t> live;  // slot -> committed tokens
    int64_t next_slot = 0;
    const int vocab = uniform(2, 40);
    for (long step = 0; step < steps / 5; ++step) {
      while (static_cast<int>(live.size()) < uniform(1, 24)) live[next_slot++] = uniform(1, 60);
      for (auto it = live.begin(); it != live.end();) {
        const int op = uniform(0, 9);
        if (op == 0) {
          table.finish(it->first);
          it = live.erase(it);
          continue;
        }
        it->second = op == 1 ? std::max<int64_t>(1, it->second - uniform(1, 8)) : it->second + uniform(0, 4);
        ++it;
      }
      std::vector<int64_t> slots, num;
      for (const auto& [slot, n] : live) slots.push_back(slot), num.push_back(n);
      const int64_t rows = static_cast<int64_t>(slots.size());
      std::vector<int64_t> stale;
      table.track(slots.data(), num.data(), rows, stale);
      for (int64_t i : stale) {
        if (i < 0 || i >= rows) return fail("stale row out of range", step);
        std::vector<int32_t> prompt(static_cast<size_t>(std::min<int64_t>(num[i], uniform(0, 30))));
        for (auto& t : prompt) t = uniform(0, vocab - 1);
        table.open(slots[i], prompt.data(), static_cast<int64_t>(prompt.size()), num[i], uniform(0, 3) > 0);
      }
      std::vector<int64_t> lasts(rows);
      std::vector<uint8_t> full(rows);
      for (int64_t i = 0; i < rows; ++i) lasts[i] = uniform(0, vocab - 1), full[i] = uniform(0, 3) > 0;
      std::vector<const std::vector<int32_t>*> found;
      const int64_t widest = table.ride_and_find(slots.data(), lasts.data(), full.data(), rows, found);
      if (widest > guesses) return fail("more continuations than guesses", step);
      const int64_t width = std::max<int64_t>(1, widest * length);
      std::vector<int32_t> tok(rows * width, 0), par(rows * width, -1);
      std::vector<double> wt(rows * width, 0.0), cf(rows * width, 0.0);
      std::vector<int64_t> lens(rows, 0);
      table.pool_write(found, width, tok.data(), par.data(), wt.data(), cf.data(), lens.data());
      for (int64_t i = 0; i < rows; ++i) {
        if (lens[i] < 0 || lens[i] > width || lens[i] % length) return fail("pool row length", step);
        for (int64_t j = 0; j < lens[i]; ++j) {
          const int32_t p = par[i * width + j];
          if (p < -1 || p >= j || (j % length == 0) != (p == -1)) return fail("pool row parents", step);
          if (!(cf[i * width + j] > 0.0 && cf[i * width + j] <= 0.5)) return fail("pool row confidence", step);
        }
      }
      std::vector<int64_t> from(rows);
      for (int64_t i = 0; i < rows; ++i) from[i] = lens[i] / 2;
      table.set_pool_from(slots.data(), from.data(), rows);
      std::vector<double> fees(rows), costs(rows + 1);
      for (int64_t i = 0; i < rows; ++i) fees[i] = uniform(0, 3) * 0.1;
      for (int64_t m = 0; m <= rows; ++m) costs[m] = 1.0 + 0.05 * uniform(0, 4) + 0.2 * static_cast<double>(m);
      std::vector<int64_t> chosen;
      table.choose(slots.data(), fees.data(), costs.data(), rows, {0.04, 0.0, 1.0 + uniform(0, 30)}, chosen);
      std::set<int64_t> seen;
      std::vector<int64_t> went;
      for (int64_t i : chosen) {
        const lookahead::JacobiSlot* s = table.find(slots.at(i));
        if (s == nullptr || !s->windowed || s->x0 < 0 || !seen.insert(i).second) return fail("chosen window", step);
        went.push_back(slots[i]);
      }
      std::vector<int32_t> fresh(went.size() * window);
      for (auto& t : fresh) t = uniform(0, vocab - 1);
      std::vector<int64_t> accepted, starts{0};
      for (size_t c = 0; c < went.size(); ++c) {
        for (int k = uniform(0, 4); k > 0; --k) accepted.push_back(uniform(0, 10));
        starts.push_back(static_cast<int64_t>(accepted.size()));
      }
      const int64_t added = table.update(went.data(), fresh.data(), accepted.data(), starts.data(),
                                         static_cast<int64_t>(went.size()));
      if (added != static_cast<int64_t>(went.size()) * window) return fail("n-grams added", step);
      for (const auto& [slot, n] : live) {
        lookahead::JacobiSlot* s = table.find(slot);
        if (s == nullptr) continue;
        if (uniform(0, 9) == 0 && s->windowed) table.credit(*s, uniform(0, 2));
        if (s->windowed && static_cast<int64_t>(s->window.size()) != nodes) return fail("window size", step);
        int64_t entries = 0;
        for (const auto& [key, conts] : s->pool) {
          const int64_t count = static_cast<int64_t>(conts.size()) / length;
          if (conts.size() % length || count > guesses) return fail("pool key", step);
          entries += count;
          if (table.pool_get(*s, key, -1).size() != static_cast<size_t>(count)) return fail("pool_get", step);
        }
        if (entries != s->pool_size) return fail("pool size", step);
        if (s->probe_every < lookahead::kProbeEvery || s->probe_every > lookahead::kMaxProbeEvery) {
          return fail("probe interval", step);
        }
      }
    }
    if (table.memory_bytes() <= 0) return fail("memory estimate", steps);
  }
  std::printf("ok: %ld steps\n", steps);
  return 0;
}
