// Paged-KV tree attention: launcher. Checks sizes, strides and alignment,
// picks the kernel (tensor cores for fp16/bf16 on sm_80+, the fp32 SIMT kernel
// otherwise), plans the KV split, and instantiates the kernels of
// tree_attention.cuh for fp32/fp16/bf16 x head_dim 64/128 (adding a head_dim is
// one `case` here and in the checks). Plain CUDA runtime, no torch: CI compiles
// this file on machines without a GPU.
#include <cuda_runtime.h>

#include <type_traits>

#include "lookahead_api.h"
#include "tree_attention.cuh"

namespace lookahead {
namespace {

constexpr int kMinKeysPerSplit = 128;
constexpr int kMaxSplits = 32;
constexpr int kCtasPerSmTarget = 2;   // split until the grid reaches 2 CTAs per SM

// The kernel a launch uses and the rows/keys one of its CTAs covers per tile.
struct KernelShape {
  bool mma;
  int rows_per_cta;
  int kv_tile;
};

struct Plan {
  KernelShape shape{false, kRowsPerCta, kKvTile};
  int q_tiles = 0;
  int num_splits = 1;
  int chunk = 0;
  size_t partial_out_bytes = 0;
  size_t workspace_bytes = 0;
};

int element_size(int dtype) { return dtype == LOOKAHEAD_FP32 ? 4 : 2; }

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

int check_params(const LookaheadTreeAttnParams* p) {
  if (p == nullptr) return LOOKAHEAD_ERR_NULL;
  if (p->dtype != LOOKAHEAD_FP32 && p->dtype != LOOKAHEAD_FP16 && p->dtype != LOOKAHEAD_BF16)
    return LOOKAHEAD_ERR_DTYPE;
  if (p->head_dim != 64 && p->head_dim != 128) return LOOKAHEAD_ERR_HEAD_DIM;
  if (p->num_heads <= 0 || p->num_kv_heads <= 0 || p->num_heads % p->num_kv_heads != 0 ||
      p->num_kv_heads > 65535 || p->num_heads > 65535)
    return LOOKAHEAD_ERR_HEADS;
  if (p->num_tokens < 0 || p->num_reqs < 0 || p->num_reqs > 65535 || p->block_size <= 0 ||
      p->max_blocks_per_seq < 0 || p->mask_words < 0 || p->max_query_len < 0 ||
      p->max_seq_len < p->max_query_len ||
      static_cast<int64_t>(p->mask_words) * 64 < p->max_query_len ||
      static_cast<int64_t>(p->max_blocks_per_seq) * p->block_size < p->max_seq_len)
    return LOOKAHEAD_ERR_SIZE;
  if (p->num_tokens == 0 || p->num_reqs == 0 || p->max_query_len == 0) return LOOKAHEAD_OK;
  if (!p->query || !p->key_cache || !p->value_cache || !p->block_tables || !p->seq_lens ||
      !p->query_start_loc || !p->tree_mask || !p->out)
    return LOOKAHEAD_ERR_NULL;
  const int64_t esize = element_size(p->dtype);
  if (!aligned16(p->key_cache) || !aligned16(p->value_cache) ||
      (p->kv_stride_block * esize) % 16 != 0 || (p->kv_stride_token * esize) % 16 != 0 ||
      (p->kv_stride_head * esize) % 16 != 0)
    return LOOKAHEAD_ERR_ALIGNMENT;
  return LOOKAHEAD_OK;
}

// The current device's attribute, or -1.
int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess) return -1;
  return value;
}

// Rows -> q tiles; then split the KV range while the grid is under
// kCtasPerSmTarget CTAs per SM and every split keeps >= kMinKeysPerSplit keys.
int make_plan(const LookaheadTreeAttnParams* p, Plan* plan) {
  const int sms = device_attribute(cudaDevAttrMultiProcessorCount);
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor);
  if (sms <= 0 || major < 0) return LOOKAHEAD_ERR_CUDA;
  const KernelShape shape = p->dtype != LOOKAHEAD_FP32 && major >= 8
                                ? KernelShape{true, kMmaRowsPerCta, kMmaKvTile}
                                : KernelShape{false, kRowsPerCta, kKvTile};
  const int64_t group = p->num_heads / p->num_kv_heads;
  const int64_t q_tiles = (p->max_query_len * group + shape.rows_per_cta - 1) / shape.rows_per_cta;
  const int64_t kv_tiles = (static_cast<int64_t>(p->max_seq_len) + shape.kv_tile - 1) / shape.kv_tile;
  const int64_t min_tiles = (kMinKeysPerSplit + shape.kv_tile - 1) / shape.kv_tile;
  const int64_t base_ctas = static_cast<int64_t>(p->num_reqs) * p->num_kv_heads * q_tiles;
  int64_t splits = 1;
  const int64_t target = static_cast<int64_t>(kCtasPerSmTarget) * sms;
  if (2 * base_ctas <= target && kv_tiles >= 2 * min_tiles) {
    splits = target / base_ctas;  // rounded down: a partly filled extra wave costs a whole one
    if (splits > kv_tiles / min_tiles) splits = kv_tiles / min_tiles;
    if (splits > kMaxSplits) splits = kMaxSplits;
  }
  const int64_t chunk_tiles = kv_tiles > 0 ? (kv_tiles + splits - 1) / splits : 1;
  splits = kv_tiles > 0 ? (kv_tiles + chunk_tiles - 1) / chunk_tiles : 1;  // no empty tail split
  if (q_tiles * splits > 0x7fffffff) return LOOKAHEAD_ERR_SIZE;
  plan->shape = shape;
  plan->q_tiles = static_cast<int>(q_tiles);
  plan->num_splits = static_cast<int>(splits);
  plan->chunk = static_cast<int>(chunk_tiles * shape.kv_tile);
  plan->partial_out_bytes = 0;
  plan->workspace_bytes = 0;
  if (splits > 1) {
    const size_t rows = static_cast<size_t>(splits) * p->num_tokens * p->num_heads;
    plan->partial_out_bytes = (rows * p->head_dim * sizeof(float) + 255) / 256 * 256;
    plan->workspace_bytes = plan->partial_out_bytes + rows * sizeof(float);
  }
  return LOOKAHEAD_OK;
}

