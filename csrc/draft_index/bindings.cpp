// lookahead_vllm._draft_index: Python bindings of the native DraftIndex and
// of the tree kernels (trees.h).
//
// Checks arguments, converts them, and calls the core; sync, draft_batch and
// settle run without the GIL. The methods that settle in the reference
// settle the core first (see its `upkeep`). A mutex per index serializes
// calls (the GIL no longer does while sync/draft_batch run). The tree
// kernels keep the GIL: they run for microseconds and write into arrays
// their Python caller owns.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "calibration.h"
#include "draft_index.h"
#include "jacobi.h"
#include "token_trie.h"
#include "trees.h"

namespace py = pybind11;
using lookahead::DraftIndex;
using lookahead::DraftIndexConfig;
using lookahead::DraftRow;

namespace {

using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct BoundIndex {
  BoundIndex(const DraftIndexConfig& config, bool upkeep_thread) : core(config, upkeep_thread) {}
  DraftIndex core;
  std::mutex mu;
};

// DraftIndexConfig's checks and messages: an int (not a bool) in [lo, hi].
int64_t config_int(const char* name, py::handle value, int64_t lo, int64_t hi) {
  long long v = 0;
  bool ok = false;
  if (PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr())) {
    int overflow = 0;
    v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    ok = overflow == 0 && lo <= v && v <= hi;
  }
  if (!ok) {
    throw py::value_error(std::string(name) + "=" + std::string(py::repr(value)) + ": must be an int in [" +
                          std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return v;
}

std::unique_ptr<BoundIndex> make_index(py::handle ngram, py::handle max_match, py::handle max_occurrences,
                                       py::handle max_candidates, py::handle corpus_bytes, bool upkeep_thread) {
  DraftIndexConfig c;
  c.ngram = static_cast<int>(config_int("ngram", ngram, 1, 4));
  c.max_match = static_cast<int>(config_int("max_match", max_match, 1, 1 << 16));
  c.max_occurrences = static_cast<int>(config_int("max_occurrences", max_occurrences, 1, 1024));
  c.max_candidates = static_cast<int>(config_int("max_candidates", max_candidates, 1, 1024));
  c.corpus_bytes = config_int("corpus_bytes", corpus_bytes, 0, int64_t{1} << 40);
  if (c.max_match < c.ngram) {
    throw py::value_error("max_match=" + std::to_string(c.max_match) + ": must be >= ngram (" +
                          std::to_string(c.ngram) + ")");
  }
  return std::make_unique<BoundIndex>(c, upkeep_thread);
}

// The reference's check_partition (its message).
int64_t check_partition(int64_t p) {
  if (p < lookahead::kPrivate || p > lookahead::kMaxPartition) {
    throw py::value_error("partition=" + std::to_string(p) + ": must be an int in [" +
                          std::to_string(lookahead::kPrivate) + ", " + std::to_string(lookahead::kMaxPartition) + "]");
  }
  return p;
}

int32_t checked_token(int64_t t) {
  if (t < INT32_MIN || t > INT32_MAX) throw py::value_error("token " + std::to_string(t) + " is outside int32");
  return static_cast<int32_t>(t);
}

// A 1-D sequence of ints (list, tuple, array) as int64.
IntArray int_array(py::handle obj, const char* name) {
  IntArray arr = IntArray::ensure(obj);
  if (!arr || arr.ndim() != 1) throw py::type_error(std::string(name) + " must be a 1-D sequence of ints");
  return arr;
}

std::vector<int32_t> token_vector(py::handle obj) {
  IntArray arr = int_array(obj, "tokens");
  std::vector<int32_t> out(arr.shape(0));
  const int64_t* p = arr.data();
  for (size_t i = 0; i < out.size(); ++i) out[i] = checked_token(p[i]);
  return out;
}

// Whether the dtype's byte order is this machine's (numpy's dtype.isnative, without the Python call:
// '=' native, '|' not applicable, '<' / '>' explicit).
bool native_order(const py::dtype& dt) {
  const char order = dt.byteorder();
  const uint16_t probe = 1;
  const bool little = *reinterpret_cast<const uint8_t*>(&probe) == 1;
  return order == '=' || order == '|' || order == (little ? '<' : '>');
}

// token_ids [max_rows, max_len], int32 or int64, any strides: read in place.
struct TokenTable final : lookahead::TokenSource {
  explicit TokenTable(const py::array& a) {
    const py::dtype dt = a.dtype();
    if (a.ndim() != 2 || dt.kind() != 'i' || (dt.itemsize() != 4 && dt.itemsize() != 8) ||
        !native_order(dt)) {
      throw py::type_error("token_ids must be a 2-D int32 or int64 array [max_rows, max_len]");
    }
    data = static_cast<const char*>(a.data());
    wide = dt.itemsize() == 8;
    rows = a.shape(0);
    cols = a.shape(1);
    row_stride = a.strides(0);
    col_stride = a.strides(1);
  }
  // token_ids[row, begin:end] into `out`.
  const void* address(int64_t row, int64_t col) const override { return data + row * row_stride + col * col_stride; }
  void read(int64_t row, int64_t begin, int64_t end, std::vector<int32_t>& out) const override {
    out.resize(end - begin);
    const char* p = data + row * row_stride + begin * col_stride;
    for (int64_t j = 0; j < end - begin; ++j, p += col_stride) {
      out[j] = wide ? checked_token(*reinterpret_cast<const int64_t*>(p)) : *reinterpret_cast<const int32_t*>(p);
    }
  }
  // Argument `name`[i], a row of the table.
  void check_row(const char* name, int64_t i, int64_t row) const {
    if (row < 0 || row >= rows) {
      throw py::index_error(std::string(name) + "[" + std::to_string(i) + "]=" + std::to_string(row) +
                            ": must be in [0, " + std::to_string(rows) + ")");
    }
  }
  // Argument `name`[i], how many of a row's tokens to read.
  void check_end(const char* name, int64_t i, int64_t end) const {
    if (end < 0 || end > cols) {
      throw py::value_error(std::string(name) + "[" + std::to_string(i) + "]=" + std::to_string(end) +
                            ": must be in [0, " + std::to_string(cols) + "]");
    }
  }
  const char* data;
  bool wide;
  int64_t rows, cols, row_stride, col_stride;
};

// Locks `b` and, when given, `backoff` (together, deadlock-free): what a
// call that uses both indexes holds while it runs.
std::pair<std::unique_lock<std::mutex>, std::unique_lock<std::mutex>> lock_with_backoff(BoundIndex& b,
                                                                                      BoundIndex* backoff) {
  std::unique_lock<std::mutex> lock(b.mu, std::defer_lock), lock_backoff;
  if (backoff == nullptr) {
    lock.lock();
  } else {
    lock_backoff = std::unique_lock<std::mutex>(backoff->mu, std::defer_lock);
    std::lock(lock, lock_backoff);
  }
  return {std::move(lock), std::move(lock_backoff)};
}

// sync's arguments (the index's and the trie's), checked against the token
// table: row i is sequence sids[i], table row rows[i]'s first num_tokens[i]
// tokens, prompt_lens[i] of them its prompt, in partitions[i] (null: none
// given), the last sampled[i] of them sampled this step (null: none given).
struct SyncArgs {
  SyncArgs(py::handle sids_obj, py::handle rows_obj, const TokenTable& table, py::handle num_tokens_obj,
           py::handle prompt_lens_obj, py::handle partitions_obj, py::handle sampled_obj = py::none())
      : sids(int_array(sids_obj, "sids")),
        rows(int_array(rows_obj, "rows")),
        num_tokens(int_array(num_tokens_obj, "num_tokens")),
        prompt_lens(int_array(prompt_lens_obj, "prompt_lens")),
        batch(sids.shape(0)) {
    if (rows.shape(0) != batch || num_tokens.shape(0) != batch || prompt_lens.shape(0) != batch) {
      throw py::value_error("sids, rows, num_tokens and prompt_lens must have the same length");
    }
    sid = sids.data(), row = rows.data(), num = num_tokens.data(), plen = prompt_lens.data();
    if (!partitions_obj.is_none()) {
      partitions = int_array(partitions_obj, "partitions");
      if (partitions.shape(0) != batch) throw py::value_error("sids and partitions must have the same length");
      part = partitions.data();
      for (int64_t i = 0; i < batch; ++i) check_partition(part[i]);
    }
    for (int64_t i = 0; i < batch; ++i) {
      table.check_row("rows", i, row[i]);
      table.check_end("num_tokens", i, num[i]);
      if (plen[i] < 0) {  // here, not where a row is admitted: a batch is applied whole or not at all
        throw py::value_error("prompt_lens[" + std::to_string(i) + "]=" + std::to_string(plen[i]) + ": must be >= 0");
      }
    }
    if (!sampled_obj.is_none()) {
      sampled_counts = int_array(sampled_obj, "sampled");
      if (sampled_counts.shape(0) != batch) throw py::value_error("sids and sampled must have the same length");
      sampled = sampled_counts.data();
      for (int64_t i = 0; i < batch; ++i) {
        if (sampled[i] < 0 || sampled[i] > num[i]) {
          throw py::value_error("sampled[" + std::to_string(i) + "]=" + std::to_string(sampled[i]) +
                                ": must be in [0, num_tokens[" + std::to_string(i) + "]=" + std::to_string(num[i]) +
                                "]");
        }
      }
    }
  }
  IntArray sids, rows, num_tokens, prompt_lens, partitions, sampled_counts;
  int64_t batch;
  const int64_t *sid, *row, *num, *plen, *part = nullptr, *sampled = nullptr;
};

int64_t sync_rows(BoundIndex& b, py::handle sids_obj, py::handle rows_obj, const py::array& token_ids,
                  py::handle num_tokens_obj, py::handle prompt_lens_obj, BoundIndex* backoff, py::handle partitions_obj,
                  py::handle sampled_obj) {
  if (backoff == &b) throw py::value_error("backoff: must be another index");
  const TokenTable table(token_ids);
  const SyncArgs a(sids_obj, rows_obj, table, num_tokens_obj, prompt_lens_obj, partitions_obj, sampled_obj);
  py::gil_scoped_release nogil;
  const auto locks = lock_with_backoff(b, backoff);
  // One thread: a second one costs more to start (~40 us here) than the
  // back-off's sync takes.
  const int64_t rewound = b.core.sync(a.sid, a.row, a.num, a.plen, a.batch, table, a.part, a.sampled);
  if (backoff != nullptr) backoff->core.sync(a.sid, a.row, a.num, a.plen, a.batch, table, a.part, a.sampled);
  return rewound;
}

// A draft's node budget: its rows are allocated at this width before any sequence is looked up.
constexpr int64_t kMaxDraftBudget = 1 << 16;
void check_budget(int64_t budget) {
  if (budget > kMaxDraftBudget) {
    throw py::value_error("budget " + std::to_string(budget) + ": must be at most " + std::to_string(kMaxDraftBudget));
  }
}

py::tuple draft_batch(BoundIndex& b, py::handle sids_obj, py::handle budgets_obj, double floor, bool tree,
                      int threads, BoundIndex* backoff) {
  if (threads < 1 || threads > 256) throw py::value_error("threads=" + std::to_string(threads) + ": must be in [1, 256]");
  if (backoff == &b) throw py::value_error("backoff: must be another index");
  const IntArray sids = int_array(sids_obj, "sids"), budgets = int_array(budgets_obj, "budgets");
  const int64_t batch = sids.shape(0);
  if (budgets.shape(0) != batch) throw py::value_error("sids and budgets must have the same length");
  const int64_t* sid = sids.data();
  const int64_t* budget = budgets.data();
  int64_t width = 0;
  for (int64_t i = 0; i < batch; ++i) width = std::max(width, budget[i]);
  check_budget(width);  // before the rows are allocated
  py::array_t<int32_t> tokens({batch, width}), parents({batch, width});
  py::array_t<double> conf({batch, width});
  py::array_t<int32_t> lengths(batch);
  int32_t* tok = tokens.mutable_data();
  int32_t* par = parents.mutable_data();
  double* cf = conf.mutable_data();
  int32_t* len = lengths.mutable_data();
  {
    py::gil_scoped_release nogil;
    std::fill(tok, tok + batch * width, 0);
    std::fill(par, par + batch * width, -1);
    std::fill(cf, cf + batch * width, 0.0);
    const auto locks = lock_with_backoff(b, backoff);
    b.core.draft_rows(sid, budget, batch, width, floor, tree, DraftRow{tok, par, cf}, len, threads,
                      backoff != nullptr ? &backoff->core : nullptr);
  }
  return py::make_tuple(tokens, parents, conf, lengths);
}

std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>> draft_one(BoundIndex& b, int64_t sid,
                                                                                   int64_t budget, double floor,
                                                                                   bool tree) {
  check_budget(budget);
  const int width = static_cast<int>(std::max<int64_t>(budget, 0));
  std::vector<int32_t> tokens(width), parents(width);
  std::vector<double> conf(width);
  std::lock_guard<std::mutex> lock(b.mu);
  b.core.settle();
  const int n = b.core.draft(sid, width, floor, tree, DraftRow{tokens.data(), parents.data(), conf.data()});
  tokens.resize(n);
  parents.resize(n);
  conf.resize(n);
  return {std::move(tokens), std::move(parents), std::move(conf)};
}

// ------------------------------------------------------------ kernel helpers
using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// `obj` as a C-contiguous array of T, refusing integers T cannot hold (forcecast alone wraps them: 2**32 + 1 as an
// int32 parent would read as 1). Arrays of T pass through without a copy or a scan.
template <typename T>
py::array_t<T, py::array::c_style | py::array::forcecast> narrow(py::handle obj, const char* name) {
  if (py::isinstance<py::array>(obj)) {
    const auto a = py::reinterpret_borrow<py::array>(obj);
    const char kind = a.dtype().kind();
    if ((kind == 'i' || kind == 'u') && !a.dtype().is(py::dtype::of<T>())) {
      if (kind == 'u' && a.itemsize() == 8) throw py::value_error(std::string(name) + ": uint64 is not accepted");
      const IntArray wide = IntArray::ensure(obj);
      for (py::ssize_t i = 0; i < wide.size(); ++i) {
        const int64_t v = wide.data()[i];
        if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
          throw py::value_error(std::string(name) + ": " + std::to_string(v) + " does not fit " +
                                std::to_string(8 * sizeof(T)) + "-bit integers");
        }
      }
    }
  }
  return py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(obj);
}

void check_same_length(const char* what, int64_t a, int64_t b) {
  if (a != b) throw py::value_error(std::string(what) + " must have the same length");
}

py::array_t<int64_t> to_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

// A float64 C-contiguous writeable [kinds, bins] table, updated in place.
double* table(py::array a, const char* name, int64_t kinds, int64_t bins) {
  if (!a.dtype().is(py::dtype::of<double>()) || !(a.flags() & py::array::c_style) || !a.writeable() || a.ndim() != 2 || a.shape(0) != kinds ||
      a.shape(1) != bins) {
    throw py::type_error(std::string(name) + " must be a writeable C-contiguous float64 array [" +
                         std::to_string(kinds) + ", " + std::to_string(bins) + "]");
  }
  return static_cast<double*>(a.mutable_data());
}

// The calibrator's four [kinds, bins] tables over `edges` (bins = edges + 1), checked.
lookahead::CalibrationTables calibration_tables(py::array predicted, py::array accepted_table, py::array nodes,
                                                py::array factor, const DoubleArray& edges) {
  const int64_t kinds = predicted.ndim() == 2 ? predicted.shape(0) : 0, bins = edges.shape(0) + 1;
  return lookahead::CalibrationTables{table(predicted, "predicted", kinds, bins),
                                      table(accepted_table, "accepted", kinds, bins),
                                      table(nodes, "nodes", kinds, bins),
                                      table(factor, "factor", kinds, bins),
                                      kinds,
                                      bins,
                                      edges.data()};
}

// Each batch row of `out_rows` in [0, num_out).
void check_out_rows(const IntArray& out_rows, int64_t num_out) {
  for (int64_t r = 0; r < out_rows.shape(0); ++r) {
    if (out_rows.data()[r] < 0 || out_rows.data()[r] >= num_out) {
      throw py::index_error("out_rows[" + std::to_string(r) + "]=" + std::to_string(out_rows.data()[r]) +
                            ": must be in [0, " + std::to_string(num_out) + ")");
    }
  }
}

// The forward-cost model's prices (free_tokens 0: no cost model); NaN and infinities are refused.
void check_prices(int64_t free_tokens, double marginal_tokens, double per_path, double path_setup,
                  double draft_setup) {
  if (free_tokens < 0 || (free_tokens > 0 && !(marginal_tokens > 0 && std::isfinite(marginal_tokens)))) {
    throw py::value_error("free_tokens must be >= 0 and marginal_tokens finite and > 0 where free_tokens > 0");
  }
  const std::pair<const char*, double> forwards[] = {
      {"per_path", per_path}, {"path_setup", path_setup}, {"draft_setup", draft_setup}};
  for (const auto& [name, value] : forwards) {
    if (!(value >= 0.0 && std::isfinite(value))) {
      throw py::value_error(std::string(name) + "=" + std::to_string(value) + ": must be finite and >= 0");
    }
  }
}

// ------------------------------------------------------------- tree kernels
using Int8Array = py::array_t<int8_t, py::array::c_style | py::array::forcecast>;
using UInt8Array = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

// [rows, width] arrays of one shape.
void check_rows(const char* what, const py::array& a, int64_t rows, int64_t width) {
  if (!a || a.ndim() != 2 || a.shape(0) != rows || a.shape(1) != width) {
    throw py::type_error(std::string(what) + " must be a 2-D array [" + std::to_string(rows) + ", " +
                         std::to_string(width) + "]");
  }
}

void check_lengths(const char* what, const int64_t* lens, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    if (lens[r] < 0 || lens[r] > width) {
      throw py::value_error(std::string(what) + "[" + std::to_string(r) + "]=" + std::to_string(lens[r]) +
                            ": must be in [0, " + std::to_string(width) + "]");
    }
  }
}

