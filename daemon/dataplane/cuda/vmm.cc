#include "daemon/dataplane/cuda/vmm.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/dataplane/cuda/device_guard.h"

namespace refit {

absl::StatusOr<VmmHandle> VmmHandle::Import(const CudaDriver& driver, int32_t gpu, int fd,
                                            const std::string& what) {
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  VmmHandle h;
  if (auto s = driver.Check(driver.MemImportFromShareableHandle(
                                &h.handle_, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                            what, absl::StatusCode::kInvalidArgument);
      !s.ok()) {
    return s;
  }
  h.driver_ = &driver;
  h.gpu_ = gpu;
  h.held_ = true;
  return h;
}

void VmmHandle::Reset() {
  if (!held_) return;
  DeviceGuard guard(gpu_);
  driver_->MemRelease(handle_);
  held_ = false;
}

VmmHandle::~VmmHandle() { Reset(); }

VmmHandle::VmmHandle(VmmHandle&& other) noexcept
    : driver_(other.driver_),
      gpu_(other.gpu_),
      handle_(other.handle_),
      held_(std::exchange(other.held_, false)) {}

VmmHandle& VmmHandle::operator=(VmmHandle&& other) noexcept {
  if (this != &other) {
    Reset();
    driver_ = other.driver_;
    gpu_ = other.gpu_;
    handle_ = other.handle_;
    held_ = std::exchange(other.held_, false);
  }
  return *this;
}

absl::StatusOr<VmmReservation> VmmReservation::Reserve(const CudaDriver& driver, int32_t gpu,
                                                       size_t bytes, size_t alignment,
                                                       const std::string& what) {
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  VmmReservation r;
  if (auto s = driver.Check(driver.MemAddressReserve(&r.base_, bytes, alignment, 0, 0), what);
      !s.ok())
    return s;
  r.driver_ = &driver;
  r.gpu_ = gpu;
  r.bytes_ = bytes;
  return r;
}

void VmmReservation::Reset() {
  if (bytes_ == 0) return;
  DeviceGuard guard(gpu_);
  driver_->MemAddressFree(base_, bytes_);
  bytes_ = 0;
}

VmmReservation::~VmmReservation() { Reset(); }

VmmReservation::VmmReservation(VmmReservation&& other) noexcept
    : driver_(other.driver_),
      gpu_(other.gpu_),
      base_(other.base_),
      bytes_(std::exchange(other.bytes_, 0)) {}

VmmReservation& VmmReservation::operator=(VmmReservation&& other) noexcept {
  if (this != &other) {
    Reset();
    driver_ = other.driver_;
    gpu_ = other.gpu_;
    base_ = other.base_;
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

absl::StatusOr<VmmMap> VmmMap::Map(const CudaDriver& driver, int32_t gpu, CUdeviceptr at,
                                   size_t bytes, const VmmHandle& handle, const std::string& what) {
  DeviceGuard guard(gpu);
  if (!guard.status().ok()) return guard.status();
  if (auto s = driver.Check(driver.MemMap(at, bytes, 0, handle.get(), 0), what); !s.ok()) return s;
  VmmMap m;
  m.driver_ = &driver;
  m.gpu_ = gpu;
  m.at_ = at;
  m.bytes_ = bytes;
  return m;
}

void VmmMap::Reset() {
  if (bytes_ == 0) return;
  DeviceGuard guard(gpu_);
  driver_->MemUnmap(at_, bytes_);
  bytes_ = 0;
}

VmmMap::~VmmMap() { Reset(); }

VmmMap::VmmMap(VmmMap&& other) noexcept
    : driver_(other.driver_),
      gpu_(other.gpu_),
      at_(other.at_),
      bytes_(std::exchange(other.bytes_, 0)) {}

VmmMap& VmmMap::operator=(VmmMap&& other) noexcept {
  if (this != &other) {
    Reset();
    driver_ = other.driver_;
    gpu_ = other.gpu_;
    at_ = other.at_;
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

}  // namespace refit
