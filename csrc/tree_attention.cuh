// Paged-KV tree attention: device kernels. Semantics are those of
// paged_tree_attention_ref in lookahead_vllm/ops/tree_attention.py; the
// launcher (tree_attention.cu) checks inputs and picks the split.
//
// Work split. A request's query rows, times the `group = num_heads /
// num_kv_heads` query heads that share one KV head, form `q_len * group`
// (token, head) *rows* that all read the same K/V. One CTA owns up to 32 such
// rows for one KV head (grid.y) of one request (grid.z), so each K/V tile is
// loaded once per 32 rows instead of once per row: for a 64-node tree with
// GQA group 4 that is 8 CTAs instead of 256 re-reading the context. When
// those CTAs cannot fill the GPU (decode-sized batches), the KV range is also
// split across CTAs (grid.x = q_tiles * num_splits, flash-decoding style):
// each split writes a normalised partial output and its log-sum-exp, and a
// second kernel merges the splits. The context tiles and the masked tail are
// one loop: a key is visible if it is in range and either a context token or
// a tail token whose bit is set in the row's tree-mask word.
//
// Inside a CTA (4 warps x 8 rows each; warps with only padding rows just load): K/V tiles of 32 tokens are staged in
// shared memory as fp32 (K rows padded by 4 floats so lane-per-key float4
// reads are bank-conflict free). For each tile a warp computes the 32 scores
// of its 8 rows with lane j owning key j (q broadcast from shared memory),
// applies the mask, does the online-softmax update (one warp max per row and
// tile; the running sum stays per lane and is reduced once at the end), then
// accumulates P.V with lane d owning output dims d, d+32, ... and p_j taken
// from lane j by a shuffle. All arithmetic is fp32 (scores in the log2
// domain: q is pre-scaled by scale * log2(e), so exp2f replaces expf).
//
// fp16/bf16 on sm_80+ use tree_attention_mma_kernel instead (bottom of this
// file): the same rows/splits/mask semantics, with both matrix products on
// tensor cores (WMMA 16x16x16, fp32 accumulation) and cp.async K/V staging.
// The fp32 kernel above stays the path for fp32 and for older GPUs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>
#include <string.h>

#include "lookahead_api.h"

// Seams for tests/ops/emu (runs these kernels as host threads on CPU-only
// machines); CUDA builds use the defaults.
#ifndef LOOKAHEAD_DYNAMIC_SMEM
#define LOOKAHEAD_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif
#ifndef LOOKAHEAD_LAUNCH
#define LOOKAHEAD_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

namespace lookahead {

constexpr int kKvTile = 32;          // keys per shared-memory tile (one per lane)
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 8;
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr unsigned kFullMask = 0xffffffffu;

// How the KV range is split across CTAs for one launch.
struct SplitArgs {
  int q_tiles;          // CTAs per (request, kv head) along the rows
  int num_splits;       // CTAs per (request, kv head, q tile) along the KV range
  int chunk;            // keys per split, a multiple of kKvTile
  float* partial_out;   // [num_splits, num_tokens, num_heads, head_dim] (num_splits > 1)
  float* partial_lse;   // [num_splits, num_tokens, num_heads], log2 domain
};

template <int D>
struct SmemLayout {
  static constexpr int kKStride = D + 4;  // padded K row (floats)
  static constexpr int kQFloats = kRowsPerCta * D;
  static constexpr int kKFloats = kKvTile * kKStride;
  static constexpr int kVFloats = kKvTile * D;
  static constexpr size_t kBytes = sizeof(float) * (kQFloats + kKFloats + kVFloats);
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(kFullMask, x, o);
  return x;
}

// The (token, head) rows one CTA owns, and the keys it reads: grid.z = request,
// grid.y = KV head, grid.x = q tile * num_splits + KV split (see the top of this file).
struct CtaRows {
  int kv_head, split;
  int q_begin, group, num_rows;  // the request's first token; q_len * group rows in all
  int row_begin;                 // this CTA's first row
  int ctx_len;                   // committed tokens; tail (tree) tokens follow
  int kv_begin, kv_end;          // this split's keys
  const int32_t* block_table;
  int block_shift;               // log2(block_size) when that is a power of two (no division), else -1

