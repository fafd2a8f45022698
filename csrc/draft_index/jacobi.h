// JacobiTable: every request's Jacobi window and n-gram pool, natively, by
// the caller's slot. No Python here (bindings.cpp).
//
// Semantics are those of the pure-Python reference
// lab/lookahead_lab/reference/jacobi.py (lookahead_vllm/core/jacobi.py's
// docstring defines the window, its slide, the pool and the window policy);
// tests hold the two to identical windows, pools, draft rows, choices and
// yields. A slot's record:
//
//   length    committed tokens seen at its last step (fewer: a rewind, and
//             the window is opened again from the prompt);
//   window    num_nodes tokens in plan order (level 0's columns 1..W-1, then
//             levels 1..N-2), or none (the request may not verify a tree);
//   pool      first token -> at most `guesses` continuations of N-1 tokens,
//             least recently seen first;
//   x0        the root the window rides on this step (-1: it does not);
//   pool_from the first node of this step's offer that came from the pool;
//   policy    yield_est, steps_without, probe_every, probing (wants_window).
//
// Not thread-safe: callers serialize (the bindings hold the GIL).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "token_source.h"

namespace lookahead {

// core/jacobi.py's constants.
constexpr double kPoolConfidence = 0.5;
constexpr double kYieldPrior = 1.0;
constexpr double kYieldAlpha = 0.25;
constexpr int64_t kProbeEvery = 32;
constexpr int64_t kMaxProbeEvery = 512;

struct JacobiSlot {
  int64_t length = 0;
  bool windowed = false;
  std::vector<int32_t> window;
  std::unordered_map<int32_t, std::vector<int32_t>> pool;
  int64_t pool_size = 0;
  int32_t x0 = -1;
  int64_t pool_from = 0;
  double yield_est = kYieldPrior;
  int64_t steps_without = 0;
  int64_t probe_every = kProbeEvery;
  bool probing = false;
};

// The step the windows join, before any window (what choose prices them against).
struct WindowStep {
  double setup;  // the draft setup still unpaid
  double fees;   // entry fees the step's drafted rows pay
  double gain;   // tokens the step is expected to emit
};

class JacobiTable {
 public:
  JacobiTable(int window, int ngram, int guesses);

  int window() const { return window_; }
  int ngram() const { return ngram_; }
  int guesses() const { return guesses_; }
  int64_t num_nodes() const { return int64_t{window_} * (ngram_ - 1) - 1; }
  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  int64_t memory_bytes() const;

  // What new windows start from: the last credited window's yield and probe
  // interval (a workload where windows do not pay stops probing them anew).
  double prior_yield() const { return prior_yield_; }
  int64_t prior_probe_every() const { return prior_probe_every_; }
  void set_prior(double yield_est, int64_t probe_every);

  // A step's rows: slots[i] has num_tokens[i] committed tokens. Every row's
  // window leaves the step (x0 = -1) until ride_and_find lets it ride again.
  // Rows whose slot has no record, or fewer tokens than last step, are
  // appended to `stale` (the caller opens them: `open`); every other row's
  // length becomes num_tokens[i].
  void track(const int64_t* slots, const int64_t* num_tokens, int64_t rows, std::vector<int64_t>& stale);
  // Slot `slot` (re)starts at `length` committed tokens: a fresh window from
  // `prompt[0:n]` (windowed) or none, an empty pool, the policy at the prior.
  void open(int64_t slot, const int32_t* prompt, int64_t n, int64_t length, bool windowed);
  void finish(int64_t slot) { slots_.erase(slot); }

  // A windowed slot's window rides this step at x0 = lasts[i] where full[i]
  // (choose decides whether it goes out), else not; row i's pool
  // continuations keyed by lasts[i] go to found[i] (null: the slot has no
  // window, or the key none). Returns the most continuations a row has.
  int64_t ride_and_find(const int64_t* slots, const int64_t* lasts, const uint8_t* full, int64_t rows,
                    std::vector<const std::vector<int32_t>*>& found);
  // found[i]'s continuations (most recently seen first) as branches from the
  // root, node at depth d of confidence and weight kPoolConfidence^d, into
  // row i of tokens/parents/weights/conf [rows, width] (cells past a row's
  // length untouched) and lens[i]. Returns the branches written.
  int64_t pool_write(const std::vector<const std::vector<int32_t>*>& found, int64_t width, int32_t* tokens,
                     int32_t* parents, double* weights, double* conf, int64_t* lens) const;
  void set_pool_from(const int64_t* slots, const int64_t* pool_from, int64_t rows);

  // The windows that go out this step among rows `slots[i]` (those with a
  // window riding this step), most expected yield first, each asked
  // wants_window with what it must yield given those before it: `costs[m]`
  // the step's cost with m windows (m = 0..rows), fees[i] the entry row i
  // pays. Appends the chosen rows, in the order they join, to `chosen`.
  void choose(const int64_t* slots, const double* fees, const double* costs, int64_t rows, WindowStep step,
              std::vector<int64_t>& chosen);

  // Row i's window got its new tokens new_tokens[i * window, ...] and the
  // accepted nodes nodes[starts[i]:starts[i + 1]]: slide, fill the pool,
  // credit the pool nodes accepted. Returns the n-grams added.
  int64_t update(const int64_t* slots, const int32_t* new_tokens, const int64_t* nodes, const int64_t* starts,
                 int64_t rows);

  // One slot, for tests and tools (null: no record).
  const JacobiSlot* find(int64_t slot) const;
  JacobiSlot* find(int64_t slot);
  // Key's continuations, most recently seen first, at most `limit`.
  std::vector<std::vector<int32_t>> pool_get(const JacobiSlot& s, int32_t key, int64_t limit) const;
  void credit(JacobiSlot& s, int64_t pool_tokens);

 private:
  bool wants_window(JacobiSlot& s, double need) const;
  void extend_pool(JacobiSlot& s, const int32_t* gram);

  int window_, ngram_, guesses_;
  double prior_yield_ = kYieldPrior;
  int64_t prior_probe_every_ = kProbeEvery;
  std::unordered_map<int64_t, JacobiSlot> slots_;
};

// The window's fill from a prompt: node j (plan order) is
// prompt[mix(seed + j + 1) % n] (0 for an empty prompt), seed the prompt's
// FNV-1a hash over its tokens (each as 4 little-endian bytes) and mix
// splitmix64's finalizer: rebuilt identically for a recomputed request.
uint64_t prompt_seed(const int32_t* prompt, int64_t n);
uint64_t splitmix64(uint64_t x);

}  // namespace lookahead
