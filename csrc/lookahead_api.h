// lookahead-vllm kernels: the plain C API shared by the CUDA launchers and the
// torch bindings. No torch, no device code: any C++ compiler with the CUDA
// runtime headers can include it.
//
// Layering (as in FlashInfer / flash-attention):
//   tree_attention.cuh  device kernels (templates)
//   tree_attention.cu   launcher: checks sizes/strides/alignment, picks the
//                       split, instantiates the templates (extern "C")
//   kv_compaction.cu    kernel + launcher (extern "C")
//   torch_bindings.cpp  TORCH_LIBRARY ops: check tensors, call the launchers on
//                       the current CUDA stream (compiled by GPU builds only)
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Storage dtype of query / output / KV cache.
enum LookaheadDtype {
  LOOKAHEAD_FP32 = 0,
  LOOKAHEAD_FP16 = 1,
  LOOKAHEAD_BF16 = 2,
};

// Launcher return codes (0 = launched). lookahead_error_string() names each.
enum LookaheadStatus {
  LOOKAHEAD_OK = 0,
  LOOKAHEAD_ERR_DTYPE = 1,          // dtype not one of LookaheadDtype
  LOOKAHEAD_ERR_HEAD_DIM = 2,       // head_dim not in {64, 128}
  LOOKAHEAD_ERR_HEADS = 3,          // num_heads <= 0, num_kv_heads <= 0 or not a divisor
  LOOKAHEAD_ERR_SIZE = 4,           // a count/size is negative or out of the grid's range
  LOOKAHEAD_ERR_ALIGNMENT = 5,      // a pointer or stride is not 16-byte aligned
  LOOKAHEAD_ERR_NULL = 6,           // a required pointer is NULL
  LOOKAHEAD_ERR_WORKSPACE = 7,      // workspace smaller than lookahead_tree_attention_workspace
  LOOKAHEAD_ERR_CUDA = 8,           // a CUDA runtime call failed (see cudaGetLastError)
};

static inline const char* lookahead_error_string(int code) {
  switch (code) {
    case LOOKAHEAD_OK: return "ok";
    case LOOKAHEAD_ERR_DTYPE: return "unsupported dtype (expected fp32, fp16 or bf16)";
    case LOOKAHEAD_ERR_HEAD_DIM: return "unsupported head_dim (expected 64 or 128)";
    case LOOKAHEAD_ERR_HEADS:
      return "bad head counts (num_heads and num_kv_heads must be > 0, num_kv_heads must divide num_heads)";
    case LOOKAHEAD_ERR_SIZE: return "a size is negative or exceeds the launch grid's range";
    case LOOKAHEAD_ERR_ALIGNMENT:
      return "KV cache / query / output pointer or stride not 16-byte aligned (last dim must be contiguous)";
    case LOOKAHEAD_ERR_NULL: return "a required pointer is NULL";
    case LOOKAHEAD_ERR_WORKSPACE: return "workspace too small (see lookahead_tree_attention_workspace)";
    case LOOKAHEAD_ERR_CUDA: return "CUDA runtime error";
    default: return "unknown error";
  }
}

// Paged tree attention (semantics: lookahead_vllm/ops/tree_attention.py,
// paged_tree_attention_ref). Strides are in ELEMENTS; the head_dim stride of
// every tensor is 1. Integer tensors are contiguous.
typedef struct LookaheadTreeAttnParams {
  const void* query;             // [num_tokens, num_heads, head_dim]
  const void* key_cache;         // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;       // same shape and strides as key_cache
  const int32_t* block_tables;   // [num_reqs, max_blocks_per_seq]
  const int32_t* seq_lens;       // [num_reqs]: context + tail
  const int32_t* query_start_loc;  // [num_reqs + 1]
  const int64_t* tree_mask;      // [num_tokens, mask_words] bit words over the tail
  void* out;                     // [num_tokens, num_heads, head_dim]
  int dtype;                     // LookaheadDtype of query, caches and out
  int num_tokens, num_heads, num_kv_heads, head_dim;
  int num_reqs, max_blocks_per_seq, block_size, mask_words;
  int max_query_len;             // >= every request's tail length
  int max_seq_len;               // >= every request's seq_len
  int64_t q_stride_token, q_stride_head;
  int64_t o_stride_token, o_stride_head;
  int64_t kv_stride_block, kv_stride_token, kv_stride_head;
  float scale;                   // softmax scale (usually head_dim ** -0.5)
} LookaheadTreeAttnParams;

// Bytes of scratch the launch needs (0 when the KV range is not split). The
// split depends on the current device's SM count, so call this on the device
// that launches.
int lookahead_tree_attention_workspace(const LookaheadTreeAttnParams* p, size_t* bytes);

// Launch on `stream`. Rows of `out` outside [0, query_start_loc[num_reqs]) are
// not written. Preconditions not checked on the device: q_len <= seq_len for
// every request, block tables cover seq_len, mask rows are ancestor sets.
int lookahead_tree_attention(const LookaheadTreeAttnParams* p, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream);

// KV compaction: for every layer and for K and V, slot dst_slots[i] receives
// what slot src_slots[i] held before the call (all reads happen before any
// write of the same bytes, so dst <= src along an accepted path is safe).
// Slot s is token s % block_size of block s / block_size; a slot's row is
// num_kv_heads heads of head_bytes contiguous bytes each, head h at
// h * stride_head_bytes (vLLM's HND layout on Hopper puts heads before slots:
// stride_head_bytes > head_bytes; contiguous rows have them equal, or pass
// head_bytes = 0). Slots outside [0, num_blocks * block_size) are skipped.
// Strides are in BYTES.
typedef struct LookaheadCompactParams {
  void* const* key_caches;       // host array [num_layers] of device pointers
  void* const* value_caches;     // host array [num_layers] of device pointers
  int num_layers;
  int64_t num_blocks;
  int block_size;
  int64_t stride_block_bytes, stride_token_bytes;
  int64_t row_bytes;             // num_kv_heads * head_dim * element size
  const int64_t* src_slots;      // device [num_slots]
  const int64_t* dst_slots;      // device [num_slots]
  int num_slots;                 // <= LOOKAHEAD_COMPACT_MAX_SLOTS
  int64_t stride_head_bytes;     // between a slot's heads (0 with head_bytes = 0)
  int64_t head_bytes;            // head_dim * element size; 0: the row is contiguous
} LookaheadCompactParams;

#define LOOKAHEAD_COMPACT_MAX_SLOTS 2048

int lookahead_compact_kv(const LookaheadCompactParams* p, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif
