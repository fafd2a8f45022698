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
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

// Stage keys [t0, t0 + kKvTile) of one KV head into shared memory as fp32.
// Keys at or past kv_end are zero-filled (a zero P times a garbage V could be NaN).
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(const LookaheadTreeAttnParams& p,
                                             const int32_t* block_table, int kv_head,
                                             int t0, int kv_end, float* k_s, float* v_s) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte load
  constexpr int kVecsPerRow = D / kVec;
  const T* k_cache = static_cast<const T*>(p.key_cache);
  const T* v_cache = static_cast<const T*>(p.value_cache);
  for (int i = threadIdx.x; i < kKvTile * kVecsPerRow; i += kThreads) {
    const int kk = i / kVecsPerRow;
    const int c = i % kVecsPerRow;
    const int pos = t0 + kk;
    float kf[kVec], vf[kVec];
    if (pos < kv_end) {
      const int64_t block = block_table[pos / p.block_size];
      const int64_t off = block * p.kv_stride_block +
                          static_cast<int64_t>(pos % p.block_size) * p.kv_stride_token +
                          static_cast<int64_t>(kv_head) * p.kv_stride_head + c * kVec;
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

  const int req = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int split = blockIdx.x % s.num_splits;
  const int tile = blockIdx.x / s.num_splits;
  const int q_begin = p.query_start_loc[req];
  const int q_len = p.query_start_loc[req + 1] - q_begin;
  const int group = p.num_heads / p.num_kv_heads;
  const int num_rows = q_len * group;
  const int row_begin = tile * kRowsPerCta;
  if (q_len <= 0 || row_begin >= num_rows) return;  // uniform over the CTA
  const int seq_len = p.seq_lens[req];
  const int ctx_len = seq_len - q_len;
  const int kv_begin = split * s.chunk;
  const int kv_end = min(seq_len, kv_begin + s.chunk);
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(req) * p.max_blocks_per_seq;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  // Query rows, pre-scaled into the log2 domain; rows past num_rows are zero.
  const T* query = static_cast<const T*>(p.query);
  const float q_scale = p.scale * kLog2e;
  for (int i = threadIdx.x; i < kRowsPerCta * D; i += kThreads) {
    const int row = row_begin + i / D;
    float x = 0.f;
    if (row < num_rows) {
      const int64_t token = q_begin + row / group;
      const int64_t head = static_cast<int64_t>(kv_head) * group + row % group;
      x = to_float(query[token * p.q_stride_token + head * p.q_stride_head + i % D]) * q_scale;
    }
    q_s[i] = x;
  }

  // This warp's rows: their tokens' tree-mask rows (padding rows reuse the last real one).
  int mask_token[kRowsPerWarp];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j)
    mask_token[j] = q_begin + min(row_begin + warp * kRowsPerWarp + j, num_rows - 1) / group;

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
  const bool warp_active = row_begin + warp * kRowsPerWarp < num_rows;
  for (int t0 = kv_begin; t0 < kv_end; t0 += kKvTile) {
    __syncthreads();  // the previous tile (and q_s on the first pass) is done with
    load_kv_tile<T, D>(p, block_table, kv_head, t0, kv_end, k_s, v_s);
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
    const bool in_range = pos < kv_end;
    const int bit = pos - ctx_len;  // tail index when >= 0 (always < q_len in range)
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
    const int row = row_begin + warp * kRowsPerWarp + j;
    if (row >= num_rows) continue;  // warp-uniform
    const int64_t token = q_begin + row / group;
    const int64_t head = static_cast<int64_t>(kv_head) * group + row % group;
    const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
    if (s.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + token * p.o_stride_token + head * p.o_stride_head;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) out[lane + 32 * i] = from_float<T>(acc[j][i] * inv);
    } else {
      const int64_t prow = (static_cast<int64_t>(split) * p.num_tokens + token) * p.num_heads + head;
      float* po = s.partial_out + prow * D;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) po[lane + 32 * i] = acc[j][i] * inv;
      if (lane == 0) s.partial_lse[prow] = l_sum > 0.f ? m[j] + log2f(l_sum) : -INFINITY;
    }
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

}  // namespace lookahead