// Parents of each row's first lens[r] nodes come first: -1 <= parents[i] < i.
void check_parents(const int32_t* parents, const int64_t* lens, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < lens[r]; ++i) {
      const int32_t p = parents[r * width + i];
      if (p < -1 || p >= i) {
        throw py::value_error("parents[" + std::to_string(r) + ", " + std::to_string(i) + "]=" + std::to_string(p) +
                              ": must be in [-1, " + std::to_string(i - 1) + "]");
      }
    }
  }
}

py::tuple plan_trees_py(py::handle tokens_obj, py::handle parents_obj, py::handle raw_obj, py::handle lens_obj,
                        py::handle tree_ok_obj, py::handle edges_obj, py::handle factor_obj, int64_t budget,
                        int64_t num_rows, int64_t free_tokens, double marginal_tokens, double per_path,
                        double path_setup, double draft_setup, py::handle out_rows_obj, int64_t num_out,
                        py::handle kinds_obj, py::handle entry_obj) {
  if (num_out < 0) throw py::value_error("num_out=" + std::to_string(num_out) + ": must be >= 0");
  const Int32Array tokens = narrow<int32_t>(tokens_obj, "tokens"), parents = narrow<int32_t>(parents_obj, "parents");
  const DoubleArray raw = DoubleArray::ensure(raw_obj), edges = DoubleArray::ensure(edges_obj);
  const DoubleArray factor = DoubleArray::ensure(factor_obj);
  if (!raw || raw.ndim() != 2) throw py::type_error("raw must be a 2-D float array [rows, width]");
  const int64_t rows = raw.shape(0), width = raw.shape(1);
  check_rows("tokens", tokens, rows, width);
  check_rows("parents", parents, rows, width);
  if (!edges || edges.ndim() != 1) throw py::type_error("edges must be a 1-D float array");
  const int64_t bins = edges.shape(0) + 1;
  if (!factor || factor.ndim() != 2 || factor.shape(0) <= lookahead::kKindContext || factor.shape(1) != bins) {
    throw py::type_error("factor must be a 2-D float array [kinds > 3, len(edges) + 1]");
  }
  const IntArray lens = int_array(lens_obj, "lens"), out_rows = int_array(out_rows_obj, "out_rows");
  const UInt8Array tree_ok = UInt8Array::ensure(tree_ok_obj);
  if (!tree_ok || tree_ok.ndim() != 1) throw py::type_error("tree_ok must be a 1-D bool array");
  check_same_length("raw's rows and lens", rows, lens.shape(0));
  check_same_length("raw's rows and tree_ok", rows, tree_ok.shape(0));
  check_same_length("raw's rows and out_rows", rows, out_rows.shape(0));
  check_lengths("lens", lens.data(), rows, width);
  check_parents(parents.data(), lens.data(), rows, width);
  check_out_rows(out_rows, num_out);
  check_prices(free_tokens, marginal_tokens, per_path, path_setup, draft_setup);
  DoubleArray entry;
  const bool priced = !entry_obj.is_none();
  if (priced) {
    entry = DoubleArray::ensure(entry_obj);
    if (!entry || entry.ndim() != 1) throw py::type_error("entry must be a 1-D float array [rows] or None");
    check_same_length("raw's rows and entry", rows, entry.shape(0));
    for (int64_t r = 0; r < rows; ++r) {
      if (!(entry.data()[r] >= 0.0)) {
        throw py::value_error("entry[" + std::to_string(r) + "]=" + std::to_string(entry.data()[r]) + ": must be >= 0");
      }
    }
  }
  Int8Array kinds;
  const bool given = !kinds_obj.is_none();
  if (given) {
    kinds = narrow<int8_t>(kinds_obj, "kinds");
    if (!kinds) throw py::type_error("kinds must be an int8 array [rows, width] or None");
    check_rows("kinds", kinds, rows, width);
    const int8_t* k = kinds.data();
    for (int64_t i = 0; i < rows * width; ++i) {
      if (k[i] < 0 || k[i] >= factor.shape(0)) {
        throw py::value_error("kinds: " + std::to_string(k[i]) + " is not a calibration kind (0 to " +
                              std::to_string(factor.shape(0) - 1) + ")");
      }
    }
  }
  std::vector<int32_t> lens32(lens.data(), lens.data() + rows);
  py::array_t<int32_t> out_tokens({rows, width}), out_parents({rows, width});
  py::array_t<double> out_raw({rows, width}), calibrated({rows, width});
  py::array_t<int8_t> out_kinds({rows, width});
  py::array_t<int64_t> keep(rows);
  py::array_t<uint8_t> carries(rows);
  std::fill(out_tokens.mutable_data(), out_tokens.mutable_data() + rows * width, 0);
  std::fill(out_parents.mutable_data(), out_parents.mutable_data() + rows * width, -1);
  std::fill(out_raw.mutable_data(), out_raw.mutable_data() + rows * width, 0.0);
  std::fill(calibrated.mutable_data(), calibrated.mutable_data() + rows * width, 0.0);
  std::fill(out_kinds.mutable_data(), out_kinds.mutable_data() + rows * width, 0);
  const lookahead::TreeRows in{const_cast<int32_t*>(tokens.data()), const_cast<int32_t*>(parents.data()),
                               const_cast<double*>(raw.data()),
                               given ? const_cast<int8_t*>(kinds.data()) : nullptr, rows, width};
  lookahead::TreeRows out{out_tokens.mutable_data(), out_parents.mutable_data(), out_raw.mutable_data(),
                          out_kinds.mutable_data(), rows, width};
  lookahead::plan_trees(in, lens32.data(), tree_ok.data(), edges.data(), edges.shape(0), factor.data(), budget,
                        num_rows, lookahead::TreeCost{free_tokens, marginal_tokens, per_path, path_setup, draft_setup},
                        priced ? entry.data() : nullptr, out, calibrated.mutable_data(), keep.mutable_data(),
                        carries.mutable_data());
  py::list drafts(num_out);
  std::vector<bool> filled(num_out, false);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = out_rows.data()[r], n = keep.data()[r];
    if (filled[row]) throw py::value_error("out_rows[" + std::to_string(r) + "]: a batch row given twice");
    filled[row] = true;
    py::list draft(n);
    for (int64_t j = 0; j < n; ++j) PyList_SET_ITEM(draft.ptr(), j, py::int_(out.tokens[r * width + j]).release().ptr());
    drafts[row] = std::move(draft);
  }
  for (int64_t row = 0; row < num_out; ++row) {
    if (!filled[row]) drafts[row] = py::list();
  }
  return py::make_tuple(out_tokens, out_parents, out_raw, out_kinds, keep, calibrated, carries, drafts);
}

