// KV compaction ("block rollback"): after tree verification, copy the accepted
// path's K/V from their slots to the sequence's next contiguous slots, for all
// layers and for K and V, in one launch (up to kMaxLayersPerLaunch layers;
// more layers take more launches). Semantics: compact_kv_ref in
// lookahead_vllm/ops/tree_attention.py.
//
// Why reads-before-writes holds without a grid-wide barrier. Split every
// slot's row (num_kv_heads * head_dim elements) into column chunks. The bytes
// of (layer, K|V, column chunk) over ALL slots are touched by exactly one CTA
// (grid.y = layer * 2 + kv, grid.x = column chunk), and no other CTA reads or
// writes them. Inside that CTA, phase 1 loads the chunk of every source slot
// into registers, __syncthreads(), phase 2 stores them at the destination
// slots. So every destination receives its source's value from before the
// call, for any overlap between sources and destinations (dst <= src along an
// accepted path included), exactly like the reference's clone-then-scatter.
// Independent CTAs never share bytes, so their order does not matter. The
// chunk width is chosen so one CTA holds n_slots * chunk <= 2048 vectors in
// registers (8 per thread), hence the LOOKAHEAD_COMPACT_MAX_SLOTS limit.
#include <cuda_runtime.h>
#include <stdint.h>

#include "lookahead_api.h"

#ifndef LOOKAHEAD_LAUNCH  // seam for tests/ops/emu (see tree_attention.cuh)
#define LOOKAHEAD_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#endif

namespace lookahead {
namespace {

constexpr int kCompactThreads = 256;
constexpr int kItemsPerThread = 8;
constexpr int kUnitsPerCta = kCompactThreads * kItemsPerThread;  // == LOOKAHEAD_COMPACT_MAX_SLOTS
constexpr int kMaxLayersPerLaunch = 64;  // by-value pointer arrays: 1 KiB of kernel parameters

static_assert(kUnitsPerCta == LOOKAHEAD_COMPACT_MAX_SLOTS, "one unit per slot at the limit");

struct CompactArgs {
  char* caches[2 * kMaxLayersPerLaunch];  // layer l: K at 2l, V at 2l + 1
  int64_t num_slots_total;                // num_blocks * block_size
  int block_size;
  int64_t stride_block, stride_token;     // bytes
  int64_t row_units;                      // slot row length in units of U
  int64_t head_units;                     // one head's length in units of U
  int64_t stride_head;                    // bytes between a slot's heads
  int chunk_units;                        // columns per CTA
  const int64_t* src;
  const int64_t* dst;
  int n;
};

__device__ __forceinline__ int64_t slot_offset(const CompactArgs& a, int64_t slot) {
  return (slot / a.block_size) * a.stride_block + (slot % a.block_size) * a.stride_token;
}

// Byte offset of unit `col` of a slot's row: heads may be strided (HND caches).
template <typename U>
__device__ __forceinline__ int64_t unit_offset(const CompactArgs& a, int64_t slot, int64_t col) {
  return slot_offset(a, slot) + (col / a.head_units) * a.stride_head + (col % a.head_units) * sizeof(U);
}

__device__ __forceinline__ bool valid_slot(const CompactArgs& a, int64_t slot) {
  return slot >= 0 && slot < a.num_slots_total;
}

// grid = (ceil(row_units / chunk_units), 2 * layers), block = kCompactThreads.
template <typename U>
__global__ void __launch_bounds__(kCompactThreads) compact_kv_kernel(const CompactArgs a) {
  char* cache = a.caches[blockIdx.y];
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * a.chunk_units;
  const int64_t left = a.row_units - col0;
  const int cols = static_cast<int>(left < a.chunk_units ? left : a.chunk_units);
  const int items = a.n * cols;  // <= kUnitsPerCta by construction
  U staged[kItemsPerThread];
  // Phase 1: read every source of this column chunk.
#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int q = threadIdx.x + k * kCompactThreads;
    if (q < items) {
      const int64_t slot = a.src[q / cols];
      if (valid_slot(a, slot)) {
        const char* from = cache + unit_offset<U>(a, slot, col0 + q % cols);
        staged[k] = *reinterpret_cast<const U*>(from);
      }
    }
  }
  __syncthreads();  // all reads of this chunk happen before any write to it
  // Phase 2: write the destinations.
#pragma unroll
  for (int k = 0; k < kItemsPerThread; ++k) {
    const int q = threadIdx.x + k * kCompactThreads;
    if (q < items) {
      const int64_t src = a.src[q / cols];
      const int64_t dst = a.dst[q / cols];
      if (valid_slot(a, src) && valid_slot(a, dst)) {
        char* to = cache + unit_offset<U>(a, dst, col0 + q % cols);
        *reinterpret_cast<U*>(to) = staged[k];
      }
    }
  }
}

// A slot row's head length and head stride in bytes (head_bytes = 0: one contiguous "head").
int64_t head_bytes(const LookaheadCompactParams* p) { return p->head_bytes > 0 ? p->head_bytes : p->row_bytes; }
int64_t head_stride(const LookaheadCompactParams* p) { return p->head_bytes > 0 ? p->stride_head_bytes : p->row_bytes; }

// Widest copy unit (16/8/4/2/1 bytes) that divides every pointer, stride, the head and the row.
int unit_bytes(const LookaheadCompactParams* p, int first, int count) {
  uint64_t bits = static_cast<uint64_t>(p->stride_block_bytes) |
                  static_cast<uint64_t>(p->stride_token_bytes) | static_cast<uint64_t>(p->row_bytes) |
                  static_cast<uint64_t>(head_bytes(p)) | static_cast<uint64_t>(head_stride(p));
  for (int l = first; l < first + count; ++l)
    bits |= reinterpret_cast<uintptr_t>(p->key_caches[l]) | reinterpret_cast<uintptr_t>(p->value_caches[l]);
  for (int u = 16; u > 1; u >>= 1)
    if ((bits & static_cast<uint64_t>(u - 1)) == 0) return u;
  return 1;
}

template <typename U>
int launch_chunk(const LookaheadCompactParams* p, int first, int count, cudaStream_t stream) {
  CompactArgs a;
  for (int l = 0; l < count; ++l) {
    a.caches[2 * l] = static_cast<char*>(p->key_caches[first + l]);
    a.caches[2 * l + 1] = static_cast<char*>(p->value_caches[first + l]);
  }
  a.num_slots_total = p->num_blocks * p->block_size;
  a.block_size = p->block_size;
  a.stride_block = p->stride_block_bytes;
  a.stride_token = p->stride_token_bytes;
  a.row_units = p->row_bytes / static_cast<int64_t>(sizeof(U));
  a.head_units = head_bytes(p) / static_cast<int64_t>(sizeof(U));
  a.stride_head = head_stride(p);
  const int64_t per_slot = kUnitsPerCta / p->num_slots;  // >= 1: num_slots <= kUnitsPerCta
  a.chunk_units = static_cast<int>(per_slot < a.row_units ? per_slot : a.row_units);
  a.src = p->src_slots;
  a.dst = p->dst_slots;
  a.n = p->num_slots;
  const int64_t chunks = (a.row_units + a.chunk_units - 1) / a.chunk_units;
  if (chunks > 0x7fffffff) return LOOKAHEAD_ERR_SIZE;
  const dim3 grid(static_cast<unsigned>(chunks), 2 * count);
  auto* kernel = compact_kv_kernel<U>;
  LOOKAHEAD_LAUNCH(kernel, grid, kCompactThreads, 0, stream, a);
  return cudaGetLastError() == cudaSuccess ? LOOKAHEAD_OK : LOOKAHEAD_ERR_CUDA;
}

int launch_layers(const LookaheadCompactParams* p, int first, int count, cudaStream_t stream) {
  switch (unit_bytes(p, first, count)) {
    case 16: return launch_chunk<uint4>(p, first, count, stream);
    case 8: return launch_chunk<uint2>(p, first, count, stream);
    case 4: return launch_chunk<uint32_t>(p, first, count, stream);
    case 2: return launch_chunk<uint16_t>(p, first, count, stream);
    default: return launch_chunk<uint8_t>(p, first, count, stream);
  }
}

}  // namespace
}  // namespace lookahead

