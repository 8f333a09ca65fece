// Exporting a worker's GPU buffer to its node's daemon: the CUDA IPC handle of the allocation
// that holds it, and the buffer's offset from the allocation's base (PyTorch's caching allocator
// hands out pieces of larger allocations).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "proto/refit.pb.h"

namespace refit {

// Fails, saying what to do, for memory CUDA IPC cannot export: allocations made with cuMemCreate
// (PyTorch's expandable segments) and host memory.
absl::StatusOr<v1::BufferMemory> ExportCudaBuffer(const void* device_pointer, int64_t bytes);

}  // namespace refit
