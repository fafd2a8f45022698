// CPU emulation of the few CUDA features csrc/ kernels use, so the real kernel
// and launcher sources run on machines without a GPU (tests/ops/test_kernels_emu.py).
//
// Force-included (g++ -include cuda_emu.h -x c++ csrc/*.cu): each CTA runs as
// blockDim.x fibers on one OS thread (ucontext stacks, _setjmp/_longjmp
// switches at barriers);
// __syncthreads is a barrier over the CTA; warp shuffles exchange values through
// per-warp slots and a warp barrier;
// WMMA fragments hold their whole 16x16 tile in every lane and each WMMA call
// is warp-collective (a warp barrier around every load/store), so a lane never
// sees another lane's half-finished tile;
// dynamic shared memory is a per-CTA buffer; CTAs run one after another; the
// CUDA runtime calls the launchers make are stubs ("device" pointers are host
// pointers). It checks the kernels' indexing, masking, softmax and split/merge
// logic, not the GPU memory model, timing or occupancy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <type_traits>
#include <vector>

namespace emu {

// A CUDA barrier with cooperative waiting: fibers yield until the generation moves.
struct Barrier {
  int expected = 0;
  int arrived = 0;
  unsigned generation = 0;
};

struct Fiber {
  ucontext_t ctx;  // only to enter the fiber's stack the first time
  jmp_buf jb;      // later switches: _setjmp/_longjmp (no signal-mask syscalls)
  std::vector<char> stack;
  bool started = false;
  bool done = false;
  const Barrier* waiting = nullptr;  // the barrier it sleeps on, and that barrier's generation
  unsigned waiting_gen = 0;
  unsigned parity = 0;  // alternates the shuffle slot buffer (one warp barrier per shuffle)
};

struct BlockCtx {
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<float> slots;  // [2][num_warps * 32] shuffle exchange, double-buffered
  std::vector<float4> smem;  // dynamic shared memory, 16-byte aligned
  std::vector<Fiber> fibers;
  ucontext_t scheduler_uc;
  jmp_buf scheduler;
  int current = 0;
  const std::function<void()>* body = nullptr;
};

inline uint3 t_thread_idx, t_block_idx;
inline dim3 t_block_dim, t_grid_dim;
inline BlockCtx* t_ctx = nullptr;
inline int num_sms = 132;
inline int compute_capability_major = 9;
inline int launches = 0;

inline void yield() {
  Fiber& self = t_ctx->fibers[t_ctx->current];
  if (!_setjmp(self.jb)) _longjmp(t_ctx->scheduler, 1);
}

inline void release_if_complete(Barrier& b) {
  if (b.expected > 0 && b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
  }
}

inline void arrive_and_wait(Barrier& b) {
  const unsigned gen = b.generation;
  ++b.arrived;
  release_if_complete(b);
  Fiber& self = t_ctx->fibers[t_ctx->current];
  while (b.generation == gen) {
    self.waiting = &b;
    self.waiting_gen = gen;
    yield();
  }
  self.waiting = nullptr;
}

inline void arrive_and_drop(Barrier& b) {
  --b.expected;
  release_if_complete(b);
}

inline void syncthreads() { arrive_and_wait(t_ctx->block); }
inline void syncwarp() { arrive_and_wait(t_ctx->warps[t_thread_idx.x / 32]); }

inline float shfl(float v, int src_lane) {
  const int warp = t_thread_idx.x / 32, lane = t_thread_idx.x % 32;
  Fiber& self = t_ctx->fibers[t_ctx->current];
  float* slots = t_ctx->slots.data() + (self.parity * t_ctx->warps.size() + warp) * 32;
  self.parity ^= 1u;
  slots[lane] = v;
  // After this barrier every lane has written; a lane can only overwrite this buffer
  // two shuffles later, i.e. after every lane passed the next barrier (and read).
  arrive_and_wait(t_ctx->warps[warp]);
  return slots[src_lane & 31];
}

inline void fiber_main() {
  BlockCtx* ctx = t_ctx;
  (*ctx->body)();
  const int t = ctx->current;
  ctx->fibers[t].done = true;  // an exited CUDA thread no longer holds up barriers
  arrive_and_drop(ctx->warps[t / 32]);
  arrive_and_drop(ctx->block);
  _longjmp(ctx->scheduler, 1);  // never returns: the scheduler resets the fiber for the next CTA
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, size_t smem_bytes, Args... args) {
  ++launches;
  const int n = static_cast<int>(block.x);  // the kernels use 1-D CTAs
  const std::function<void()> body = [&] { kernel(args...); };
  BlockCtx ctx;
  ctx.fibers.resize(n);
  for (auto& f : ctx.fibers) f.stack.resize(256 * 1024);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        ctx.block = Barrier{n, 0, 0};
        ctx.warps.assign((n + 31) / 32, Barrier{});
        for (int w = 0; w * 32 < n; ++w) ctx.warps[w].expected = std::min(32, n - 32 * w);
        ctx.slots.assign(2 * ctx.warps.size() * 32, 0.f);
        ctx.smem.assign((smem_bytes + sizeof(float4) - 1) / sizeof(float4) + 1, make_float4(NAN, NAN, NAN, NAN));
        ctx.body = &body;
        t_ctx = &ctx;
        t_block_idx = make_uint3(x, y, z);
        t_block_dim = block;
        t_grid_dim = grid;
        for (auto& f : ctx.fibers) {
          f.started = f.done = false;
          f.waiting = nullptr;
          f.parity = 0;
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, fiber_main, 0);
        }
        for (int live = n; live > 0;) {
          for (int t = 0; t < n; ++t) {
            Fiber& f = ctx.fibers[t];
            if (f.done || (f.waiting && f.waiting->generation == f.waiting_gen)) continue;  // still asleep
            ctx.current = t;
            t_thread_idx = make_uint3(t, 0, 0);
            if (!_setjmp(ctx.scheduler)) {
              if (f.started) _longjmp(f.jb, 1);
              f.started = true;
              swapcontext(&ctx.scheduler_uc, &f.ctx);
            }
            if (f.done) --live;
          }
        }
        t_ctx = nullptr;
      }
}