  __device__ __forceinline__ CtaRows(const LookaheadTreeAttnParams& p, const SplitArgs& s, int rows_per_cta) {
    const int req = blockIdx.z;
    kv_head = blockIdx.y;
    split = blockIdx.x % s.num_splits;
    q_begin = p.query_start_loc[req];
    const int q_len = p.query_start_loc[req + 1] - q_begin;
    group = p.num_heads / p.num_kv_heads;
    num_rows = q_len * group;
    row_begin = blockIdx.x / s.num_splits * rows_per_cta;
    const int seq_len = p.seq_lens[req];
    ctx_len = seq_len - q_len;
    kv_begin = split * s.chunk;
    kv_end = min(seq_len, kv_begin + s.chunk);
    block_table = p.block_tables + static_cast<int64_t>(req) * p.max_blocks_per_seq;
    block_shift = (p.block_size & (p.block_size - 1)) == 0 ? __ffs(p.block_size) - 1 : -1;
  }
  // No rows for this CTA (uniform over the CTA).
  __device__ __forceinline__ bool idle() const { return num_rows <= 0 || row_begin >= num_rows; }
  __device__ __forceinline__ int64_t token(int row) const { return q_begin + row / group; }
  __device__ __forceinline__ int64_t head(int row) const {
    return static_cast<int64_t>(kv_head) * group + row % group;
  }
  // Offset (elements) of key `pos`'s row for this CTA's KV head in the paged K or V cache.
  __device__ __forceinline__ int64_t kv_offset(const LookaheadTreeAttnParams& p, int pos) const {
    const int block_pos = block_shift >= 0 ? pos >> block_shift : pos / p.block_size;
    const int in_block = pos - block_pos * p.block_size;
    return static_cast<int64_t>(block_table[block_pos]) * p.kv_stride_block +
           static_cast<int64_t>(in_block) * p.kv_stride_token + static_cast<int64_t>(kv_head) * p.kv_stride_head;
  }
};

// Epilogue of one row: normalise and write the output row, or (KV split) this
// split's partial output and log-sum-exp. value(i): the row's unnormalised
// output at dim lane + 32 * i; m: its running max (log2 domain); l_sum: its sum.
template <typename T, int D, typename Value>
__device__ __forceinline__ void write_row(const LookaheadTreeAttnParams& p, const SplitArgs& s,
                                          const CtaRows& c, int row, float m, float l_sum, int lane,
                                          Value value) {
  const int64_t token = c.token(row), head = c.head(row);
  const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
  if (s.num_splits == 1) {
    T* out = static_cast<T*>(p.out) + token * p.o_stride_token + head * p.o_stride_head;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) out[lane + 32 * i] = from_float<T>(value(i) * inv);
  } else {
    const int64_t prow = (static_cast<int64_t>(c.split) * p.num_tokens + token) * p.num_heads + head;
    float* po = s.partial_out + prow * D;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) po[lane + 32 * i] = value(i) * inv;
    if (lane == 0) s.partial_lse[prow] = l_sum > 0.f ? m + log2f(l_sum) : -INFINITY;
  }
}

