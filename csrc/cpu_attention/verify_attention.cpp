// Causal attention of short query rows over vLLM's paged CPU KV cache (fp32): the verification
// forward of a step that carries drafts.
//
// Why: vLLM 0.32's CPU kernel (csrc/cpu/cpu_attn_*.hpp, "vec" ISA for fp32) runs a row of several
// query tokens at ~16 GFLOP/s and without splitting its context over the threads: at 3000 tokens of
// context a 5-token row took 63.6 ms of attention a step against 12.1 ms for a 1-token row
// (SmolLM2-135M, 30 layers, 2 cores; docs/prices.md). Here one work item is (row, KV head, a
// 256-key span of the context): every query vector of the row that reads that KV head (its query
// tokens x the heads of the GQA group) is scored against a 16-key tile at once, so each key and
// value is read once per item, the scores are 16-wide FMAs over a transposed key tile, and the
// context is split over the threads whatever the row's length. The spans' partial softmaxes
// (max, sum, weighted values) are merged per query vector after the parallel loop.
//
// Semantics (what lookahead_vllm.ops.cpu_attention.paged_causal_attention_ref computes): row r's
// query tokens are the last q_len = qsl[r+1] - qsl[r] of its seq_lens[r] tokens, whose keys and
// values are already in the cache; query token j (position seq_lens[r] - q_len + j) attends to
// positions 0..that position; query head hq reads KV head hq / (heads / kv_heads); position p
// lives at block block_table[r][p / block_size], offset p % block_size.
//
// Two bodies, picked at run time: AVX-512 intrinsics (item_avx512), and a portable one the
// compiler vectorises as it can (run_item; tests, and machines without AVX-512, where the Python
// side keeps vLLM's kernel), so a build on one x86 machine runs on another. Threads: OpenMP, which resolves to the runtime torch
// loaded (libgomp.so.1), so the work runs on the engine's own bound threads.

#include <pybind11/pybind11.h>

#include <omp.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kTile = 16;   // keys scored together
constexpr int kSpan = 256;  // keys per work item (a multiple of kTile)
constexpr int kPrefetchTiles = 2;  // how far ahead (in tiles) the AVX-512 body prefetches keys and values

struct Args {
  const float* q;
  int64_t q_tok, q_head;
  float* out;
  int64_t o_tok, o_head;
  const float* k;
  int64_t k_blk, k_head, k_tok, k_dim;
  const float* v;
  int64_t v_blk, v_head, v_tok, v_dim;
  const int32_t* qsl;
  const int32_t* seq_lens;
  const int32_t* block_table;
  int64_t bt_row;
  int rows, heads, kv_heads, head_dim, block_size;
  float scale;
};

struct Item {
  int row, kv_head, key_start, key_end;
  int64_t scratch;  // offset of its (max, sum, acc[head_dim]) per query vector
};

// exp(x) for x <= 0 (and -inf -> 0): 2^n * 2^f, f in [-0.5, 0.5], degree-7 Taylor series of 2^f
// (relative error < 1e-7). Branch-free, so the tile loops vectorize.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
  const float f = (t - n) * 0.693147180559945309f;
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

