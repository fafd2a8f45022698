// JacobiTable (jacobi.h); reference lab/lookahead_lab/reference/jacobi.py.
#include "jacobi.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace lookahead {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

uint64_t prompt_seed(const int32_t* prompt, int64_t n) {
  uint64_t h = 0xCBF29CE484222325ULL;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t t = static_cast<uint32_t>(prompt[i]);
    for (int b = 0; b < 4; ++b) {
      h ^= (t >> (8 * b)) & 0xFFu;
      h *= 0x100000001B3ULL;
    }
  }
  return h;
}

JacobiTable::JacobiTable(int window, int ngram, int guesses) : window_(window), ngram_(ngram), guesses_(guesses) {
  if (window < 1 || ngram < 2 || guesses < 1) {
    throw std::invalid_argument("JacobiTable(window=" + std::to_string(window) + ", ngram=" + std::to_string(ngram) +
                                ", guesses=" + std::to_string(guesses) +
                                "): needs window >= 1, ngram >= 2, guesses >= 1");
  }
}

int64_t JacobiTable::memory_bytes() const {
  int64_t total = static_cast<int64_t>(slots_.bucket_count() * sizeof(void*));
  for (const auto& kv : slots_) {
    const JacobiSlot& s = kv.second;
    total += static_cast<int64_t>(sizeof(kv) + 2 * sizeof(void*) + s.window.capacity() * sizeof(int32_t) +
                                  s.pool.bucket_count() * sizeof(void*));
    for (const auto& entry : s.pool) {
      total += static_cast<int64_t>(sizeof(entry) + 2 * sizeof(void*) + entry.second.capacity() * sizeof(int32_t));
    }
  }
  return total;
}

void JacobiTable::set_prior(double yield_est, int64_t probe_every) {
  prior_yield_ = yield_est;
  prior_probe_every_ = probe_every;
}

const JacobiSlot* JacobiTable::find(int64_t slot) const {
  auto it = slots_.find(slot);
  return it == slots_.end() ? nullptr : &it->second;
}

JacobiSlot* JacobiTable::find(int64_t slot) {
  auto it = slots_.find(slot);
  return it == slots_.end() ? nullptr : &it->second;
}

void JacobiTable::track(const int64_t* slots, const int64_t* num_tokens, int64_t rows, std::vector<int64_t>& stale) {
  for (int64_t i = 0; i < rows; ++i) {
    JacobiSlot* s = find(slots[i]);
    if (s != nullptr) s->x0 = -1;  // the window leaves the step until ride_and_find lets it ride
    if (s == nullptr || num_tokens[i] < s->length) {
      stale.push_back(i);
      continue;
    }
    s->length = num_tokens[i];
  }
}

void JacobiTable::open(int64_t slot, const int32_t* prompt, int64_t n, int64_t length, bool windowed) {
  JacobiSlot& s = slots_[slot];
  s = JacobiSlot();
  s.length = length;
  s.yield_est = prior_yield_;
  s.probe_every = prior_probe_every_;
  s.windowed = windowed;
  if (!windowed) return;
  const int64_t nodes = num_nodes();
  s.window.resize(nodes);
  const uint64_t seed = prompt_seed(prompt, n);
  for (int64_t j = 0; j < nodes; ++j) {
    s.window[j] = n > 0 ? prompt[splitmix64(seed + static_cast<uint64_t>(j) + 1) % static_cast<uint64_t>(n)] : 0;
  }
}

int64_t JacobiTable::ride_and_find(const int64_t* slots, const int64_t* lasts, const uint8_t* full, int64_t rows,
                                   std::vector<const std::vector<int32_t>*>& found) {
  found.assign(rows, nullptr);
  const int64_t length = ngram_ - 1;
  int64_t widest = 0;
  for (int64_t i = 0; i < rows; ++i) {
    JacobiSlot* s = find(slots[i]);
    if (s == nullptr || !s->windowed) continue;
    const int32_t last = static_cast<int32_t>(lasts[i]);
    s->x0 = full[i] ? last : -1;
    auto it = s->pool.find(last);
    if (it == s->pool.end() || it->second.empty()) continue;
    found[i] = &it->second;
    widest = std::max(widest, static_cast<int64_t>(it->second.size()) / length);
  }
  return widest;
}

int64_t JacobiTable::pool_write(const std::vector<const std::vector<int32_t>*>& found, int64_t width,
                                int32_t* tokens, int32_t* parents, double* weights, double* conf,
                                int64_t* lens) const {
  const int64_t length = ngram_ - 1;
  int64_t branches = 0;
  for (size_t i = 0; i < found.size(); ++i) {
    const int64_t row = static_cast<int64_t>(i);
    if (found[i] == nullptr) {
      lens[row] = 0;
      continue;
    }
    const std::vector<int32_t>& conts = *found[i];
    const int64_t count = static_cast<int64_t>(conts.size()) / length;
    int64_t col = 0;
    for (int64_t c = count - 1; c >= 0; --c) {  // most recently seen (last) first
      for (int64_t d = 0; d < length; ++d, ++col) {
        const int64_t at = row * width + col;
        tokens[at] = conts[c * length + d];
        parents[at] = d == 0 ? -1 : static_cast<int32_t>(col - 1);
        weights[at] = conf[at] = std::pow(kPoolConfidence, static_cast<double>(d + 1));
      }
    }
    lens[row] = col;
    branches += count;
  }
  return branches;
}

