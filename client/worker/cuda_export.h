// Exporting a worker's GPU buffers to its node's daemon, found from their own addresses:
// - legacy allocations (cudaMalloc: PyTorch's caching allocator by default): the CUDA IPC handle
//   of the allocation that holds a buffer, and the buffer's offset from the allocation's base
//   (the caching allocator hands out pieces of larger allocations);
// - CUDA VMM memory (cuMemCreate: PyTorch's expandable segments, vLLM's sleep mode, SGLang's
//   memory saver), which IPC handles cannot export: the physical allocations under the buffers,
//   each exported as a POSIX file descriptor (cuMemExportToShareableHandle), grouped into ranges
//   of allocations mapped back to back; the daemon maps each range into its own address space.
// GPUs are named by UUID ("GPU-..."): a worker under CUDA_VISIBLE_DEVICES has its own indices.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/refit.pb.h"

namespace refit {

// What registration needs of a worker's GPU buffers (WorkerClient's WorkerMemory takes them).
class CudaExport {
 public:
  CudaExport() = default;
  CudaExport(CudaExport&& other) noexcept;
  CudaExport& operator=(CudaExport&& other) noexcept;
  CudaExport(const CudaExport&) = delete;
  CudaExport& operator=(const CudaExport&) = delete;
  ~CudaExport();  // closes the descriptors

  std::vector<v1::BufferMemory> memory;  // one per buffer, in order: cuda_ipc or cuda_vmm
  std::vector<v1::VmmRange> vmm_ranges;  // what the cuda_vmm entries index
  std::vector<int> fds;                  // owned: VMM chunk i of range r is fds[first_fd + i]
  std::string gpu_uuid;                  // the first buffer's GPU
};

struct CudaBufferRef {
  const void* pointer = nullptr;  // device memory
  int64_t bytes = 0;
  std::string name;  // for errors; empty: "buffer <index>"
};

// Each physical VMM allocation is exported once, however many buffers it holds; adjacent ones
// form one range. Fails, saying what to do, for memory that cannot be shared: host memory, VMM
// memory created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.
absl::StatusOr<CudaExport> ExportCudaBuffers(std::span<const CudaBufferRef> buffers);
// One buffer.
absl::StatusOr<CudaExport> ExportCudaBuffer(const void* device_pointer, int64_t bytes,
                                            const std::string& name = "");

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of this process's CUDA device `device`.
absl::StatusOr<std::string> CudaDeviceUuid(int device);

}  // namespace refit