// Stage keys [t0, t0 + kKvTile) of the CTA's KV head into shared memory as fp32.
// Keys at or past kv_end are zero-filled (a zero P times a garbage V could be NaN).
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(const LookaheadTreeAttnParams& p, const CtaRows& cta, int t0,
                                             float* k_s, float* v_s) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  constexpr int kVecsPerRow = D / kVec;
  const T* k_cache = static_cast<const T*>(p.key_cache);
  const T* v_cache = static_cast<const T*>(p.value_cache);
  for (int i = threadIdx.x; i < kKvTile * kVecsPerRow; i += kThreads) {
    const int kk = i / kVecsPerRow;
    const int c = i % kVecsPerRow;
    const int pos = t0 + kk;
    float kf[kVec], vf[kVec];
    if (pos < cta.kv_end) {
      const int64_t off = cta.kv_offset(p, pos) + c * kVec;
      // One 16-byte load each; memcpy (register moves) rather than pointer punning,
      // which is undefined behaviour a host compiler exploits (tests/ops/emu).
      const uint4 kr = *reinterpret_cast<const uint4*>(k_cache + off);
      const uint4 vr = *reinterpret_cast<const uint4*>(v_cache + off);
      T ke[kVec], ve[kVec];
      memcpy(ke, &kr, sizeof(kr));
      memcpy(ve, &vr, sizeof(vr));
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        kf[e] = to_float(ke[e]);
        vf[e] = to_float(ve[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) kf[e] = vf[e] = 0.f;
    }
    float* kd = k_s + kk * SmemLayout<D>::kKStride + c * kVec;
    float* vd = v_s + kk * D + c * kVec;
#pragma unroll
    for (int e = 0; e < kVec; e += 4) {
      *reinterpret_cast<float4*>(kd + e) = make_float4(kf[e], kf[e + 1], kf[e + 2], kf[e + 3]);
      *reinterpret_cast<float4*>(vd + e) = make_float4(vf[e], vf[e + 1], vf[e + 2], vf[e + 3]);
    }
  }
}

// grid = (q_tiles * num_splits, num_kv_heads, num_reqs), block = kThreads,
// dynamic shared memory = SmemLayout<D>::kBytes.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    tree_attention_kernel(const LookaheadTreeAttnParams p, const SplitArgs s) {
  static_assert(D % 32 == 0 && D % (16 / sizeof(T)) == 0, "head_dim");
  constexpr int kDimsPerLane = D / 32;
  LOOKAHEAD_DYNAMIC_SMEM(float4, smem_f4);
  float* q_s = reinterpret_cast<float*>(smem_f4);
  float* k_s = q_s + SmemLayout<D>::kQFloats;
  float* v_s = k_s + SmemLayout<D>::kKFloats;

  const CtaRows c(p, s, kRowsPerCta);
  if (c.idle()) return;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // Query rows, pre-scaled into the log2 domain; rows past num_rows are zero.
  const T* query = static_cast<const T*>(p.query);
  const float q_scale = p.scale * kLog2e;
  for (int i = threadIdx.x; i < kRowsPerCta * D; i += kThreads) {
    const int row = c.row_begin + i / D;
    float x = 0.f;
    if (row < c.num_rows) {
      const int64_t token = c.token(row), head = c.head(row);
      x = to_float(query[token * p.q_stride_token + head * p.q_stride_head + i % D]) * q_scale;
    }
    q_s[i] = x;
  }

  // This warp's rows: their tokens' tree-mask rows (padding rows reuse the last real one).
  int mask_token[kRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j)
    mask_token[j] = static_cast<int>(c.token(min(c.row_begin + warp * kRowsPerWarp + j, c.num_rows - 1)));

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kDimsPerLane];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[j][i] = 0.f;
  }

  const float* q_warp = q_s + warp * kRowsPerWarp * D;
  // Warps whose rows are all padding (small trees) only help load the tiles.
  const bool warp_active = c.row_begin + warp * kRowsPerWarp < c.num_rows;
  for (int t0 = c.kv_begin; t0 < c.kv_end; t0 += kKvTile) {
    __syncthreads();  // the previous tile (and q_s on the first pass) is done with
    load_kv_tile<T, D>(p, c, t0, k_s, v_s);
    __syncthreads();
    if (!warp_active) continue;  // warp-uniform; the barriers above are outside

    // Scores: lane owns key t0 + lane.
    float sc[kRowsPerWarp];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) sc[j] = 0.f;
    const float* k_row = k_s + lane * SmemLayout<D>::kKStride;