// Row i's emitted tokens (a sequence of ints) appended to `flat`; a list
// (vLLM's sampled token ids) is read in place.
void append_tokens(py::handle row, std::vector<int64_t>& flat) {
  if (PyList_Check(row.ptr())) {
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(row.ptr()); ++j) {
      flat.push_back(py::handle(PyList_GET_ITEM(row.ptr(), j)).cast<int64_t>());
    }
    return;
  }
  const py::sequence tokens = py::reinterpret_borrow<py::sequence>(row);
  const size_t n = tokens.size();
  for (size_t j = 0; j < n; ++j) flat.push_back(tokens[j].cast<int64_t>());
}

py::tuple match_trees_py(py::handle offer_slots_obj, py::handle offer_lens_obj, py::handle offer_tokens_obj,
                         py::handle offer_parents_obj, py::handle slots_obj, py::handle scheduled_obj,
                         py::sequence emitted) {
  const IntArray offer_slots = int_array(offer_slots_obj, "offer_slots");
  const IntArray offer_lens = int_array(offer_lens_obj, "offer_lens");
  const Int32Array tokens = narrow<int32_t>(offer_tokens_obj, "offer_tokens");
  const Int32Array parents = narrow<int32_t>(offer_parents_obj, "offer_parents");
  if (!tokens || tokens.ndim() != 2) throw py::type_error("offer_tokens must be a 2-D int array [offers, width]");
  const int64_t offers = tokens.shape(0), width = tokens.shape(1);
  check_rows("offer_parents", parents, offers, width);
  check_same_length("offer_slots, offer_lens and the offers' rows", offers, offer_slots.shape(0));
  check_same_length("offer_slots, offer_lens and the offers' rows", offers, offer_lens.shape(0));
  check_lengths("offer_lens", offer_lens.data(), offers, width);
  check_parents(parents.data(), offer_lens.data(), offers, width);
  const IntArray slots = int_array(slots_obj, "slots"), scheduled = int_array(scheduled_obj, "scheduled");
  const int64_t rows = slots.shape(0);
  check_same_length("slots, scheduled and emitted", rows, scheduled.shape(0));
  check_same_length("slots, scheduled and emitted", rows, static_cast<int64_t>(emitted.size()));
  // The emitted tokens of the rows that verified a draft (the only ones matched).
  std::vector<int64_t> flat, starts(static_cast<size_t>(rows) + 1, 0);
  for (int64_t i = 0; i < rows; ++i) {
    if (scheduled.data()[i] > 0) append_tokens(emitted[static_cast<size_t>(i)], flat);
    starts[i + 1] = static_cast<int64_t>(flat.size());
  }
  std::vector<int64_t> at, verified;
  py::array_t<uint8_t> hits({offers, width});
  std::fill(hits.mutable_data(), hits.mutable_data() + offers * width, 0);
  const lookahead::TreeRows rows_in{const_cast<int32_t*>(tokens.data()), const_cast<int32_t*>(parents.data()),
                                    nullptr, nullptr, offers, width};
  lookahead::match_trees(offer_slots.data(), offer_lens.data(), rows_in, slots.data(), scheduled.data(), flat.data(),
                         starts.data(), rows, at, verified, hits.mutable_data());
  return py::make_tuple(to_array(at), to_array(verified), hits);
}

