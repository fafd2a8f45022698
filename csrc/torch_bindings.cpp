// Torch bindings: registers torch.ops.lookahead_vllm.{tree_attention,compact_kv}
// for CUDA tensors. This file only checks tensors (device, dtype, shape,
// strides), fills the C parameter structs and calls the launchers on the
// current CUDA stream; the kernels live in tree_attention.cu/kv_compaction.cu.
// Only GPU builds compile and link it (it needs torch's c10/cuda headers).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <unordered_set>
#include <vector>

#include "lookahead_api.h"

namespace {

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return LOOKAHEAD_FP32;
    case at::kHalf: return LOOKAHEAD_FP16;
    case at::kBFloat16: return LOOKAHEAD_BF16;
    default: return -1;
  }
}

void check_on(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.device() == device, "lookahead_vllm: ", name, " is on ", t.device(), ", expected ", device);
}

void check_int_vector(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim,
                      const at::Device& device) {
  check_on(t, name, device);
  TORCH_CHECK(t.scalar_type() == dtype, "lookahead_vllm: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "lookahead_vllm: ", name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), "lookahead_vllm: ", name, " must be contiguous");
}

int checked_int(int64_t v, const char* name) {
  TORCH_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), "lookahead_vllm: ", name, "=", v,
              " is out of range [0, 2^31)");
  return static_cast<int>(v);
}