inline cudaError_t get_device(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t device_get_attribute(int* v, cudaDeviceAttr attr, int) {
  *v = attr == cudaDevAttrMultiProcessorCount ? num_sms
       : attr == cudaDevAttrComputeCapabilityMajor ? compute_capability_major
                                                  : 0;
  return cudaSuccess;
}
template <typename F>
cudaError_t func_set_attribute(F, cudaFuncAttribute, int) { return cudaSuccess; }
inline cudaError_t get_last_error() { return cudaSuccess; }

inline float to_f(float x) { return x; }
inline float to_f(__half x) { return __half2float(x); }
inline float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

}  // namespace emu

// WMMA (mma.h declares nothing without nvcc): the subset the kernels use.
namespace nvcuda::wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int kRows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int kCols = std::is_same_v<Use, matrix_a> ? K : N;
  T x[kRows * kCols];  // the whole tile, row-major, in every lane
};

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T value) {
  for (auto& e : f.x) e = value;
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* ptr, unsigned ldm) {
  using F = fragment<Use, M, N, K, T, Layout>;
  for (int r = 0; r < F::kRows; ++r)
    for (int c = 0; c < F::kCols; ++c)
      f.x[r * F::kCols + c] = std::is_same_v<Layout, row_major> ? ptr[r * ldm + c] : ptr[c * ldm + r];
  emu::syncwarp();
}

template <int M, int N, int K, typename T>
void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* ptr, unsigned ldm, layout_t layout) {
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) f.x[r * N + c] = layout == mem_row_major ? ptr[r * ldm + c] : ptr[c * ldm + r];
  emu::syncwarp();
}

template <int M, int N, int K, typename T>
void store_matrix_sync(T* ptr, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout) {
  emu::syncwarp();  // every lane has read what this overwrites
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) (layout == mem_row_major ? ptr[r * ldm + c] : ptr[c * ldm + r]) = f.x[r * N + c];
  emu::syncwarp();
}

template <int M, int N, int K, typename T, typename Ta, typename La, typename Lb>
void mma_sync(fragment<accumulator, M, N, K, T>& d, const fragment<matrix_a, M, N, K, Ta, La>& a,
              const fragment<matrix_b, M, N, K, Ta, Lb>& b, const fragment<accumulator, M, N, K, T>& c) {
  T out[M * N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float acc = c.x[i * N + j];
      for (int k = 0; k < K; ++k) acc += emu::to_f(a.x[i * K + k]) * emu::to_f(b.x[k * N + j]);
      out[i * N + j] = acc;
    }
  for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}
}  // namespace nvcuda::wmma

#define threadIdx emu::t_thread_idx
#define blockIdx emu::t_block_idx
#define blockDim emu::t_block_dim
#define gridDim emu::t_grid_dim
#define __syncthreads() emu::syncthreads()
#define __syncwarp(...) emu::syncwarp()
#define __launch_bounds__(...)
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float __shfl_sync(unsigned, float v, int src_lane) { return emu::shfl(v, src_lane); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  return emu::shfl(v, static_cast<int>(threadIdx.x % 32) ^ lane_mask);
}
using std::max;
using std::min;

#define LOOKAHEAD_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(emu::t_ctx->smem.data())
#define LOOKAHEAD_LAUNCH(kernel, grid, block, smem, stream, ...) emu::launch(kernel, dim3(grid), dim3(block), smem, __VA_ARGS__)
#define cudaGetDevice emu::get_device
#define cudaDeviceGetAttribute emu::device_get_attribute
#define cudaFuncSetAttribute emu::func_set_attribute
#define cudaGetLastError emu::get_last_error

// Weak: the header is included by every emulated translation unit.
extern "C" __attribute__((weak)) void emu_set_num_sms(int n) { emu::num_sms = n; }
extern "C" __attribute__((weak)) int emu_launches() { return emu::launches; }
extern "C" __attribute__((weak)) void emu_set_compute_capability(int major) { emu::compute_capability_major = major; }