void observe_trees_py(py::array predicted, py::array accepted_table, py::array nodes, py::array factor,
                      py::handle edges_obj, py::handle raw_obj, py::handle kinds_obj, py::handle hits_obj,
                      py::handle at_obj, py::handle verified_obj, double prior, double half_life) {
  const DoubleArray edges = DoubleArray::ensure(edges_obj), raw = DoubleArray::ensure(raw_obj);
  if (!edges || edges.ndim() != 1) throw py::type_error("edges must be a 1-D float array");
  if (!raw || raw.ndim() != 2) throw py::type_error("raw must be a 2-D float array [offers, width]");
  const lookahead::CalibrationTables t = calibration_tables(predicted, accepted_table, nodes, factor, edges);
  const int64_t kinds_n = t.kinds;
  const int64_t offers = raw.shape(0), width = raw.shape(1);
  const Int8Array kinds = narrow<int8_t>(kinds_obj, "kinds");
  const UInt8Array hits = UInt8Array::ensure(hits_obj);
  check_rows("kinds", kinds, offers, width);
  check_rows("hits", hits, offers, width);
  const IntArray at = int_array(at_obj, "at"), verified = int_array(verified_obj, "verified");
  const int64_t n = at.shape(0);
  check_same_length("at and verified", n, verified.shape(0));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = at.data()[i], v = verified.data()[i];
    if (d < 0 || d >= offers || v < 0 || v > width) {
      throw py::index_error("at[" + std::to_string(i) + "]=" + std::to_string(d) + ", verified=" + std::to_string(v) +
                            ": outside raw [" + std::to_string(offers) + ", " + std::to_string(width) + "]");
    }
    for (int64_t j = 0; j < v; ++j) {
      const int8_t k = kinds.data()[d * width + j];
      if (k < 0 || k >= kinds_n) throw py::value_error("kinds: " + std::to_string(k) + " outside the tables");
    }
  }
  const lookahead::TreeRows rows_in{nullptr, nullptr, const_cast<double*>(raw.data()),
                                    const_cast<int8_t*>(kinds.data()), offers, width};
  lookahead::observe_trees(t, rows_in, hits.data(), at.data(), verified.data(), n, prior, half_life);
}

py::tuple walk_trees_py(py::handle tokens_obj, py::handle parents_obj, py::handle lens_obj, py::handle targets_obj) {
  const Int32Array tokens = narrow<int32_t>(tokens_obj, "tokens"), parents = narrow<int32_t>(parents_obj, "parents");
  if (!tokens || tokens.ndim() != 2) throw py::type_error("tokens must be a 2-D int array [trees, width]");
  const int64_t trees = tokens.shape(0), width = tokens.shape(1);
  check_rows("parents", parents, trees, width);
  const IntArray lens = int_array(lens_obj, "lens");
  check_same_length("tokens' rows and lens", trees, lens.shape(0));
  check_lengths("lens", lens.data(), trees, width);
  check_parents(parents.data(), lens.data(), trees, width);
  const IntArray targets = IntArray::ensure(targets_obj);
  if (!targets || targets.ndim() != 2 || targets.shape(0) != trees) {
    throw py::type_error("targets must be a 2-D int array [" + std::to_string(trees) + ", rows]");
  }
  const int64_t twidth = targets.shape(1);
  for (int64_t d = 0; d < trees; ++d) {
    if (lens.data()[d] >= twidth) {
      throw py::value_error("lens[" + std::to_string(d) + "]=" + std::to_string(lens.data()[d]) +
                            ": a tree of n nodes needs n + 1 targets, targets has " + std::to_string(twidth));
    }
  }
  py::array_t<int32_t> nodes({trees, width});
  std::fill(nodes.mutable_data(), nodes.mutable_data() + trees * width, -1);
  py::array_t<int64_t> counts(trees), bonus(trees);
  const lookahead::TreeRows rows_in{const_cast<int32_t*>(tokens.data()), const_cast<int32_t*>(parents.data()),
                                    nullptr, nullptr, trees, width};
  lookahead::walk_trees(rows_in, lens.data(), targets.data(), twidth, nodes.mutable_data(), counts.mutable_data(),
                        bonus.mutable_data());
  return py::make_tuple(nodes, counts, bonus);
}

// ------------------------------------------------------------------- trie
struct BoundTrie {
  explicit BoundTrie(const lookahead::TrieConfig& config) : core(config) {}
  lookahead::TokenTrie core;
  std::mutex mu;
};

std::unique_ptr<BoundTrie> make_trie(py::handle branch_length, py::handle max_match_length,
                                     py::handle min_match_length, py::handle min_retrieved_nodes,
                                     py::handle trie_capacity, double prompt_weight, bool insert_prompt,
                                     py::handle context_match) {
  lookahead::TrieConfig c;
  c.branch_length = static_cast<int>(config_int("branch_length", branch_length, 2, 128));
  c.max_match_length = static_cast<int>(config_int("max_match_length", max_match_length, 1, c.branch_length - 1));
  c.min_match_length = static_cast<int>(config_int("min_match_length", min_match_length, 1, c.max_match_length));
  c.min_retrieved_nodes = config_int("min_retrieved_nodes", min_retrieved_nodes, 1, 1 << 16);
  c.capacity = config_int("trie_capacity", trie_capacity, 64, int64_t{1} << 26);
  if (!(prompt_weight >= 0.0 && prompt_weight <= 1e9)) {
    throw py::value_error("prompt_weight=" + std::to_string(prompt_weight) + ": must be in [0.0, 1e9]");
  }
  c.prompt_weight = prompt_weight;
  c.insert_prompt = insert_prompt;
  c.context_match = static_cast<int>(config_int("context_match", context_match, 0, 64));
  return std::make_unique<BoundTrie>(c);
}

lookahead::TrieShape trie_shape(const std::string& shape) {
  if (shape == "one") return lookahead::TrieShape::kOne;
  if (shape == "hier") return lookahead::TrieShape::kHier;
  if (shape == "par") return lookahead::TrieShape::kPar;
  throw py::value_error("shape='" + shape + "': must be one of 'one', 'hier', 'par'");
}

py::tuple flat_tuple(const lookahead::FlatTree& t) {
  return py::make_tuple(py::cast(t.tokens), py::cast(t.parents), py::cast(t.weights), py::cast(t.conf));
}

// [rows, width] draft rows to return (tokens 0, parents -1, weights and
// confidence 0, lengths): made with the GIL, written without it.
struct OutRows {
  OutRows(int64_t rows, int64_t width)
      : tokens({rows, width}), parents({rows, width}), weights({rows, width}), conf({rows, width}), lengths(rows),
        width(width), tok(tokens.mutable_data()), par(parents.mutable_data()), wt(weights.mutable_data()),
        cf(conf.mutable_data()), len(lengths.mutable_data()) {
    std::fill(tok, tok + rows * width, 0);
    std::fill(par, par + rows * width, -1);
    std::fill(wt, wt + rows * width, 0.0);
    std::fill(cf, cf + rows * width, 0.0);
    std::fill(len, len + rows, 0);
  }
  void set(int64_t r, const lookahead::FlatTree& t) {
    len[r] = static_cast<int64_t>(t.size());
    std::copy(t.tokens.begin(), t.tokens.end(), tok + r * width);
    std::copy(t.parents.begin(), t.parents.end(), par + r * width);
    std::copy(t.weights.begin(), t.weights.end(), wt + r * width);
    std::copy(t.conf.begin(), t.conf.end(), cf + r * width);
  }
  py::array_t<int32_t> tokens, parents;
  py::array_t<double> weights, conf;
  py::array_t<int64_t> lengths;
  int64_t width;
  int32_t *tok, *par;
  double *wt, *cf;
  int64_t* len;
};

