// CUDA VMM pieces of a worker's range imported into this process, each owned and released with
// its owner through the driver's entry points (daemon/dataplane/cuda/cuda_driver.h), in the context
// of the GPU the range lives on (driver calls act on the current context):
//   VmmHandle       a physical allocation imported from its descriptor; cuMemRelease. Once
//                   mapped, the mapping holds the memory, so handles may go right after cuMemMap.
//   VmmReservation  a reserved address range; cuMemAddressFree.
//   VmmMap          one chunk mapped into a reservation; cuMemUnmap (whole mappings only: one
//                   unmap per map). Declare maps after their reservation, so they go first.
// All move-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/dataplane/cuda/cuda_driver.h"

namespace refit {

class VmmHandle {
 public:
  VmmHandle() = default;
  // cuMemImportFromShareableHandle of a POSIX file descriptor; errors are INVALID_ARGUMENT (the
  // descriptor is the caller's), prefixed by `what`.
  static absl::StatusOr<VmmHandle> Import(const CudaDriver& driver, int32_t gpu, int fd,
                                          const std::string& what);
  ~VmmHandle();
  VmmHandle(VmmHandle&& other) noexcept;
  VmmHandle& operator=(VmmHandle&& other) noexcept;
  VmmHandle(const VmmHandle&) = delete;
  VmmHandle& operator=(const VmmHandle&) = delete;

  CUmemGenericAllocationHandle get() const { return handle_; }

 private:
  void Reset();
  const CudaDriver* driver_ = nullptr;
  int32_t gpu_ = -1;
  CUmemGenericAllocationHandle handle_ = 0;
  bool held_ = false;
};

class VmmReservation {
 public:
  VmmReservation() = default;
  static absl::StatusOr<VmmReservation> Reserve(const CudaDriver& driver, int32_t gpu, size_t bytes,
                                                size_t alignment, const std::string& what);
  ~VmmReservation();
  VmmReservation(VmmReservation&& other) noexcept;
  VmmReservation& operator=(VmmReservation&& other) noexcept;
  VmmReservation(const VmmReservation&) = delete;
  VmmReservation& operator=(const VmmReservation&) = delete;

  CUdeviceptr base() const { return base_; }
  size_t size() const { return bytes_; }

 private:
  void Reset();
  const CudaDriver* driver_ = nullptr;
  int32_t gpu_ = -1;
  CUdeviceptr base_ = 0;
  size_t bytes_ = 0;
};

class VmmMap {
 public:
  VmmMap() = default;
  static absl::StatusOr<VmmMap> Map(const CudaDriver& driver, int32_t gpu, CUdeviceptr at,
                                    size_t bytes, const VmmHandle& handle, const std::string& what);
  ~VmmMap();
  VmmMap(VmmMap&& other) noexcept;
  VmmMap& operator=(VmmMap&& other) noexcept;
  VmmMap(const VmmMap&) = delete;
  VmmMap& operator=(const VmmMap&) = delete;

 private:
  void Reset();
  const CudaDriver* driver_ = nullptr;
  int32_t gpu_ = -1;
  CUdeviceptr at_ = 0;
  size_t bytes_ = 0;
};

}  // namespace refit