extern "C" int lookahead_compact_kv(const LookaheadCompactParams* p, cudaStream_t stream) {
  if (p == nullptr) return LOOKAHEAD_ERR_NULL;
  if (p->num_layers < 0 || p->num_slots < 0 || p->num_slots > LOOKAHEAD_COMPACT_MAX_SLOTS ||
      p->num_blocks < 0 || p->block_size <= 0 || p->row_bytes < 0 || p->stride_block_bytes < 0 ||
      p->stride_token_bytes < 0 || p->head_bytes < 0 || p->stride_head_bytes < 0 ||
      (p->head_bytes > 0 && p->row_bytes % p->head_bytes != 0))
    return LOOKAHEAD_ERR_SIZE;
  if (p->num_layers == 0 || p->num_slots == 0 || p->row_bytes == 0) return LOOKAHEAD_OK;
  if (!p->key_caches || !p->value_caches || !p->src_slots || !p->dst_slots) return LOOKAHEAD_ERR_NULL;
  for (int l = 0; l < p->num_layers; ++l)
    if (!p->key_caches[l] || !p->value_caches[l]) return LOOKAHEAD_ERR_NULL;
  for (int first = 0; first < p->num_layers; first += lookahead::kMaxLayersPerLaunch) {
    const int left = p->num_layers - first;
    const int count = left < lookahead::kMaxLayersPerLaunch ? left : lookahead::kMaxLayersPerLaunch;
    const int rc = lookahead::launch_layers(p, first, count, stream);
    if (rc != LOOKAHEAD_OK) return rc;
  }
  return LOOKAHEAD_OK;
}