void JacobiTable::set_pool_from(const int64_t* slots, const int64_t* pool_from, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    JacobiSlot* s = find(slots[i]);
    if (s != nullptr && s->windowed) s->pool_from = pool_from[i];
  }
}

bool JacobiTable::wants_window(JacobiSlot& s, double need) const {
  const bool pays = s.yield_est >= need;
  if (pays || s.steps_without >= s.probe_every) {
    s.steps_without = 0;
    s.probing = !pays;
    return true;
  }
  ++s.steps_without;
  return false;
}

void JacobiTable::choose(const int64_t* slots, const double* fees, const double* costs, int64_t rows,
                         WindowStep step, std::vector<int64_t>& chosen) {
  std::vector<std::pair<int64_t, JacobiSlot*>> riding;
  for (int64_t i = 0; i < rows; ++i) {
    JacobiSlot* s = find(slots[i]);
    if (s != nullptr && s->windowed && s->x0 >= 0) riding.emplace_back(i, s);
  }
  std::stable_sort(riding.begin(), riding.end(),
                   [](const auto& a, const auto& b) { return a.second->yield_est > b.second->yield_est; });
  double setup = step.setup, paid = step.fees, gain = step.gain;
  for (const auto& [i, s] : riding) {
    const size_t k = chosen.size();
    const double need = gain * ((costs[k + 1] + setup + paid + fees[i]) / (costs[k] + paid) - 1.0);
    if (wants_window(*s, need)) {
      chosen.push_back(i);
      setup = 0.0;
      paid = paid + fees[i];
      gain = gain + s->yield_est;
    }
  }
}

void JacobiTable::extend_pool(JacobiSlot& s, const int32_t* gram) {
  const int64_t length = ngram_ - 1;
  std::vector<int32_t>& conts = s.pool[gram[0]];
  const int32_t* cont = gram + 1;
  const int64_t count = static_cast<int64_t>(conts.size()) / length;
  int64_t at = -1;
  for (int64_t c = 0; c < count && at < 0; ++c) {
    if (std::equal(cont, cont + length, conts.begin() + c * length)) at = c;
  }
  if (at >= 0) {  // seen again: it becomes the most recent
    conts.erase(conts.begin() + at * length, conts.begin() + (at + 1) * length);
  } else if (count >= guesses_) {  // full: the least recently seen goes
    conts.erase(conts.begin(), conts.begin() + length);
  } else {
    ++s.pool_size;
  }
  conts.insert(conts.end(), cont, cont + length);
}

void JacobiTable::credit(JacobiSlot& s, int64_t pool_tokens) {
  s.yield_est += kYieldAlpha * (static_cast<double>(pool_tokens) - s.yield_est);
  if (pool_tokens) {
    s.probe_every = kProbeEvery;
  } else if (s.probing) {
    s.probe_every = std::min(2 * s.probe_every, kMaxProbeEvery);
  }
  s.probing = false;
}

std::vector<std::vector<int32_t>> JacobiTable::pool_get(const JacobiSlot& s, int32_t key, int64_t limit) const {
  std::vector<std::vector<int32_t>> out;
  auto it = s.pool.find(key);
  if (it == s.pool.end()) return out;
  const int64_t length = ngram_ - 1;
  const std::vector<int32_t>& conts = it->second;
  for (int64_t c = static_cast<int64_t>(conts.size()) / length - 1; c >= 0; --c) {
    if (limit >= 0 && static_cast<int64_t>(out.size()) >= limit) break;
    out.emplace_back(conts.begin() + c * length, conts.begin() + (c + 1) * length);
  }
  return out;
}

int64_t JacobiTable::update(const int64_t* slots, const int32_t* new_tokens, const int64_t* nodes,
                            const int64_t* starts, int64_t rows) {
  const int64_t w = window_, levels = ngram_ - 1;  // levels 0..N-2, then the new tokens
  std::vector<int32_t> gram(ngram_), slid(num_nodes());
  int64_t added = 0;
  for (int64_t i = 0; i < rows; ++i) {
    JacobiSlot* s = find(slots[i]);
    if (s == nullptr || !s->windowed) continue;
    const int32_t* fresh = new_tokens + i * w;
    const std::vector<int32_t>& win = s->window;
    // Node (level, col) in plan order: level 0 holds columns 1..W-1.
    auto at = [&](int64_t level, int64_t col) -> int32_t {
      if (level == 0) return col == 0 ? s->x0 : win[col - 1];
      return win[w - 1 + (level - 1) * w + col];
    };
    for (int64_t col = 0; col < w; ++col) {  // column col's n-gram, top level down, then its new token
      for (int64_t level = 0; level < levels; ++level) gram[level] = at(level, col);
      gram[levels] = fresh[col];
      extend_pool(*s, gram.data());
    }
    added += w;
    // The slide: level 1 without its first column becomes level 0, levels 2.. move up, the new tokens last.
    int64_t o = 0;
    for (int64_t level = 1; level < levels; ++level) {
      for (int64_t col = level == 1 ? 1 : 0; col < w; ++col) slid[o++] = at(level, col);
    }
    for (int64_t col = levels == 1 ? 1 : 0; col < w; ++col) slid[o++] = fresh[col];
    s->window.assign(slid.begin(), slid.end());
    int64_t accepted = 0;
    for (int64_t j = starts[i]; j < starts[i + 1]; ++j) accepted += nodes[j] >= s->pool_from;
    credit(*s, accepted);
    set_prior(s->yield_est, s->probe_every);
  }
  return added;
}

}  // namespace lookahead
