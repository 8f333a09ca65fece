// A worker's CUDA IPC allocation opened in this process, in one GPU's context
// (cudaIpcOpenMemHandle with lazy peer access), closed with its owner (cudaIpcCloseMemHandle,
// in that context). A pointer from one device's import is not valid in another device's
// kernels, so the backend keeps one import per GPU that touches the allocation. The driver
// counts opens of one handle in one context (each returns the same pointer and needs its own
// close), so two imports of the same handle made concurrently are both valid. Move-only.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace refit {

class IpcImport {
 public:
  IpcImport() = default;
  // `handle`: a cudaIpcMemHandle_t's bytes (the caller checked the size). `what` prefixes errors.
  static absl::StatusOr<IpcImport> Open(int32_t gpu, const std::string& handle,
                                        const std::string& what);
  ~IpcImport();
  IpcImport(IpcImport&& other) noexcept;
  IpcImport& operator=(IpcImport&& other) noexcept;
  IpcImport(const IpcImport&) = delete;
  IpcImport& operator=(const IpcImport&) = delete;

  void* get() const { return ptr_; }
  int32_t gpu() const { return gpu_; }

 private:
  void Reset();
  void* ptr_ = nullptr;
  int32_t gpu_ = -1;
};

}  // namespace refit