#pragma unroll 4
    for (int d = 0; d < D; d += 4) {
      const float4 k4 = *reinterpret_cast<const float4*>(k_row + d);
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const float4 q4 = *reinterpret_cast<const float4*>(q_warp + j * D + d);
        sc[j] += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
      }
    }

    // Mask: out of range, or a tail token the row's tree mask does not show.
    const int pos = t0 + lane;
    const bool in_range = pos < c.kv_end;
    const int bit = pos - c.ctx_len;  // tail index when >= 0 (always < q_len in range)
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      bool visible = in_range;
      if (visible && bit >= 0) {
        const int64_t word = p.tree_mask[static_cast<int64_t>(mask_token[j]) * p.mask_words + (bit >> 6)];
        visible = (word >> (bit & 63)) & 1;
      }
      if (!visible) sc[j] = -INFINITY;
    }

    // Online softmax; sc becomes p.
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const float m_new = fmaxf(m[j], warp_max(sc[j]));  // warp-uniform
      float alpha = 1.f;
      float pj = 0.f;
      if (m_new != -INFINITY) {
        alpha = exp2f(m[j] - m_new);
        pj = exp2f(sc[j] - m_new);
      }
      m[j] = m_new;
      l[j] = l[j] * alpha + pj;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) acc[j][i] *= alpha;
      sc[j] = pj;
    }

    // P.V: lane owns dims lane, lane + 32, ...
#pragma unroll 8
    for (int kk = 0; kk < kKvTile; ++kk) {
      float v[kDimsPerLane];
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) v[i] = v_s[kk * D + lane + 32 * i];
#pragma unroll
      for (int j = 0; j < kRowsPerWarp; ++j) {
        const float pk = __shfl_sync(kFullMask, sc[j], kk);
#pragma unroll
        for (int i = 0; i < kDimsPerLane; ++i) acc[j][i] += pk * v[i];
      }
    }
  }

  // Epilogue: normalise; write the output row, or this split's partial + lse.
  if (!warp_active) return;
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const float l_sum = warp_sum(l[j]);
    const int row = c.row_begin + warp * kRowsPerWarp + j;
    if (row >= c.num_rows) continue;  // warp-uniform
    write_row<T, D>(p, s, c, row, m[j], l_sum, lane, [&](int i) { return acc[j][i]; });
  }
}

// Merge the KV splits: grid = (num_tokens, num_heads), block = D threads.
template <typename T, int D>
__global__ void __launch_bounds__(D)
    tree_attention_merge_kernel(const LookaheadTreeAttnParams p, const SplitArgs s) {
  const int token = blockIdx.x;
  const int head = blockIdx.y;
  const int d = threadIdx.x;
  if (token < p.query_start_loc[0] || token >= p.query_start_loc[p.num_reqs]) return;
  const int64_t stride = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int64_t row = static_cast<int64_t>(token) * p.num_heads + head;
  float lse_max = -INFINITY;
  for (int sp = 0; sp < s.num_splits; ++sp) lse_max = fmaxf(lse_max, s.partial_lse[sp * stride + row]);
  float num = 0.f, den = 0.f;
  if (lse_max != -INFINITY) {
    for (int sp = 0; sp < s.num_splits; ++sp) {
      const float w = exp2f(s.partial_lse[sp * stride + row] - lse_max);
      den += w;
      num += w * s.partial_out[(sp * stride + row) * D + d];
    }
  }
  T* out = static_cast<T*>(p.out) + token * p.o_stride_token + head * p.o_stride_head;
  out[d] = from_float<T>(den > 0.f ? num / den : 0.f);
}