void tree_attention(const at::Tensor& query,        // [num_tokens, num_heads, head_dim]
                    const at::Tensor& key_cache,    // [num_blocks, block_size, num_kv_heads, head_dim]
                    const at::Tensor& value_cache,  // same as key_cache
                    const at::Tensor& block_tables,     // [num_reqs, max_blocks_per_seq] int32
                    const at::Tensor& seq_lens,         // [num_reqs] int32
                    const at::Tensor& query_start_loc,  // [num_reqs + 1] int32
                    const at::Tensor& tree_mask,        // [num_tokens, num_words] int64
                    double scale, int64_t max_query_len, int64_t max_seq_len,
                    const at::Tensor& out) {  // [num_tokens, num_heads, head_dim]
  TORCH_CHECK(query.is_cuda(), "lookahead_vllm.tree_attention: query must be a CUDA tensor");
  const at::Device device = query.device();
  TORCH_CHECK(query.dim() == 3, "tree_attention: query must be [num_tokens, num_heads, head_dim], got ",
              query.sizes());
  const int dtype = dtype_code(query.scalar_type());
  TORCH_CHECK(dtype >= 0, "tree_attention: query dtype ", query.scalar_type(),
              " unsupported (float32, float16, bfloat16)");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "tree_attention: head_dim=", head_dim,
              " unsupported (64 or 128)");
  TORCH_CHECK(query.stride(2) == 1, "tree_attention: query's last dim must be contiguous");
  for (const auto* t : {&key_cache, &value_cache}) {
    const char* name = t == &key_cache ? "key_cache" : "value_cache";
    check_on(*t, name, device);
    TORCH_CHECK(t->scalar_type() == query.scalar_type(), "tree_attention: ", name, " dtype ",
                t->scalar_type(), " != query dtype ", query.scalar_type());
    TORCH_CHECK(t->dim() == 4 && t->size(3) == head_dim, "tree_attention: ", name,
                " must be [num_blocks, block_size, num_kv_heads, ", head_dim, "], got ", t->sizes());
    TORCH_CHECK(t->stride(3) == 1, "tree_attention: ", name, "'s last dim must be contiguous");
  }
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides(),
              "tree_attention: key_cache and value_cache differ in shape or strides: ", key_cache.sizes(),
              " vs ", value_cache.sizes());
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "tree_attention: num_kv_heads=",
              num_kv_heads, " must divide num_heads=", num_heads);
  check_int_vector(block_tables, "block_tables", at::kInt, 2, device);
  check_int_vector(seq_lens, "seq_lens", at::kInt, 1, device);
  check_int_vector(query_start_loc, "query_start_loc", at::kInt, 1, device);
  check_int_vector(tree_mask, "tree_mask", at::kLong, 2, device);
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == num_reqs, "tree_attention: block_tables has ", block_tables.size(0),
              " rows, seq_lens has ", num_reqs);
  TORCH_CHECK(query_start_loc.size(0) == num_reqs + 1, "tree_attention: query_start_loc has ",
              query_start_loc.size(0), " entries, expected num_reqs + 1 = ", num_reqs + 1);
  TORCH_CHECK(tree_mask.size(0) == query.size(0), "tree_attention: tree_mask has ", tree_mask.size(0),
              " rows, query has ", query.size(0), " tokens");
  TORCH_CHECK(tree_mask.size(1) * 64 >= max_query_len, "tree_attention: tree_mask has ", tree_mask.size(1),
              " words, too few for max_query_len=", max_query_len);
  TORCH_CHECK(max_seq_len >= max_query_len, "tree_attention: max_seq_len=", max_seq_len,
              " < max_query_len=", max_query_len);
  TORCH_CHECK(max_seq_len <= block_tables.size(1) * key_cache.size(1), "tree_attention: max_seq_len=",
              max_seq_len, " exceeds block_tables capacity ", block_tables.size(1), " x block_size ",
              key_cache.size(1));
  check_on(out, "out", device);
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.stride(2) == 1,
              "tree_attention: out must match query's shape and dtype with a contiguous last dim");

  LookaheadTreeAttnParams p{};
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.tree_mask = tree_mask.data_ptr<int64_t>();
  p.out = out.data_ptr();
  p.dtype = dtype;
  p.num_tokens = checked_int(query.size(0), "num_tokens");
  p.num_heads = checked_int(num_heads, "num_heads");
  p.num_kv_heads = checked_int(num_kv_heads, "num_kv_heads");
  p.head_dim = static_cast<int>(head_dim);
  p.num_reqs = checked_int(num_reqs, "num_reqs");
  p.max_blocks_per_seq = checked_int(block_tables.size(1), "max_blocks_per_seq");
  p.block_size = checked_int(key_cache.size(1), "block_size");
  p.mask_words = checked_int(tree_mask.size(1), "mask_words");
  p.max_query_len = checked_int(max_query_len, "max_query_len");
  p.max_seq_len = checked_int(max_seq_len, "max_seq_len");
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.o_stride_token = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.kv_stride_block = key_cache.stride(0);
  p.kv_stride_token = key_cache.stride(1);
  p.kv_stride_head = key_cache.stride(2);
  p.scale = static_cast<float>(scale);

  const c10::cuda::CUDAGuard guard(device);
  size_t ws_bytes = 0;
  int rc = lookahead_tree_attention_workspace(&p, &ws_bytes);
  TORCH_CHECK(rc == LOOKAHEAD_OK, "tree_attention: ", lookahead_error_string(rc));
  at::Tensor workspace;
  if (ws_bytes > 0)
    workspace = at::empty({static_cast<int64_t>(ws_bytes)}, query.options().dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  rc = lookahead_tree_attention(&p, ws_bytes > 0 ? workspace.data_ptr() : nullptr, ws_bytes, stream);
  TORCH_CHECK(rc == LOOKAHEAD_OK, "tree_attention: ", lookahead_error_string(rc),
              rc == LOOKAHEAD_ERR_CUDA ? cudaGetErrorString(cudaGetLastError()) : "");
}