// The trees of many requests as [R, W] arrays (W: the largest budget, at
// least 1): request i drafts after contexts[i, :context_lens[i]] (its last
// max_match_length tokens are read), for record handles[i] (-1: none).
py::tuple retrieve_rows(BoundTrie& b, py::handle handles_obj, const py::array& contexts, py::handle lens_obj,
                        py::handle budgets_obj, double floor, const std::string& shape) {
  const lookahead::TrieShape s = trie_shape(shape);
  const TokenTable table(contexts);
  const IntArray handles = int_array(handles_obj, "handles"), lens = int_array(lens_obj, "context_lens");
  const IntArray budgets = int_array(budgets_obj, "budgets");
  const int64_t batch = handles.shape(0);
  if (lens.shape(0) != batch || budgets.shape(0) != batch || table.rows != batch) {
    throw py::value_error("handles, contexts, context_lens and budgets must have the same length");
  }
  const int64_t *num = lens.data(), *budget = budgets.data(), *handle = handles.data();
  int64_t width = 1;
  for (int64_t i = 0; i < batch; ++i) {
    table.check_end("context_lens", i, num[i]);
    if (budget[i] > INT32_MAX) throw py::value_error("budgets must be < 2**31");
    width = std::max(width, budget[i]);
  }
  OutRows out(batch, width);
  {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> lock(b.mu);
    const int64_t span = b.core.config().max_match_length;
    std::vector<int32_t> context;
    lookahead::FlatTree tree;
    for (int64_t i = 0; i < batch; ++i) {
      table.read(i, std::max<int64_t>(0, num[i] - span), num[i], context);
      b.core.retrieve(context.data(), context.size(), budget[i], handle[i], s, floor, tree);
      out.set(i, tree);
    }
  }
  return py::make_tuple(out.tokens, out.parents, out.weights, out.conf, out.lengths);
}

// The context chains of many requests as [R, W] draft rows (W: the largest
// budget, at least 1); a handle with no chain (unknown, or context_match 0)
// drafts nothing.
py::tuple context_rows(BoundTrie& b, py::handle handles_obj, py::handle budgets_obj, double floor) {
  const IntArray handles = int_array(handles_obj, "handles"), budgets = int_array(budgets_obj, "budgets");
  const int64_t batch = handles.shape(0);
  check_same_length("handles and budgets", batch, budgets.shape(0));
  const int64_t *handle = handles.data(), *budget = budgets.data();
  int64_t width = 1;
  for (int64_t i = 0; i < batch; ++i) {
    if (budget[i] > INT32_MAX) throw py::value_error("budgets must be < 2**31");
    width = std::max(width, budget[i]);
  }
  OutRows out(batch, width);
  std::lock_guard<std::mutex> lock(b.mu);
  lookahead::FlatTree chain;
  for (int64_t i = 0; i < batch; ++i) {
    const lookahead::ContextChain* c = b.core.context(handle[i]);
    chain.clear();
    if (c != nullptr) c->draft(budget[i], floor, chain);
    out.set(i, chain);
  }
  return py::make_tuple(out.tokens, out.parents, out.weights, out.conf, out.lengths);
}

// The trie's side of a step's sync (TokenTrie::sync): every row's slot,
// table row, committed tokens, prompt length and partition (None: all the
// default partition); returns how many were rewound.
int64_t trie_sync(BoundTrie& b, py::handle sids_obj, py::handle rows_obj, const py::array& token_ids,
                  py::handle num_tokens_obj, py::handle prompt_lens_obj, py::handle partitions_obj,
                  py::handle sampled_obj) {
  const TokenTable table(token_ids);
  const SyncArgs a(sids_obj, rows_obj, table, num_tokens_obj, prompt_lens_obj, partitions_obj, sampled_obj);
  const std::vector<int64_t> defaults(a.part == nullptr ? a.batch : 0, lookahead::TokenTrie::kDefault);
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(b.mu);
  return b.core.sync(a.sid, a.row, a.num, a.plen, a.part != nullptr ? a.part : defaults.data(), a.batch, table,
                     a.sampled);
}

// retrieve_rows by slot (the slots' record handles; a slot kept off the trie
// drafts nothing), and per row whether its slot drafts from the trie (uint8).
py::tuple retrieve_slots(BoundTrie& b, py::handle sids_obj, const py::array& contexts, py::handle lens_obj,
                         py::handle budgets_obj, double floor, const std::string& shape) {
  const IntArray sids = int_array(sids_obj, "sids"), budgets = int_array(budgets_obj, "budgets");
  const int64_t batch = sids.shape(0);
  check_same_length("sids and budgets", batch, budgets.shape(0));
  py::array_t<int64_t> handles(batch), kept(batch);
  py::array_t<uint8_t> on(batch);
  {
    std::lock_guard<std::mutex> lock(b.mu);
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t handle = b.core.slot_handle(sids.data()[i]);
      on.mutable_data()[i] = handle != lookahead::TokenTrie::kOffTrie;
      handles.mutable_data()[i] = std::max<int64_t>(handle, -1);
      kept.mutable_data()[i] = on.data()[i] ? budgets.data()[i] : 0;
    }
  }
  py::tuple rows = retrieve_rows(b, handles, contexts, lens_obj, kept, floor, shape);
  return py::make_tuple(rows[0], rows[1], rows[2], rows[3], rows[4], on);
}

// context_rows by slot (a slot with no record of its own drafts nothing).
py::tuple context_slots(BoundTrie& b, py::handle sids_obj, py::handle budgets_obj, double floor) {
  const IntArray sids = int_array(sids_obj, "sids");
  py::array_t<int64_t> handles(sids.shape(0));
  {
    std::lock_guard<std::mutex> lock(b.mu);
    for (int64_t i = 0; i < sids.shape(0); ++i) {
      handles.mutable_data()[i] = std::max<int64_t>(b.core.slot_handle(sids.data()[i]), -1);
    }
  }
  return context_rows(b, handles, budgets_obj, floor);
}

// Many requests' new tokens in one call: handles[i] gets
// token_ids[rows[i], starts[i]:ends[i]] (rows whose handle is unknown: KeyError).
void extend_rows(BoundTrie& b, py::handle handles_obj, const py::array& token_ids, py::handle rows_obj,
                 py::handle starts_obj, py::handle ends_obj) {
  const TokenTable table(token_ids);
  const IntArray handles = int_array(handles_obj, "handles"), rows = int_array(rows_obj, "rows");
  const IntArray starts = int_array(starts_obj, "starts"), ends = int_array(ends_obj, "ends");
  const int64_t batch = handles.shape(0);
  if (rows.shape(0) != batch || starts.shape(0) != batch || ends.shape(0) != batch) {
    throw py::value_error("handles, rows, starts and ends must have the same length");
  }
  const int64_t *h = handles.data(), *row = rows.data(), *start = starts.data(), *end = ends.data();
  std::lock_guard<std::mutex> lock(b.mu);
  for (int64_t i = 0; i < batch; ++i) {
    if (row[i] < 0 || row[i] >= table.rows || start[i] < 0 || start[i] > end[i] || end[i] > table.cols) {
      throw py::index_error("rows[" + std::to_string(i) + "]=" + std::to_string(row[i]) + ", tokens " +
                            std::to_string(start[i]) + ":" + std::to_string(end[i]) + ": outside token_ids");
    }
    if (!b.core.has_request(h[i])) {
      throw py::key_error("handles[" + std::to_string(i) + "]=" + std::to_string(h[i]) + ": no such running request");
    }
  }
  py::gil_scoped_release nogil;
  std::vector<int32_t> tokens;
  for (int64_t i = 0; i < batch; ++i) {
    table.read(row[i], start[i], end[i], tokens);
    b.core.extend(h[i], tokens.data(), tokens.size());
  }
}

// A [rows, width] array's row r as a FlatTree's (tokens, parents, weights, conf) with n nodes.
void read_row(lookahead::FlatTree& t, const int32_t* tok, const int32_t* par, const double* w, const double* cf,
              int64_t r, int64_t width, int64_t n) {
  const int64_t at = r * width;
  t.tokens.assign(tok + at, tok + at + n);
  t.parents.assign(par + at, par + at + n);
  t.weights.assign(w + at, w + at + n);
  t.conf.assign(cf + at, cf + at + n);
}