// ---------------------------------------------------------------------------
// Tensor-core path (fp16/bf16, sm_80+). One CTA = 4 warps x 16 rows = 64
// (token, head) rows of one KV head, as above; KV tiles of 64 keys. Per tile:
//   S = Q K^T      WMMA, each warp its 16 rows x 64 keys, fp32, to shared memory;
//   softmax        SIMT over the warp's S rows (lane j owns keys j, j + 32):
//                  scale into the log2 domain, tree mask, online max/sum, P in
//                  the storage dtype to shared memory, O rows rescaled by alpha;
//   O += P V       WMMA with the fp32 O tile kept in shared memory (loaded
//                  into accumulators, updated, stored back).
// K and V are staged with cp.async into one buffer each; the next tile's K
// loads while this tile's softmax and P.V run, the next V while the next S
// runs. Keys past the split's end are zero-filled (P = 0 times a NaN slot
// would be NaN). The accepted error is that of P rounded to the storage dtype
// before P.V, as in FlashAttention.
constexpr int kMmaWarps = 4;
constexpr int kMmaRowsPerWarp = 16;
constexpr int kMmaRowsPerCta = kMmaWarps * kMmaRowsPerWarp;
constexpr int kMmaKvTile = 64;
constexpr int kMmaThreads = kMmaWarps * 32;

// Byte layout of the dynamic shared memory: K tile, V tile, then per warp its
// scores S (fp32; P, in the storage dtype, overwrites S row by row: P row r
// only reaches S rows <= r, already consumed) and its fp32 O tile. Q is staged
// once over the warps' areas before the loop. Every region and row offset
// WMMA touches is a multiple of 32 bytes.
template <typename T, int D>
struct MmaSmem {
  static constexpr int kLd = D + 8;            // T per staged Q/K/V row (+16 bytes: no bank conflicts)
  static constexpr int kSLd = kMmaKvTile + 4;  // floats per score row
  static constexpr int kPLd = kMmaKvTile + 8;  // T per probability row
  static constexpr int kOLd = D + 4;           // floats per output row
  static constexpr size_t kQ = sizeof(T) * kMmaRowsPerCta * kLd;
  static constexpr size_t kKV = sizeof(T) * kMmaKvTile * kLd;
  static constexpr size_t kS = sizeof(float) * kMmaRowsPerWarp * kSLd;  // per warp, P in place
  static constexpr size_t kO = sizeof(float) * kMmaRowsPerWarp * kOLd;  // per warp
  static constexpr size_t kWarp = kS + kO;
  static constexpr size_t kBytes = 2 * kKV + kMmaWarps * kWarp;
  static_assert(kKV % 32 == 0 && kS % 32 == 0 && kO % 32 == 0);
  static_assert(sizeof(T) * kPLd <= sizeof(float) * kSLd && kQ <= kMmaWarps * kWarp, "aliasing");
};

// 16-byte global -> shared copy: cp.async on sm_80+, a plain copy elsewhere (host emulation).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
#else
  memcpy(smem, gmem, 16);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most `pending` committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
#endif
}

// Start copying keys [t0, t0 + kMmaKvTile) of the CTA's KV head of `cache` into `dst` ([key][kLd]).
template <typename T, int D>
__device__ __forceinline__ void stage_kv_tile(const LookaheadTreeAttnParams& p, const CtaRows& cta,
                                              const T* cache, int t0, T* dst) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecsPerRow = D / kVec;
  for (int i = threadIdx.x; i < kMmaKvTile * kVecsPerRow; i += kMmaThreads) {
    const int kk = i / kVecsPerRow;
    const int c = i % kVecsPerRow;
    const int pos = t0 + kk;
    T* d = dst + kk * MmaSmem<T, D>::kLd + c * kVec;
    if (pos < cta.kv_end) {
      cp_async16(d, cache + cta.kv_offset(p, pos) + c * kVec);
    } else {
      const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
      memcpy(d, &zero, sizeof(zero));
    }
  }
}