void compact_kv(const std::vector<at::Tensor>& key_caches,    // per layer [num_blocks, block_size, H, D]
                const std::vector<at::Tensor>& value_caches,  // per layer, same shape
                const at::Tensor& src_slots,                  // [n] int64
                const at::Tensor& dst_slots) {                // [n] int64
  TORCH_CHECK(key_caches.size() == value_caches.size(), "compact_kv: ", key_caches.size(),
              " key caches but ", value_caches.size(), " value caches");
  TORCH_CHECK(src_slots.is_cuda(), "lookahead_vllm.compact_kv: src_slots must be a CUDA tensor");
  const at::Device device = src_slots.device();
  check_int_vector(src_slots, "src_slots", at::kLong, 1, device);
  check_int_vector(dst_slots, "dst_slots", at::kLong, 1, device);
  TORCH_CHECK(src_slots.size(0) == dst_slots.size(0), "compact_kv: src_slots has ", src_slots.size(0),
              " entries, dst_slots has ", dst_slots.size(0));
  TORCH_CHECK(src_slots.size(0) <= LOOKAHEAD_COMPACT_MAX_SLOTS, "compact_kv: ", src_slots.size(0),
              " slots exceed the limit of ", LOOKAHEAD_COMPACT_MAX_SLOTS);
  if (key_caches.empty() || src_slots.size(0) == 0) return;
  const at::Tensor& ref = key_caches[0];
  std::vector<void*> k_ptrs, v_ptrs;
  std::unordered_set<void*> seen;
  for (size_t l = 0; l < key_caches.size(); ++l) {
    for (const at::Tensor* t : {&key_caches[l], &value_caches[l]}) {
      const char* name = t == &key_caches[l] ? "key_caches" : "value_caches";
      check_on(*t, name, device);
      TORCH_CHECK(t->dim() == 4 && t->sizes() == ref.sizes() && t->strides() == ref.strides() &&
                      t->scalar_type() == ref.scalar_type(),
                  "compact_kv: ", name, "[", l, "] has shape ", t->sizes(), " / dtype ", t->scalar_type(),
                  ", expected every layer like key_caches[0]: ", ref.sizes(), " / ", ref.scalar_type());
      TORCH_CHECK(t->stride(3) == 1, "compact_kv: ", name, "[", l, "]: head_dim must be contiguous");
      TORCH_CHECK(seen.insert(t->data_ptr()).second, "compact_kv: ", name, "[", l,
                  "] shares storage with another cache; pass each layer's K and V once");
    }
    k_ptrs.push_back(key_caches[l].data_ptr());
    v_ptrs.push_back(value_caches[l].data_ptr());
  }
  const int64_t esize = ref.element_size();
  LookaheadCompactParams p{};
  p.key_caches = k_ptrs.data();
  p.value_caches = v_ptrs.data();
  p.num_layers = checked_int(static_cast<int64_t>(key_caches.size()), "num_layers");
  p.num_blocks = ref.size(0);
  p.block_size = checked_int(ref.size(1), "block_size");
  p.stride_block_bytes = ref.stride(0) * esize;
  p.stride_token_bytes = ref.stride(1) * esize;
  p.row_bytes = ref.size(2) * ref.size(3) * esize;
  p.head_bytes = ref.size(3) * esize;
  p.stride_head_bytes = ref.stride(2) * esize;  // > head_bytes in vLLM's HND layout
  p.src_slots = src_slots.data_ptr<int64_t>();
  p.dst_slots = dst_slots.data_ptr<int64_t>();
  p.num_slots = static_cast<int>(src_slots.size(0));
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const int rc = lookahead_compact_kv(&p, stream);
  TORCH_CHECK(rc == LOOKAHEAD_OK, "compact_kv: ", lookahead_error_string(rc),
              rc == LOOKAHEAD_ERR_CUDA ? cudaGetErrorString(cudaGetLastError()) : "");
}

}  // namespace

TORCH_LIBRARY(lookahead_vllm, m) {
  m.def(
      "tree_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor tree_mask, float scale, int max_query_len, "
      "int max_seq_len, Tensor(a!) out) -> ()");
  m.def("compact_kv(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor src_slots, Tensor dst_slots) -> ()");
}

TORCH_LIBRARY_IMPL(lookahead_vllm, CUDA, m) {
  m.impl("tree_attention", &tree_attention);
  m.impl("compact_kv", &compact_kv);
}
