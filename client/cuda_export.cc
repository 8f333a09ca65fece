#include "client/cuda_export.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace refit {

absl::StatusOr<v1::BufferMemory> ExportCudaBuffer(const void* device_pointer, int64_t bytes) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, device_pointer) != cudaSuccess ||
      attributes.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return absl::InvalidArgumentError(
        "buffer is not device memory: the cuda backend takes buffers allocated on a GPU");
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(device_pointer)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("cannot find the allocation that holds this buffer");
  }
  cudaIpcMemHandle_t handle;
  const cudaError_t e = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "cudaIpcGetMemHandle refused the allocation holding this buffer (", cudaGetErrorString(e),
        "). Memory from cuMemCreate cannot be shared through CUDA IPC handles: PyTorch's expandable "
        "segments allocate it. Start the worker with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, "
        "or allocate the weights outside the caching allocator"));
  }
  const int64_t offset = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(device_pointer) - base);
  if (offset + bytes > static_cast<int64_t>(size)) {
    return absl::InvalidArgumentError(absl::StrCat("buffer of ", bytes, " bytes at offset ", offset,
                                                   " runs past its allocation of ", size, " bytes"));
  }
  v1::BufferMemory m;
  v1::CudaIpc* ipc = m.mutable_cuda_ipc();
  ipc->set_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof handle));
  ipc->set_offset(offset);
  ipc->set_size(static_cast<int64_t>(size));
  ipc->set_device(attributes.device);
  return m;
}

}  // namespace refit