// grid = (q_tiles * num_splits, num_kv_heads, num_reqs), block = kMmaThreads,
// dynamic shared memory = MmaSmem<T, D>::kBytes.
template <typename T, int D>
__global__ void __launch_bounds__(kMmaThreads)
    tree_attention_mma_kernel(const LookaheadTreeAttnParams p, const SplitArgs s) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  using L = MmaSmem<T, D>;
  using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
  using FragKt = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;  // K^T from [key][d]
  using FragV = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
  using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  static_assert(D % 16 == 0 && kMmaKvTile == 64, "lane j owns keys j and j + 32");
  constexpr int kKeyBlocks = kMmaKvTile / 16;

  LOOKAHEAD_DYNAMIC_SMEM(float4, smem_f4);
  char* smem = reinterpret_cast<char*>(smem_f4);
  T* k_s = reinterpret_cast<T*>(smem);
  T* v_s = reinterpret_cast<T*>(smem + L::kKV);
  T* q_s = reinterpret_cast<T*>(smem + 2 * L::kKV);  // before the loop only: the warps' areas
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  char* warp_smem = smem + 2 * L::kKV + warp * L::kWarp;
  float* s_s = reinterpret_cast<float*>(warp_smem);
  T* p_s = reinterpret_cast<T*>(warp_smem);  // overwrites s_s row by row
  float* o_s = reinterpret_cast<float*>(warp_smem + L::kS);

  const CtaRows c(p, s, kMmaRowsPerCta);
  if (c.idle()) return;
  const T* k_cache = static_cast<const T*>(p.key_cache);
  const T* v_cache = static_cast<const T*>(p.value_cache);

  // First K and V tiles in flight while Q is staged (rows past num_rows are zero).
  stage_kv_tile<T, D>(p, c, k_cache, c.kv_begin, k_s);
  cp_async_commit();
  stage_kv_tile<T, D>(p, c, v_cache, c.kv_begin, v_s);
  cp_async_commit();
  const T* query = static_cast<const T*>(p.query);
  for (int i = threadIdx.x; i < kMmaRowsPerCta * D; i += kMmaThreads) {
    const int r = i / D;
    const int row = c.row_begin + r;
    T x = from_float<T>(0.f);
    if (row < c.num_rows) {
      const int64_t token = c.token(row), head = c.head(row);
      x = query[token * p.q_stride_token + head * p.q_stride_head + i % D];
    }
    q_s[r * L::kLd + i % D] = x;
  }

  const int warp_row = c.row_begin + warp * kMmaRowsPerWarp;
  const bool warp_active = warp_row < c.num_rows;  // warps of padding rows only help stage tiles
  const int live_rows = min(kMmaRowsPerWarp, c.num_rows - warp_row);  // the rest are padding
  int mask_token[kMmaRowsPerWarp];
  float m[kMmaRowsPerWarp], l[kMmaRowsPerWarp];  // l: this lane's share of the row sum