template <int D>
inline __attribute__((always_inline)) void run_item(const Args& a, const Item& it, float* scratch) {
  const int r = it.row, h = it.kv_head, group = a.heads / a.kv_heads;
  const int q0 = a.qsl[r], q_len = a.qsl[r + 1] - q0, seq_len = a.seq_lens[r];
  const int nq = q_len * group;
  const int first_query_pos = seq_len - q_len;
  std::vector<float> qs(static_cast<size_t>(nq) * D);
  for (int j = 0; j < q_len; ++j) {
    for (int g = 0; g < group; ++g) {
      const float* src = a.q + (q0 + j) * a.q_tok + (h * group + g) * a.q_head;
      float* dst = qs.data() + (j * group + g) * D;
      for (int d = 0; d < D; ++d) dst[d] = src[d] * a.scale;
    }
  }
  float* state = scratch + it.scratch;  // per query vector: max, sum, acc[D]
  for (int i = 0; i < nq; ++i) {
    float* s = state + i * (D + 2);
    s[0] = -std::numeric_limits<float>::infinity();
    s[1] = 0.0f;
    for (int d = 0; d < D; ++d) s[2 + d] = 0.0f;
  }
  alignas(64) float kt[D][kTile];
  alignas(64) float scores[kTile];
  const float* vrows[kTile];
  const int32_t* blocks = a.block_table + r * a.bt_row;
  for (int t0 = it.key_start; t0 < it.key_end; t0 += kTile) {
    const int nt = std::min(kTile, it.key_end - t0);
    for (int t = 0; t < kTile; ++t) {
      if (t < nt) {
        const int pos = t0 + t;
        const int64_t blk = blocks[pos / a.block_size], off = pos % a.block_size;
        const float* kp = a.k + blk * a.k_blk + h * a.k_head + off * a.k_tok;
        vrows[t] = a.v + blk * a.v_blk + h * a.v_head + off * a.v_tok;
        for (int d = 0; d < D; ++d) kt[d][t] = kp[d * a.k_dim];
      } else {
        vrows[t] = nullptr;
        for (int d = 0; d < D; ++d) kt[d][t] = 0.0f;
      }
    }
    for (int i = 0; i < nq; ++i) {
      const int limit = first_query_pos + i / group;  // the last position query vector i sees
      const int visible = std::min(nt, limit - t0 + 1);
      if (visible <= 0) continue;
      const float* qi = qs.data() + i * D;
      for (int t = 0; t < kTile; ++t) scores[t] = 0.0f;
      for (int d = 0; d < D; ++d) {
        const float qd = qi[d];
        for (int t = 0; t < kTile; ++t) scores[t] += qd * kt[d][t];
      }
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < visible; ++t) tile_max = std::max(tile_max, scores[t]);
      float* s = state + i * (D + 2);
      const float m_new = std::max(s[0], tile_max);
      const float alpha = exp_nonpositive(s[0] - m_new);
      float sum = 0.0f;
      for (int t = 0; t < kTile; ++t) {
        const float e = exp_nonpositive(scores[t] - m_new);
        scores[t] = t < visible ? e : 0.0f;
        sum += scores[t];
      }
      s[0] = m_new;
      s[1] = s[1] * alpha + sum;
      float* acc = s + 2;
      for (int d = 0; d < D; ++d) acc[d] *= alpha;
      for (int t = 0; t < visible; ++t) {
        const float p = scores[t];
        const float* vp = vrows[t];
        for (int d = 0; d < D; ++d) acc[d] += p * vp[d * a.v_dim];
      }
    }
  }
}

template <int D>
inline __attribute__((always_inline)) void merge_row_head(const Args& a, const std::vector<Item>& items,
                                                         int first, int count, const float* scratch) {
  const Item& head_item = items[first];
  const int r = head_item.row, h = head_item.kv_head, group = a.heads / a.kv_heads;
  const int q0 = a.qsl[r], q_len = a.qsl[r + 1] - q0;
  for (int i = 0; i < q_len * group; ++i) {
    float m = -std::numeric_limits<float>::infinity();
    for (int c = 0; c < count; ++c) m = std::max(m, scratch[items[first + c].scratch + i * (D + 2)]);
    float total = 0.0f;
    float acc[D];
    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
    for (int c = 0; c < count; ++c) {
      const float* s = scratch + items[first + c].scratch + i * (D + 2);
      if (s[1] == 0.0f) continue;  // a span with nothing visible
      const float w = exp_nonpositive(s[0] - m);
      total += s[1] * w;
      for (int d = 0; d < D; ++d) acc[d] += s[2 + d] * w;
    }
    const int j = i / group, g = i % group;
    float* dst = a.out + (q0 + j) * a.o_tok + (h * group + g) * a.o_head;
    const float inv = 1.0f / total;
    for (int d = 0; d < D; ++d) dst[d] = acc[d] * inv;
  }
}

// One item, and one (row, KV head)'s merge, per ISA: OpenMP's outlined loop bodies do not inherit a
// function's target attribute, so the parallel loops (in attend) call these through pointers.
struct Kernels {
  void (*item)(const Args&, const Item&, float*);
  void (*merge)(const Args&, const std::vector<Item>&, int, int, const float*);
};