// merge_row for every row: the leads and the trie's trees as [rows, width]
// arrays (tokens, parents, weights, confidence, lengths), lead_context[r]
// (the lead is a context chain), budgets, cut[r] (None: no row is cut).
py::tuple merge_rows_py(py::handle lead_obj, py::handle lead_context_obj, py::handle trie_obj, py::handle budgets_obj,
                        py::handle cut_obj, py::handle pool_obj) {
  const py::tuple lead = lead_obj.cast<py::tuple>(), trie = trie_obj.cast<py::tuple>();
  const py::tuple pool = pool_obj.is_none() ? py::tuple() : pool_obj.cast<py::tuple>();
  if (lead.size() != 5 || trie.size() != 5 || (!pool_obj.is_none() && pool.size() != 5)) {
    throw py::value_error("lead, trie and pool must be (tokens, parents, weights, confidence, lengths)");
  }
  const IntArray budgets = int_array(budgets_obj, "budgets");
  const int64_t rows = budgets.shape(0);
  // Each set of rows checked: [rows, width] arrays, lengths, parents first.
  struct RowSet {
    Int32Array tok, par;
    DoubleArray w, cf;
    IntArray lens;
    int64_t width = 0;
  };
  auto row_set = [&](const py::tuple& t, const std::string& what) {
    RowSet r;
    if (t.size() == 0) {  // no pool: every row empty
      r.lens = IntArray(rows);
      std::fill(r.lens.mutable_data(), r.lens.mutable_data() + rows, 0);
      return r;
    }
    r.tok = narrow<int32_t>(t[0], (what + " tokens").c_str());
    r.par = narrow<int32_t>(t[1], (what + " parents").c_str());
    r.w = DoubleArray::ensure(t[2]);
    r.cf = DoubleArray::ensure(t[3]);
    r.width = r.tok && r.tok.ndim() == 2 ? r.tok.shape(1) : -1;
    check_rows((what + " tokens").c_str(), r.tok, rows, r.width);
    check_rows((what + " parents").c_str(), r.par, rows, r.width);
    check_rows((what + " weights").c_str(), r.w, rows, r.width);
    check_rows((what + " confidence").c_str(), r.cf, rows, r.width);
    r.lens = int_array(t[4], (what + " lengths").c_str());
    check_same_length(("budgets and " + what + " lengths").c_str(), rows, r.lens.shape(0));
    check_lengths((what + " lengths").c_str(), r.lens.data(), rows, r.width);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < r.lens.data()[i]; ++j) {
        const int32_t p = r.par.data()[i * r.width + j];
        if (p < -1 || p >= j) {
          throw py::value_error(what + " parents[" + std::to_string(i) + ", " + std::to_string(j) + "]=" +
                                std::to_string(p) + ": must be in [-1, " + std::to_string(j - 1) + "]");
        }
      }
    }
    return r;
  };
  const RowSet sets[3] = {row_set(lead, "lead"), row_set(trie, "trie"), row_set(pool, "pool")};
  const UInt8Array lead_context = UInt8Array::ensure(lead_context_obj);
  if (!lead_context || lead_context.ndim() != 1 || lead_context.shape(0) != rows) {
    throw py::type_error("lead_context must be a 1-D bool array [" + std::to_string(rows) + "]");
  }
  UInt8Array cut;
  const bool cuts = !cut_obj.is_none();
  if (cuts) {
    cut = UInt8Array::ensure(cut_obj);
    if (!cut || cut.ndim() != 1 || cut.shape(0) != rows) {
      throw py::type_error("cut must be None or a 1-D bool array [" + std::to_string(rows) + "]");
    }
  }
  const int64_t* budget = budgets.data();
  int64_t width = 1;
  for (int64_t r = 0; r < rows; ++r) {
    width = std::max({width, budget[r], sets[0].lens.data()[r], sets[1].lens.data()[r], sets[2].lens.data()[r]});
  }
  OutRows out(rows, width);
  py::array_t<int8_t> kinds({rows, width});
  int8_t* kd = kinds.mutable_data();
  std::fill(kd, kd + rows * width, 0);
  lookahead::FlatTree in[3], merged;
  std::vector<int8_t> k;
  for (int64_t r = 0; r < rows; ++r) {
    for (int s = 0; s < 3; ++s) {
      const RowSet& set = sets[s];
      if (set.width > 0) {
        read_row(in[s], set.tok.data(), set.par.data(), set.w.data(), set.cf.data(), r, set.width, set.lens.data()[r]);
      } else {
        in[s].clear();
      }
    }
    lookahead::merge_row(in[0], lead_context.data()[r] != 0, in[1], in[2], budget[r], cuts && cut.data()[r] != 0,
                         merged, k);
    out.set(r, merged);
    std::copy(k.begin(), k.end(), kd + r * width);
  }
  return py::make_tuple(out.tokens, out.parents, out.weights, out.conf, kinds, out.lengths);
}

// Tokens in record `handle`'s context chain (-1: no such record, or no chain).
int64_t context_length(const lookahead::TokenTrie& t, int64_t handle) {
  const lookahead::ContextChain* c = t.context(handle);
  return c == nullptr ? -1 : static_cast<int64_t>(c->size());
}

// `f(core)` under the trie's lock, as a method of the bound trie.
template <class F>
auto locked(F f) {
  return [f](BoundTrie& b) {
    std::lock_guard<std::mutex> lock(b.mu);
    return f(b.core);
  };
}

void bind_trie(py::module_& m) {
  py::class_<BoundTrie>(m, "TokenTrie")
      .def(py::init(&make_trie), py::arg("branch_length"), py::arg("max_match_length"), py::arg("min_match_length"),
           py::arg("min_retrieved_nodes"), py::arg("trie_capacity"), py::arg("prompt_weight"),
           py::arg("insert_prompt"), py::arg("context_match"))
      .def_property_readonly("num_nodes", locked([](lookahead::TokenTrie& t) { return t.num_nodes(); }))
      .def_property_readonly("num_prunes", locked([](lookahead::TokenTrie& t) { return t.num_prunes(); }))
      .def("memory_bytes", locked([](lookahead::TokenTrie& t) { return t.memory_bytes(); }))
      .def(
          "add_request",
          [](BoundTrie& b, py::handle prompt) {
            const std::vector<int32_t> t = token_vector(prompt);
            std::lock_guard<std::mutex> lock(b.mu);
            return b.core.add_request(t.data(), t.size());
          },
          py::arg("prompt"))
      .def(
          "finish_request",
          [](BoundTrie& b, int64_t handle) {
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.finish_request(handle);
          },
          py::arg("handle"))
      .def(
          "extend",
          [](BoundTrie& b, int64_t handle, py::handle tokens) {
            const std::vector<int32_t> t = token_vector(tokens);
            std::lock_guard<std::mutex> lock(b.mu);
            if (!b.core.extend(handle, t.data(), t.size())) throw py::value_error("extend: the request has finished");
          },
          py::arg("handle"), py::arg("tokens"))
      .def(
          "insert_output",
          [](BoundTrie& b, py::handle tokens) {
            const std::vector<int32_t> t = token_vector(tokens);
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.insert_output(t.data(), t.size());
          },
          py::arg("tokens"))
      .def(
          "retrieve",
          [](BoundTrie& b, py::handle context, int64_t budget, int64_t handle, const std::string& shape,
             double floor) {
            const std::vector<int32_t> t = token_vector(context);
            const lookahead::TrieShape s = trie_shape(shape);
            lookahead::FlatTree tree;
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.retrieve(t.data(), t.size(), budget, handle, s, floor, tree);
            return flat_tuple(tree);
          },
          py::arg("context"), py::arg("budget"), py::arg("handle"), py::arg("shape"), py::arg("floor"))
      .def("retrieve_rows", &retrieve_rows, py::arg("handles"), py::arg("contexts"), py::arg("context_lens"),
           py::arg("budgets"), py::arg("floor"), py::arg("shape"))
      .def("context_rows", &context_rows, py::arg("handles"), py::arg("budgets"), py::arg("floor"))
      .def(
          "context_length",
          [](BoundTrie& b, int64_t handle) {
            std::lock_guard<std::mutex> lock(b.mu);
            return context_length(b.core, handle);
          },
          py::arg("handle"))
      .def("extend_rows", &extend_rows, py::arg("handles"), py::arg("token_ids"), py::arg("rows"), py::arg("starts"),
           py::arg("ends"))
      .def("sync", &trie_sync, py::arg("sids"), py::arg("rows"), py::arg("token_ids"), py::arg("num_tokens"),
           py::arg("prompt_lens"), py::arg("partitions") = py::none(), py::arg("sampled") = py::none())
      .def(
          "finish_slot",
          [](BoundTrie& b, int64_t sid) {
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.finish_slot(sid);
          },
          py::arg("sid"))
      .def("retrieve_slots", &retrieve_slots, py::arg("sids"), py::arg("contexts"), py::arg("context_lens"),
           py::arg("budgets"), py::arg("floor"), py::arg("shape"))
      .def("context_slots", &context_slots, py::arg("sids"), py::arg("budgets"), py::arg("floor"))
      .def(
          "slot_context_length",
          [](BoundTrie& b, int64_t sid) {
            std::lock_guard<std::mutex> lock(b.mu);
            return context_length(b.core, b.core.slot_handle(sid));
          },
          py::arg("sid"))
      .def_property_readonly("num_slots", locked([](lookahead::TokenTrie& t) { return t.num_slots(); }))
      .def_property_readonly("num_slot_contexts", locked([](lookahead::TokenTrie& t) { return t.num_slot_contexts(); }))
      .def("output_counts",
           [](BoundTrie& b) {
             std::vector<int32_t> parents, tokens;
             std::vector<double> counts;
             {
               std::lock_guard<std::mutex> lock(b.mu);
               b.core.output_counts(parents, tokens, counts);
             }
             return py::make_tuple(py::cast(parents), py::cast(tokens), py::cast(counts));
           })
      .def(
          "load_output_counts",
          [](BoundTrie& b, py::handle parents_obj, py::handle tokens_obj, py::handle counts_obj) {
            const std::vector<int32_t> parents = token_vector(parents_obj), tokens = token_vector(tokens_obj);
            const DoubleArray counts = DoubleArray::ensure(counts_obj);
            if (!counts || counts.ndim() != 1) throw py::type_error("counts must be a 1-D sequence of floats");
            if (parents.size() != tokens.size() || static_cast<py::ssize_t>(tokens.size()) != counts.shape(0)) {
              throw py::value_error("parents, tokens and counts must have the same length");
            }
            std::lock_guard<std::mutex> lock(b.mu);
            const std::string refused =
                b.core.load_output_counts(parents.data(), tokens.data(), counts.data(), tokens.size());
            if (!refused.empty()) throw py::value_error(refused);
          },
          py::arg("parents"), py::arg("tokens"), py::arg("counts"))
      .def("prune", locked([](lookahead::TokenTrie& t) { t.prune(); }));
  m.def("merge_rows", &merge_rows_py, py::arg("lead"), py::arg("lead_context"), py::arg("trie"), py::arg("budgets"),
        py::arg("cut") = py::none(), py::arg("pool") = py::none());
}

