// Link-time stand-ins for the libc10_cuda symbols torch_bindings.cpp references,
// so the bindings can be linked against the CPU torch wheel and loaded to check
// op registration (tests/ops/test_csrc_build.py). None of them is ever called on
// CPU tensors; each throws if it is.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <stdexcept>

namespace {
[[noreturn]] void stub(const char* name) {
  throw std::logic_error(std::string("c10::cuda stub called on a CPU-only build: ") + name);
}
}  // namespace

namespace c10::cuda {
namespace CUDACachingAllocator {
std::atomic<CUDAAllocator*> allocator{nullptr};
}
bool CUDAStream::query() const { stub("CUDAStream::query"); }
cudaStream_t CUDAStream::stream() const { stub("CUDAStream::stream"); }
void CUDAStream::synchronize() const { stub("CUDAStream::synchronize"); }
DeviceIndex ExchangeDevice(DeviceIndex) { stub("ExchangeDevice"); }
cudaError_t GetDevice(DeviceIndex*) { stub("GetDevice"); }
cudaError_t MaybeSetDevice(DeviceIndex) { stub("MaybeSetDevice"); }
cudaError_t SetDevice(DeviceIndex, bool) { stub("SetDevice"); }
void c10_cuda_check_implementation(const int32_t, const char*, const char*, uint32_t, const bool) {
  stub("c10_cuda_check_implementation");
}
DeviceIndex device_count() noexcept { return 0; }
CUDAStream getCurrentCUDAStream(DeviceIndex) { stub("getCurrentCUDAStream"); }
CUDAStream getDefaultCUDAStream(DeviceIndex) { stub("getDefaultCUDAStream"); }
CUDAStream getStreamFromPool(const bool, DeviceIndex) { stub("getStreamFromPool"); }
CUDAStream getStreamFromPool(const int, DeviceIndex) { stub("getStreamFromPool"); }
void setCurrentCUDAStream(CUDAStream) { stub("setCurrentCUDAStream"); }
}  // namespace c10::cuda