#if defined(__x86_64__)
#define AVX512_TARGET __attribute__((target("avx512f,avx512dq,avx512vl,fma")))

// exp(x) for x <= 0, 16 lanes: NaN and -inf give exp(-87) (callers mask those lanes out).
AVX512_TARGET inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // a NaN first operand yields the second
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One item with the 16 lanes of a vector holding 16 query vectors (the row's query tokens x the GQA
// group's heads, in chunks of 16): a key's scores for all of them are 16-wide FMAs over the head
// dimension with the key's elements broadcast, so keys need no transposing, and the online
// softmax's max, exp and sums are lane-wise. Needs a tile never to cross a block: block_size % 16
// == 0 (the Python side checks), spans and tiles start at multiples of 16.
template <int D>
AVX512_TARGET void item_avx512(const Args& a, const Item& it, float* scratch) {
  const int r = it.row, h = it.kv_head, group = a.heads / a.kv_heads;
  const int q0 = a.qsl[r], q_len = a.qsl[r + 1] - q0, nq = q_len * group;
  const int chunks = (nq + kTile - 1) / kTile;
  const int first_query_pos = a.seq_lens[r] - q_len;
  const int32_t* blocks = a.block_table + r * a.bt_row;
  // Per chunk of 16 query vectors: the scaled queries transposed, the weighted values transposed
  // ([D][16] each), the running max and sum, and the last position each lane sees (-1: no lane).
  struct alignas(64) Chunk {
    float qt[D][kTile];
    float acc[D][kTile];
    float m[kTile], l[kTile];
    int32_t limits[kTile];
  };
  std::vector<Chunk> state(chunks);
  for (int c = 0; c < chunks; ++c) {
    Chunk& ch = state[c];
    for (int lane = 0; lane < kTile; ++lane) {
      const int i = c * kTile + lane;
      const bool live = i < nq;
      ch.limits[lane] = live ? first_query_pos + i / group : -1;
      const float* src = live ? a.q + (q0 + i / group) * a.q_tok + (h * group + i % group) * a.q_head : nullptr;
      for (int d = 0; d < D; ++d) ch.qt[d][lane] = live ? src[d] * a.scale : 0.0f;
      ch.m[lane] = -std::numeric_limits<float>::infinity();
      ch.l[lane] = 0.0f;
    }
    std::memset(ch.acc, 0, sizeof(ch.acc));
  }
  alignas(64) float pt[kTile][kTile];
  for (int t0 = it.key_start; t0 < it.key_end; t0 += kTile) {
    const int nt = std::min(kTile, it.key_end - t0);
    const int64_t blk = blocks[t0 / a.block_size], off = t0 % a.block_size;
    const float* kb = a.k + blk * a.k_blk + h * a.k_head + off * a.k_tok;
    const float* vb = a.v + blk * a.v_blk + h * a.v_head + off * a.v_tok;
    const int ahead = t0 + kPrefetchTiles * kTile;  // the hardware prefetcher misses the transposed keys
    if (ahead < it.key_end) {
      const int64_t pblk = blocks[ahead / a.block_size], poff = ahead % a.block_size;
      const char* kp = reinterpret_cast<const char*>(a.k + pblk * a.k_blk + h * a.k_head + poff * a.k_tok);
      const char* vp = reinterpret_cast<const char*>(a.v + pblk * a.v_blk + h * a.v_head + poff * a.v_tok);
      for (int d = 0; d < D; ++d) _mm_prefetch(kp + d * a.k_dim * sizeof(float), _MM_HINT_T0);
      for (int t = 0; t < kTile; ++t)
        for (int d = 0; d < D; d += 16) _mm_prefetch(vp + (t * a.v_tok + d * a.v_dim) * sizeof(float), _MM_HINT_T0);
    }
    for (int c = 0; c < chunks; ++c) {  // the tile's keys and values stay in L1 across the chunks
      Chunk& ch = state[c];
      __m512 s[kTile];
      for (int t = 0; t < kTile; ++t) s[t] = _mm512_setzero_ps();
      for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 qr[8];
        for (int u = 0; u < 8; ++u) qr[u] = _mm512_load_ps(ch.qt[d0 + u]);
        // All 16 keys (a constant count keeps s[] in registers): a tile never leaves its block, and
        // the scores of keys past nt are masked out below.
        for (int t = 0; t < kTile; ++t) {
          const float* kp = kb + t * a.k_tok + d0 * a.k_dim;
          for (int u = 0; u < 8; ++u) s[t] = _mm512_fmadd_ps(qr[u], _mm512_set1_ps(kp[u * a.k_dim]), s[t]);
        }
      }
      const __m512i limit = _mm512_load_si512(ch.limits);
      __mmask16 vis[kTile];
      __m512 tile_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int t = 0; t < kTile; ++t) {
        vis[t] = t < nt ? _mm512_cmp_epi32_mask(_mm512_set1_epi32(t0 + t), limit, _MM_CMPINT_LE) : 0;
        tile_max = _mm512_mask_max_ps(tile_max, vis[t], tile_max, s[t]);
      }
      const __m512 m_old = _mm512_load_ps(ch.m);
      const __m512 m_new = _mm512_max_ps(m_old, tile_max);
      const __m512 alpha = exp512(_mm512_sub_ps(m_old, m_new));
      __m512 l = _mm512_mul_ps(_mm512_load_ps(ch.l), alpha);
      for (int t = 0; t < kTile; ++t) {
        const __m512 p = _mm512_maskz_mov_ps(vis[t], exp512(_mm512_sub_ps(s[t], m_new)));
        l = _mm512_add_ps(l, p);
        _mm512_store_ps(pt[t], p);
      }
      _mm512_store_ps(ch.m, m_new);
      _mm512_store_ps(ch.l, l);
      for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 ar[8];
        for (int u = 0; u < 8; ++u) ar[u] = _mm512_mul_ps(_mm512_load_ps(ch.acc[d0 + u]), alpha);
        for (int t = 0; t < nt; ++t) {
          const __m512 p = _mm512_load_ps(pt[t]);
          const float* vp = vb + t * a.v_tok + d0 * a.v_dim;
          for (int u = 0; u < 8; ++u) ar[u] = _mm512_fmadd_ps(p, _mm512_set1_ps(vp[u * a.v_dim]), ar[u]);
        }
        for (int u = 0; u < 8; ++u) _mm512_store_ps(ch.acc[d0 + u], ar[u]);
      }
    }
  }
  for (int i = 0; i < nq; ++i) {
    const Chunk& ch = state[i / kTile];
    const int lane = i % kTile;
    float* st = scratch + it.scratch + i * (D + 2);
    st[0] = ch.l[lane] > 0.0f ? ch.m[lane] : -std::numeric_limits<float>::infinity();
    st[1] = ch.l[lane];
    for (int d = 0; d < D; ++d) st[2 + d] = ch.acc[d][lane];
  }
}