// ------------------------------------------------------------- Jacobi table
using lookahead::JacobiSlot;
using lookahead::JacobiTable;

py::object slot_window(const JacobiTable& t, int64_t slot) {
  const JacobiSlot* s = t.find(slot);
  if (s == nullptr || !s->windowed) return py::none();
  return py::cast(s->window);
}

void bind_jacobi(py::module_& m) {
  py::class_<JacobiTable>(m, "JacobiTable")
      .def(py::init([](py::handle window, py::handle ngram, py::handle guesses) {
             return std::make_unique<JacobiTable>(static_cast<int>(config_int("window", window, 1, 64)),
                                                  static_cast<int>(config_int("ngram", ngram, 2, 16)),
                                                  static_cast<int>(config_int("guesses", guesses, 1, 64)));
           }),
           py::arg("window"), py::arg("ngram"), py::arg("guesses"))
      .def_property_readonly("window", &JacobiTable::window)
      .def_property_readonly("ngram", &JacobiTable::ngram)
      .def_property_readonly("guesses", &JacobiTable::guesses)
      .def_property_readonly("num_nodes", &JacobiTable::num_nodes)
      .def_property_readonly("num_slots", &JacobiTable::num_slots)
      .def("memory_bytes", &JacobiTable::memory_bytes)
      .def_property(
          "prior", [](const JacobiTable& t) { return py::make_tuple(t.prior_yield(), t.prior_probe_every()); },
          [](JacobiTable& t, std::pair<double, int64_t> prior) {
            if (!(prior.first >= 0.0 && std::isfinite(prior.first))) {
              throw py::value_error("prior yield=" + std::to_string(prior.first) + ": must be finite and >= 0");
            }
            if (prior.second < 1 || prior.second > lookahead::kMaxProbeEvery) {
              throw py::value_error("prior probe_every=" + std::to_string(prior.second) + ": must be in [1, " +
                                    std::to_string(lookahead::kMaxProbeEvery) + "]");
            }
            t.set_prior(prior.first, prior.second);
          })
      .def(
          "track",
          [](JacobiTable& t, py::handle slots_obj, py::handle num_obj) {
            const IntArray slots = int_array(slots_obj, "slots"), num = int_array(num_obj, "num_tokens");
            check_same_length("slots and num_tokens", slots.shape(0), num.shape(0));
            std::vector<int64_t> stale;
            t.track(slots.data(), num.data(), slots.shape(0), stale);
            return to_array(stale);
          },
          py::arg("slots"), py::arg("num_tokens"))
      .def(
          "open",
          [](JacobiTable& t, py::handle slots_obj, py::handle rows_obj, const py::array& token_ids,
             py::handle prompt_obj, py::handle length_obj, py::handle windowed_obj) {
            const TokenTable table(token_ids);
            const IntArray slots = int_array(slots_obj, "slots"), rows = int_array(rows_obj, "rows");
            const IntArray prompt = int_array(prompt_obj, "prompt_lens"), length = int_array(length_obj, "lengths");
            const UInt8Array windowed = UInt8Array::ensure(windowed_obj);
            const int64_t n = slots.shape(0);
            check_same_length("slots, rows, prompt_lens and lengths", n, rows.shape(0));
            check_same_length("slots, rows, prompt_lens and lengths", n, prompt.shape(0));
            check_same_length("slots, rows, prompt_lens and lengths", n, length.shape(0));
            if (!windowed || windowed.ndim() != 1) throw py::type_error("windowed must be a 1-D bool array");
            check_same_length("slots and windowed", n, windowed.shape(0));
            std::vector<int32_t> tokens;
            for (int64_t i = 0; i < n; ++i) {
              const int64_t row = rows.data()[i], end = prompt.data()[i];
              table.check_row("rows", i, row);
              table.check_end("prompt_lens", i, end);
              table.read(row, 0, end, tokens);
              t.open(slots.data()[i], tokens.data(), end, length.data()[i], windowed.data()[i] != 0);
            }
          },
          py::arg("slots"), py::arg("rows"), py::arg("token_ids"), py::arg("prompt_lens"), py::arg("lengths"),
          py::arg("windowed"))
      .def("finish", &JacobiTable::finish, py::arg("slot"))
      .def(
          "pool_rows",
          [](JacobiTable& t, py::handle slots_obj, py::handle lasts_obj, py::handle full_obj) {
            const IntArray slots = int_array(slots_obj, "slots"), lasts = int_array(lasts_obj, "lasts");
            const UInt8Array full = UInt8Array::ensure(full_obj);
            const int64_t n = slots.shape(0);
            check_same_length("slots and lasts", n, lasts.shape(0));
            if (!full || full.ndim() != 1) throw py::type_error("full must be a 1-D bool array");
            check_same_length("slots and full", n, full.shape(0));
            std::vector<const std::vector<int32_t>*> found;
            const int64_t widest = t.ride_and_find(slots.data(), lasts.data(), full.data(), n, found);
            OutRows out(n, std::max<int64_t>(1, widest * (t.ngram() - 1)));
            const int64_t branches = t.pool_write(found, out.width, out.tok, out.par, out.wt, out.cf, out.len);
            return py::make_tuple(py::make_tuple(out.tokens, out.parents, out.weights, out.conf, out.lengths),
                                  branches);
          },
          py::arg("slots"), py::arg("lasts"), py::arg("full"))
      .def(
          "set_pool_from",
          [](JacobiTable& t, py::handle slots_obj, py::handle from_obj) {
            const IntArray slots = int_array(slots_obj, "slots"), from = int_array(from_obj, "pool_from");
            check_same_length("slots and pool_from", slots.shape(0), from.shape(0));
            t.set_pool_from(slots.data(), from.data(), slots.shape(0));
          },
          py::arg("slots"), py::arg("pool_from"))
      .def(
          "choose",
          [](JacobiTable& t, py::handle slots_obj, py::handle fees_obj, py::handle costs_obj, double setup,
             double fees_paid, double gain) {
            const IntArray slots = int_array(slots_obj, "slots");
            const DoubleArray fees = DoubleArray::ensure(fees_obj), costs = DoubleArray::ensure(costs_obj);
            const int64_t n = slots.shape(0);
            if (!fees || fees.ndim() != 1) throw py::type_error("fees must be a 1-D float array");
            check_same_length("slots and fees", n, fees.shape(0));
            if (!costs || costs.ndim() != 1 || costs.shape(0) != n + 1) {
              throw py::value_error("costs must be a 1-D float array of " + std::to_string(n + 1) +
                                    " entries (the step's cost with 0.." + std::to_string(n) + " windows)");
            }
            std::vector<int64_t> chosen;
            t.choose(slots.data(), fees.data(), costs.data(), n, {setup, fees_paid, gain}, chosen);
            const int64_t nodes = t.num_nodes();
            py::array_t<int32_t> ahead({static_cast<int64_t>(chosen.size()), nodes});
            int32_t* a = ahead.mutable_data();
            for (size_t c = 0; c < chosen.size(); ++c) {
              const std::vector<int32_t>& win = t.find(slots.data()[chosen[c]])->window;
              std::copy(win.begin(), win.end(), a + c * nodes);
            }
            return py::make_tuple(to_array(chosen), ahead);
          },
          py::arg("slots"), py::arg("fees"), py::arg("costs"), py::arg("setup"), py::arg("fees_paid"),
          py::arg("gain"))
      .def(
          "update",
          [](JacobiTable& t, py::handle slots_obj, py::handle new_obj, py::handle nodes_obj, py::handle starts_obj) {
            const IntArray slots = int_array(slots_obj, "slots"), nodes = int_array(nodes_obj, "nodes");
            const IntArray starts = int_array(starts_obj, "starts");
            const Int32Array fresh = narrow<int32_t>(new_obj, "new_tokens");
            const int64_t n = slots.shape(0);
            check_rows("new_tokens", fresh, n, t.window());
            if (starts.shape(0) != n + 1) throw py::value_error("starts must hold len(slots) + 1 offsets");
            const int64_t* s = starts.data();
            for (int64_t i = 0; i < n; ++i) {
              if (s[i] < 0 || s[i] > s[i + 1] || s[i + 1] > nodes.shape(0)) {
                throw py::value_error("starts must rise from 0 to len(nodes)");
              }
            }
            return t.update(slots.data(), fresh.data(), nodes.data(), s, n);
          },
          py::arg("slots"), py::arg("new_tokens"), py::arg("nodes"), py::arg("starts"))
      .def("window_tokens", &slot_window, py::arg("slot"))
      .def(
          "pool",
          [](const JacobiTable& t, int64_t slot, int64_t key, int64_t limit) -> py::object {
            const JacobiSlot* s = t.find(slot);
            if (s == nullptr || !s->windowed) return py::none();
            py::list out;
            for (const auto& cont : t.pool_get(*s, checked_token(key), limit)) out.append(py::tuple(py::cast(cont)));
            return out;
          },
          py::arg("slot"), py::arg("key"), py::arg("limit") = -1)
      .def(
          "pool_size",
          [](const JacobiTable& t, int64_t slot) -> int64_t {
            const JacobiSlot* s = t.find(slot);
            return s == nullptr || !s->windowed ? -1 : s->pool_size;
          },
          py::arg("slot"))
      .def(
          "policy",
          [](const JacobiTable& t, int64_t slot) -> py::object {
            const JacobiSlot* s = t.find(slot);
            if (s == nullptr) return py::none();
            py::dict d;
            d["length"] = s->length;
            d["windowed"] = s->windowed;
            d["x0"] = s->x0;
            d["pool_from"] = s->pool_from;
            d["yield_est"] = s->yield_est;
            d["steps_without"] = s->steps_without;
            d["probe_every"] = s->probe_every;
            d["probing"] = s->probing;
            return d;
          },
          py::arg("slot"))
      .def(
          "credit",
          [](JacobiTable& t, int64_t slot, int64_t pool_tokens) {
            JacobiSlot* s = t.find(slot);
            if (s == nullptr || !s->windowed) throw py::key_error("slot " + std::to_string(slot) + " has no window");
            t.credit(*s, pool_tokens);
          },
          py::arg("slot"), py::arg("pool_tokens"))
      .def_static("prompt_seed", [](py::handle prompt) {
        const std::vector<int32_t> t = token_vector(prompt);
        return lookahead::prompt_seed(t.data(), static_cast<int64_t>(t.size()));
      });
}

}  // namespace

