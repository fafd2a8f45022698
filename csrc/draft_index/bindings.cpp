// lookahead_vllm._draft_index: Python bindings of the native DraftIndex.
//
// Checks arguments, converts them, and calls the core; sync and draft_batch
// run without the GIL. A mutex per index serializes calls (the GIL no longer
// does while sync/draft_batch run).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "draft_index.h"

namespace py = pybind11;
using lookahead::DraftIndex;
using lookahead::DraftIndexConfig;
using lookahead::DraftRow;

namespace {

using IntArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct BoundIndex {
  explicit BoundIndex(const DraftIndexConfig& config) : core(config) {}
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
                                       py::handle max_candidates, py::handle corpus_tokens) {
  DraftIndexConfig c;
  c.ngram = static_cast<int>(config_int("ngram", ngram, 1, 4));
  c.max_match = static_cast<int>(config_int("max_match", max_match, 1, 1 << 16));
  c.max_occurrences = static_cast<int>(config_int("max_occurrences", max_occurrences, 1, 1024));
  c.max_candidates = static_cast<int>(config_int("max_candidates", max_candidates, 1, 1024));
  c.corpus_tokens = config_int("corpus_tokens", corpus_tokens, 0, int64_t{1} << 34);
  if (c.max_match < c.ngram) {
    throw py::value_error("max_match=" + std::to_string(c.max_match) + ": must be >= ngram (" +
                          std::to_string(c.ngram) + ")");
  }
  return std::make_unique<BoundIndex>(c);
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

// token_ids [max_rows, max_len], int32 or int64, any strides: read in place.
struct TokenTable {
  explicit TokenTable(const py::array& a) {
    const py::dtype dt = a.dtype();
    if (a.ndim() != 2 || dt.kind() != 'i' || (dt.itemsize() != 4 && dt.itemsize() != 8) ||
        !dt.attr("isnative").cast<bool>()) {
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
  void read(int64_t row, int64_t begin, int64_t end, std::vector<int32_t>& out) const {
    out.resize(end - begin);
    const char* p = data + row * row_stride + begin * col_stride;
    for (int64_t j = 0; j < end - begin; ++j, p += col_stride) {
      out[j] = wide ? checked_token(*reinterpret_cast<const int64_t*>(p)) : *reinterpret_cast<const int32_t*>(p);
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

// Brings `core` up to date with the token table's rows (sync's loop).
int64_t sync_core(DraftIndex& core, const TokenTable& table, const int64_t* sid, const int64_t* row,
                  const int64_t* num, const int64_t* plen, int64_t batch) {
  std::vector<int32_t> buf;
  int64_t rewound = 0;
  for (int64_t i = 0; i < batch; ++i) {
    int64_t have = core.length(sid[i]);
    if (have < 0) {
      table.read(row[i], 0, num[i], buf);
      core.add(sid[i], buf.data(), buf.size(), std::min(plen[i], num[i]));
      continue;
    }
    if (num[i] < have) {
      core.rewind(sid[i], num[i]);
      have = num[i];
      ++rewound;
    }
    if (num[i] > have) {
      table.read(row[i], have, num[i], buf);
      core.extend(sid[i], buf.data(), buf.size());
    }
  }
  return rewound;
}

int64_t sync_rows(BoundIndex& b, py::handle sids_obj, py::handle rows_obj, const py::array& token_ids,
                  py::handle num_tokens_obj, py::handle prompt_lens_obj, BoundIndex* backoff) {
  if (backoff == &b) throw py::value_error("backoff: must be another index");
  const TokenTable table(token_ids);
  const IntArray sids = int_array(sids_obj, "sids"), rows = int_array(rows_obj, "rows");
  const IntArray num_tokens = int_array(num_tokens_obj, "num_tokens");
  const IntArray prompt_lens = int_array(prompt_lens_obj, "prompt_lens");
  const int64_t batch = sids.shape(0);
  if (rows.shape(0) != batch || num_tokens.shape(0) != batch || prompt_lens.shape(0) != batch) {
    throw py::value_error("sids, rows, num_tokens and prompt_lens must have the same length");
  }
  const int64_t *sid = sids.data(), *row = rows.data(), *num = num_tokens.data(), *plen = prompt_lens.data();
  for (int64_t i = 0; i < batch; ++i) {
    if (row[i] < 0 || row[i] >= table.rows) {
      throw py::index_error("rows[" + std::to_string(i) + "]=" + std::to_string(row[i]) + ": must be in [0, " +
                            std::to_string(table.rows) + ")");
    }
    if (num[i] < 0 || num[i] > table.cols) {
      throw py::value_error("num_tokens[" + std::to_string(i) + "]=" + std::to_string(num[i]) +
                            ": must be in [0, " + std::to_string(table.cols) + "]");
    }
  }
  py::gil_scoped_release nogil;
  const auto locks = lock_with_backoff(b, backoff);
  // One thread: a second one costs more to start (~40 us here) than the
  // back-off's sync takes.
  const int64_t rewound = sync_core(b.core, table, sid, row, num, plen, batch);
  if (backoff != nullptr) sync_core(backoff->core, table, sid, row, num, plen, batch);
  return rewound;
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
  if (width > INT32_MAX) throw py::value_error("budgets must be < 2**31");
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
  const int width = static_cast<int>(std::clamp<int64_t>(budget, 0, INT32_MAX));
  std::vector<int32_t> tokens(width), parents(width);
  std::vector<double> conf(width);
  std::lock_guard<std::mutex> lock(b.mu);
  const int n = b.core.draft(sid, width, floor, tree, DraftRow{tokens.data(), parents.data(), conf.data()});
  tokens.resize(n);
  parents.resize(n);
  conf.resize(n);
  return {std::move(tokens), std::move(parents), std::move(conf)};
}

}  // namespace

PYBIND11_MODULE(_draft_index, m) {
  m.doc() = "Native DraftIndex (csrc/draft_index); semantics: lookahead_vllm/core/draft_index.py";
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
          py::arg("max_candidates"), py::arg("corpus_tokens"))
      .def(
          "add",
          [](BoundIndex& b, int64_t sid, py::handle tokens, int64_t prompt_len) {
            const std::vector<int32_t> t = token_vector(tokens);
            std::lock_guard<std::mutex> lock(b.mu);
            b.core.add(sid, t.data(), t.size(), prompt_len);
          },
          py::arg("sid"), py::arg("tokens"), py::arg("prompt_len"))
      .def(
          "extend",
          [](BoundIndex& b, int64_t sid, py::handle tokens) {
            const std::vector<int32_t> t = token_vector(tokens);
            std::lock_guard<std::mutex> lock(b.mu);
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
             return b.core.num_sequences();
           })
      .def("corpus_tokens",
           [](BoundIndex& b) {
             std::lock_guard<std::mutex> lock(b.mu);
             return b.core.corpus_tokens();
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
             return b.core.memory_bytes();
           })
      .def("corpus_sequences",
           [](BoundIndex& b) {
             std::lock_guard<std::mutex> lock(b.mu);
             return b.core.corpus_sequences();
           })
      .def("draft", &draft_one, py::arg("sid"), py::arg("budget"), py::arg("floor") = 0.0, py::arg("tree") = false)
      .def("sync", &sync_rows, py::arg("sids"), py::arg("rows"), py::arg("token_ids"), py::arg("num_tokens"),
           py::arg("prompt_lens"), py::arg("backoff") = py::none())
      .def("draft_batch", &draft_batch, py::arg("sids"), py::arg("budgets"), py::arg("floor") = 0.0,
           py::arg("tree") = false, py::arg("threads") = 1, py::arg("backoff") = py::none());
}