#pragma unroll
  for (int r = 0; r < kMmaRowsPerWarp; ++r) {
    mask_token[r] = static_cast<int>(c.token(min(warp_row + r, c.num_rows - 1)));
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const float log2_scale = p.scale * kLog2e;

  __syncthreads();  // q_s staged
  FragA q_frag[D / 16];
  if (warp_active) {
#pragma unroll
    for (int kd = 0; kd < D / 16; ++kd)
      wmma::load_matrix_sync(q_frag[kd], q_s + warp * kMmaRowsPerWarp * L::kLd + kd * 16, L::kLd);
  }
  __syncthreads();  // every warp holds its Q fragments: the warps' areas are free
  for (int i = lane; i < kMmaRowsPerWarp * L::kOLd; i += 32) o_s[i] = 0.f;

  for (int t0 = c.kv_begin; t0 < c.kv_end; t0 += kMmaKvTile) {
    const int next = t0 + kMmaKvTile;
    cp_async_wait<1>();  // this tile's K has landed (its V may still be in flight)
    __syncthreads();
    if (warp_active) {
#pragma unroll
      for (int n = 0; n < kKeyBlocks; ++n) {
        FragAcc s_frag;
        wmma::fill_fragment(s_frag, 0.f);
#pragma unroll
        for (int kd = 0; kd < D / 16; ++kd) {
          FragKt k_frag;
          wmma::load_matrix_sync(k_frag, k_s + n * 16 * L::kLd + kd * 16, L::kLd);
          wmma::mma_sync(s_frag, q_frag[kd], k_frag, s_frag);
        }
        wmma::store_matrix_sync(s_s + n * 16, s_frag, L::kSLd, wmma::mem_row_major);
      }
    }
    __syncthreads();  // every warp is done with k_s: the next K may land there
    if (next < c.kv_end) stage_kv_tile<T, D>(p, c, k_cache, next, k_s);
    cp_async_commit();

    if (warp_active) {
      __syncwarp();  // S rows stored by the warp's WMMA
#pragma unroll
      for (int r = 0; r < kMmaRowsPerWarp; ++r) {
        if (r >= live_rows) break;  // warp-uniform: padding rows' P and O stay garbage, never read
        float x[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pos = t0 + lane + 32 * h;
          bool visible = pos < c.kv_end;
          const int bit = pos - c.ctx_len;  // tail index when >= 0
          if (visible && bit >= 0) {
            const int64_t word = p.tree_mask[static_cast<int64_t>(mask_token[r]) * p.mask_words + (bit >> 6)];
            visible = (word >> (bit & 63)) & 1;
          }
          x[h] = visible ? s_s[r * L::kSLd + lane + 32 * h] * log2_scale : -INFINITY;
        }
        const float m_new = fmaxf(m[r], warp_max(fmaxf(x[0], x[1])));  // warp-uniform
        float alpha = 1.f, p0 = 0.f, p1 = 0.f;
        if (m_new != -INFINITY) {
          alpha = exp2f(m[r] - m_new);
          p0 = exp2f(x[0] - m_new);
          p1 = exp2f(x[1] - m_new);
        }
        m[r] = m_new;
        l[r] = l[r] * alpha + p0 + p1;
        // P row r overlays S rows <= r, which other lanes read: order those reads
        // before these writes (the shuffles above order execution, not memory).
        __syncwarp();
        p_s[r * L::kPLd + lane] = from_float<T>(p0);
        p_s[r * L::kPLd + lane + 32] = from_float<T>(p1);
#pragma unroll
        for (int d = lane; d < D; d += 32) o_s[r * L::kOLd + d] *= alpha;
      }
      __syncwarp();  // P and the rescaled O rows are visible to the warp's WMMA
    }
    cp_async_wait<1>();  // this tile's V has landed (the next K may still be in flight)
    __syncthreads();
    if (warp_active) {
      FragA p_frag[kKeyBlocks];
#pragma unroll
      for (int kk = 0; kk < kKeyBlocks; ++kk) wmma::load_matrix_sync(p_frag[kk], p_s + kk * 16, L::kPLd);
#pragma unroll 2
      for (int n = 0; n < D / 16; ++n) {
        FragAcc o_frag;
        wmma::load_matrix_sync(o_frag, o_s + n * 16, L::kOLd, wmma::mem_row_major);
#pragma unroll
        for (int kk = 0; kk < kKeyBlocks; ++kk) {
          FragV v_frag;
          wmma::load_matrix_sync(v_frag, v_s + kk * 16 * L::kLd + n * 16, L::kLd);
          wmma::mma_sync(o_frag, p_frag[kk], v_frag, o_frag);
        }
        wmma::store_matrix_sync(o_s + n * 16, o_frag, L::kOLd, wmma::mem_row_major);
      }
    }
    __syncthreads();  // every warp is done with v_s: the next V may land there
    if (next < c.kv_end) stage_kv_tile<T, D>(p, c, v_cache, next, v_s);
    cp_async_commit();
  }
  cp_async_wait<0>();

  // Epilogue: normalise; write the output row, or this split's partial + lse.
  if (!warp_active) return;
  __syncwarp();
#pragma unroll
  for (int r = 0; r < kMmaRowsPerWarp; ++r) {
    const float l_sum = warp_sum(l[r]);
    const int row = warp_row + r;
    if (row >= c.num_rows) break;  // warp-uniform; later rows are padding too
    const float* o_row = o_s + r * L::kOLd;
    write_row<T, D>(p, s, c, row, m[r], l_sum, lane, [&](int i) { return o_row[lane + 32 * i]; });
  }
#endif
}

}  // namespace lookahead