PYBIND11_MODULE(_draft_index, m) {
  m.doc() = "Native DraftIndex (csrc/draft_index); semantics: docs/how-it-works.md, The draft index";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const lookahead::SequenceKeyError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });
  py::class_<BoundIndex> cls(m, "DraftIndex", py::dynamic_attr());
  cls.attr("native") = true;
  cls.def(py::init(&make_index), py::arg("ngram"), py::arg("max_match"), py::arg("max_occurrences"),
          py::arg("max_candidates"), py::arg("corpus_bytes"), py::arg("upkeep_thread") = false)
      .def_property_readonly("upkeep_thread", [](BoundIndex& b) { return b.core.upkeep_thread(); })
      .def(
          "settle",
          [](BoundIndex& b) {
            py::gil_scoped_release nogil;
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.settle();
          })
      .def(
          "add",
          [](BoundIndex& b, int64_t sid, py::handle tokens, int64_t prompt_len, int64_t partition) {
            const std::vector<int32_t> t = token_vector(tokens);
            check_partition(partition);
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.settle();
            b.core.add(sid, t.data(), t.size(), prompt_len, partition);
          },
          py::arg("sid"), py::arg("tokens"), py::arg("prompt_len"), py::arg("partition") = 0)
      .def(
          "extend",
          [](BoundIndex& b, int64_t sid, py::handle tokens) {
            const std::vector<int32_t> t = token_vector(tokens);
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.settle();
            b.core.extend(sid, t.data(), t.size());
          },
          py::arg("sid"), py::arg("tokens"))
      .def(
          "finish",
          [](BoundIndex& b, int64_t sid) {
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.finish(sid);
          },
          py::arg("sid"))
      .def(
          "rewind",
          [](BoundIndex& b, int64_t sid, int64_t length) {
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.rewind(sid, length);
          },
          py::arg("sid"), py::arg("length"))
      .def("num_live",
           [](BoundIndex& b) {
             std::lock_guard<std::mutex> lock(b.mu);
             return b.core.num_live();
           })
      .def("num_sequences",
           [](BoundIndex& b) {
             std::lock_guard<std::mutex> lock(b.mu);
             b.core.settle();
             return b.core.num_sequences();
           })
      .def("corpus_tokens",
           [](BoundIndex& b) {
             std::lock_guard<std::mutex> lock(b.mu);
             b.core.settle();
             return b.core.corpus_tokens();
           })
      .def("corpus_bytes",
           [](BoundIndex& b) {
             std::lock_guard<std::mutex> lock(b.mu);
             b.core.settle();
             return b.core.corpus_bytes();
           })
      .def(
          "length",
          [](BoundIndex& b, int64_t sid) {
            std::lock_guard<std::mutex> lock(b.mu);
            return b.core.length(sid);
          },
          py::arg("sid"))
      .def("memory_bytes",
           [](BoundIndex& b) {
             std::lock_guard<std::mutex> lock(b.mu);
             b.core.settle();
             return b.core.memory_bytes();
           })
      .def(
          "corpus_sequences",
          [](BoundIndex& b, py::object partition) {
            const bool all = partition.is_none();
            const int64_t part = all ? 0 : partition.cast<int64_t>();
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.settle();
            return b.core.corpus_sequences(part, all);
          },
          py::arg("partition") = py::none())
      .def("partition_bytes",
           [](BoundIndex& b) {
             std::vector<std::pair<int64_t, int64_t>> parts;
             {
               std::lock_guard<std::mutex> lock(b.mu);
               b.core.settle();
               parts = b.core.partition_bytes();
             }
             py::dict out;
             for (const auto& [p, charge] : parts) out[py::int_(p)] = py::int_(charge);
             return out;
           })
      .def("draft", &draft_one, py::arg("sid"), py::arg("budget"), py::arg("floor") = 0.0, py::arg("tree") = false)
      .def("sync", &sync_rows, py::arg("sids"), py::arg("rows"), py::arg("token_ids"), py::arg("num_tokens"),
           py::arg("prompt_lens"), py::arg("backoff") = py::none(), py::arg("partitions") = py::none(),
           py::arg("sampled") = py::none())
      .def("draft_batch", &draft_batch, py::arg("sids"), py::arg("budgets"), py::arg("floor") = 0.0,
           py::arg("tree") = false, py::arg("threads") = 1, py::arg("backoff") = py::none());
  m.def("plan_trees", &plan_trees_py, py::arg("tokens"), py::arg("parents"), py::arg("raw"), py::arg("lens"),
        py::arg("tree_ok"), py::arg("edges"), py::arg("factor"), py::arg("budget"), py::arg("num_rows"),
        py::arg("free_tokens"), py::arg("marginal_tokens"), py::arg("per_path"), py::arg("path_setup"),
        py::arg("draft_setup"), py::arg("out_rows"), py::arg("num_out"), py::arg("kinds") = py::none(),
        py::arg("entry") = py::none());
  m.def("match_trees", &match_trees_py, py::arg("offer_slots"), py::arg("offer_lens"), py::arg("offer_tokens"),
        py::arg("offer_parents"), py::arg("slots"), py::arg("scheduled"), py::arg("emitted"));
  m.def("observe_trees", &observe_trees_py, py::arg("predicted"), py::arg("accepted_table"), py::arg("nodes"),
        py::arg("factor"), py::arg("edges"), py::arg("raw"), py::arg("kinds"), py::arg("hits"), py::arg("at"),
        py::arg("verified"), py::arg("prior"), py::arg("half_life"));
  m.def("walk_trees", &walk_trees_py, py::arg("tokens"), py::arg("parents"), py::arg("lens"), py::arg("targets"));
  bind_trie(m);
  bind_jacobi(m);
}
