// Helpers for the GPU tests and benchmarks: whether a GPU is present, checked CUDA calls, and an
// owned device allocation.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define REFIT_CUDA_CHECK(call)                                           \
  do {                                                                   \
    const cudaError_t refit_err_ = (call);                               \
    if (refit_err_ != cudaSuccess) {                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(refit_err_));                      \
      std::abort();                                                      \
    }                                                                    \
  } while (0)

namespace refit {

inline int GpuCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    REFIT_CUDA_CHECK(cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes));
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  uint64_t address() const { return reinterpret_cast<uint64_t>(ptr_); }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace refit