template <typename T, int D>
int launch(const LookaheadTreeAttnParams& p, const Plan& plan, void* workspace,
           cudaStream_t stream) {
  SplitArgs s;
  s.q_tiles = plan.q_tiles;
  s.num_splits = plan.num_splits;
  s.chunk = plan.chunk;
  s.partial_out = static_cast<float*>(workspace);
  s.partial_lse = plan.num_splits > 1
                      ? reinterpret_cast<float*>(static_cast<char*>(workspace) + plan.partial_out_bytes)
                      : nullptr;
  const dim3 grid(plan.q_tiles * plan.num_splits, p.num_kv_heads, p.num_reqs);
  auto start = [&](auto* kernel, size_t smem, int threads) {
    if (smem > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem)) != cudaSuccess)
      return false;
    LOOKAHEAD_LAUNCH(kernel, grid, threads, smem, stream, p, s);
    return true;
  };
  const bool started = [&] {
    if constexpr (!std::is_same_v<T, float>) {  // no fp32 tensor-core kernel (make_plan never asks for one)
      if (plan.shape.mma) return start(tree_attention_mma_kernel<T, D>, MmaSmem<T, D>::kBytes, kMmaThreads);
    }
    return start(tree_attention_kernel<T, D>, SmemLayout<D>::kBytes, kThreads);
  }();
  if (!started) return LOOKAHEAD_ERR_CUDA;
  if (plan.num_splits > 1) {
    const dim3 merge_grid(p.num_tokens, p.num_heads);
    auto* merge = tree_attention_merge_kernel<T, D>;
    LOOKAHEAD_LAUNCH(merge, merge_grid, D, 0, stream, p, s);
  }
  return cudaGetLastError() == cudaSuccess ? LOOKAHEAD_OK : LOOKAHEAD_ERR_CUDA;
}

template <typename T>
int dispatch_head_dim(const LookaheadTreeAttnParams& p, const Plan& plan, void* ws,
                      cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch<T, 64>(p, plan, ws, stream);
    case 128: return launch<T, 128>(p, plan, ws, stream);
    default: return LOOKAHEAD_ERR_HEAD_DIM;
  }
}

}  // namespace
}  // namespace lookahead

extern "C" int lookahead_tree_attention_workspace(const LookaheadTreeAttnParams* p, size_t* bytes) {
  if (bytes == nullptr) return LOOKAHEAD_ERR_NULL;
  *bytes = 0;
  const int rc = lookahead::check_params(p);
  if (rc != LOOKAHEAD_OK || p->num_tokens == 0 || p->num_reqs == 0 || p->max_query_len == 0) return rc;
  lookahead::Plan plan;
  const int prc = lookahead::make_plan(p, &plan);
  if (prc == LOOKAHEAD_OK) *bytes = plan.workspace_bytes;
  return prc;
}

extern "C" int lookahead_tree_attention(const LookaheadTreeAttnParams* p, void* workspace,
                                        size_t workspace_bytes, cudaStream_t stream) {
  const int rc = lookahead::check_params(p);
  if (rc != LOOKAHEAD_OK || p->num_tokens == 0 || p->num_reqs == 0 || p->max_query_len == 0) return rc;
  lookahead::Plan plan;
  const int prc = lookahead::make_plan(p, &plan);
  if (prc != LOOKAHEAD_OK) return prc;
  if (plan.workspace_bytes > 0 && (workspace == nullptr || workspace_bytes < plan.workspace_bytes))
    return LOOKAHEAD_ERR_WORKSPACE;
  switch (p->dtype) {
    case LOOKAHEAD_FP32: return lookahead::dispatch_head_dim<float>(*p, plan, workspace, stream);
    case LOOKAHEAD_FP16: return lookahead::dispatch_head_dim<__half>(*p, plan, workspace, stream);
    case LOOKAHEAD_BF16: return lookahead::dispatch_head_dim<__nv_bfloat16>(*p, plan, workspace, stream);
    default: return LOOKAHEAD_ERR_DTYPE;
  }
}