template <int D>
AVX512_TARGET void merge_avx512(const Args& a, const std::vector<Item>& items, int first, int count,
                                const float* scratch) {
  merge_row_head<D>(a, items, first, count, scratch);
}
#endif

template <int D>
void item_baseline(const Args& a, const Item& it, float* scratch) {
  run_item<D>(a, it, scratch);
}

template <int D>
void merge_baseline(const Args& a, const std::vector<Item>& items, int first, int count, const float* scratch) {
  merge_row_head<D>(a, items, first, count, scratch);
}

bool force_baseline = false;  // tests: run the portable path on an AVX-512 machine too

bool avx512() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

template <int D>
Kernels pick() {
#if defined(__x86_64__)
  if (!force_baseline && avx512()) return {item_avx512<D>, merge_avx512<D>};
#endif
  return {item_baseline<D>, merge_baseline<D>};
}

const char* isa_name() { return !force_baseline && avx512() ? "avx512" : "baseline"; }

template <typename T>
const T* ptr(uintptr_t address) {
  return reinterpret_cast<const T*>(address);
}

// One call per attention layer. Pointers are the tensors' data_ptr(), strides in elements: the key
// and value caches as logical [blocks, kv_heads, block_size, head_dim] views with any strides
// (vLLM's fp32 "vec" layout keeps a block's keys transposed; lookahead_vllm/ops/cpu_attention.py
// split_cache). The Python side checks dtypes and shapes.
void attend(uintptr_t q, int64_t q_tok, int64_t q_head, uintptr_t out, int64_t o_tok, int64_t o_head,
            uintptr_t k, int64_t k_blk, int64_t k_head, int64_t k_tok, int64_t k_dim, uintptr_t v, int64_t v_blk,
            int64_t v_head, int64_t v_tok, int64_t v_dim, uintptr_t qsl, uintptr_t seq_lens, uintptr_t block_table, int64_t bt_row, int rows,
            int heads, int kv_heads, int head_dim, int block_size, double scale) {
  if (rows < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || block_size <= 0 || block_size % kTile)
    throw std::invalid_argument("verify_attention: rows=" + std::to_string(rows) + ", heads=" +
                                std::to_string(heads) + ", kv_heads=" + std::to_string(kv_heads) +
                                ", block_size=" + std::to_string(block_size) +
                                ": need rows >= 0, heads a positive multiple of kv_heads, block_size a positive "
                                "multiple of " + std::to_string(kTile));
  Args a{ptr<float>(q), q_tok, q_head, reinterpret_cast<float*>(out), o_tok, o_head, ptr<float>(k), k_blk,
         k_head, k_tok, k_dim, ptr<float>(v), v_blk, v_head, v_tok, v_dim, ptr<int32_t>(qsl), ptr<int32_t>(seq_lens),
         ptr<int32_t>(block_table), bt_row, rows, heads, kv_heads, head_dim, block_size,
         static_cast<float>(scale)};
  const int group = heads / kv_heads;
  std::vector<Item> items;
  std::vector<int> groups{0};
  int64_t scratch_size = 0;
  for (int r = 0; r < rows; ++r) {
    const int q_len = a.qsl[r + 1] - a.qsl[r], seq_len = a.seq_lens[r];
    if (q_len <= 0) continue;
    if (q_len > seq_len)
      throw std::invalid_argument("verify_attention: row " + std::to_string(r) + " has " + std::to_string(q_len) +
                                  " query tokens but seq_len " + std::to_string(seq_len));
    for (int h = 0; h < kv_heads; ++h) {
      for (int s = 0; s < seq_len; s += kSpan) {
        items.push_back({r, h, s, std::min(seq_len, s + kSpan), scratch_size});
        scratch_size += static_cast<int64_t>(q_len) * group * (head_dim + 2);
      }
      groups.push_back(static_cast<int>(items.size()));
    }
  }
  if (items.empty()) return;
  std::vector<float> scratch(static_cast<size_t>(scratch_size));
  Kernels kernels;
  switch (head_dim) {
    case 64:
      kernels = pick<64>();
      break;
    case 128:
      kernels = pick<128>();
      break;
    default:
      throw std::invalid_argument("verify_attention: head_dim=" + std::to_string(head_dim) + ": must be 64 or 128");
  }
  const int n = static_cast<int>(items.size()), ng = static_cast<int>(groups.size()) - 1;
  float* work = scratch.data();
#pragma omp parallel for schedule(dynamic, 1)
  for (int i = 0; i < n; ++i) kernels.item(a, items[i], work);
#pragma omp parallel for schedule(static)
  for (int g = 0; g < ng; ++g) kernels.merge(a, items, groups[g], groups[g + 1] - groups[g], work);
}

}  // namespace

PYBIND11_MODULE(_cpu_attention, m) {
  m.doc() = "Causal attention of short query rows over vLLM's paged CPU KV cache (fp32); see verify_attention.cpp";
  m.def("attend", &attend, "One layer's attention for every row (pointers and strides in elements).");
  m.def("isa", &isa_name, "The instruction set the kernel runs with on this machine.");
  m.def("max_threads", []() { return omp_get_max_threads(); }, "OpenMP threads a call may use.");
  m.def("set_portable", [](bool on) { force_baseline = on; },
        "Run the portable (unvectorised) path even where AVX-512 is present (tests).");
  m.attr("SPAN") = kSpan;
  m.attr("TILE") = kTile;
}
