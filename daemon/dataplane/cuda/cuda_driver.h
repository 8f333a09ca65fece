// The few CUDA driver API calls refitd makes itself (CUDA VMM: importing workers' allocations
// from file descriptors and mapping them), found through the runtime's
// cudaGetDriverEntryPointByVersion instead of linking libcuda: a refitd linked against
// libcuda.so.1 would not even start on a machine without the NVIDIA driver, --backend host
// included (this build machine is one), while the runtime loads the driver only when asked.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string>

#include "absl/status/statusor.h"

namespace refit {

struct CudaDriver {
  PFN_cuInit_v2000 Init = nullptr;
  PFN_cuGetErrorName_v6000 GetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 GetErrorString = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 MemImportFromShareableHandle = nullptr;
  PFN_cuMemGetAllocationPropertiesFromHandle_v10020 MemGetAllocationPropertiesFromHandle = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 MemGetAllocationGranularity = nullptr;
  PFN_cuMemAddressReserve_v10020 MemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 MemAddressFree = nullptr;
  PFN_cuMemMap_v10020 MemMap = nullptr;
  PFN_cuMemUnmap_v10020 MemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 MemSetAccess = nullptr;
  PFN_cuMemRelease_v10020 MemRelease = nullptr;
  PFN_cuCtxGetCurrent_v4000 CtxGetCurrent = nullptr;  // DeviceGuard: is any context current?
  // Work launched ahead of its round waits for the host's word
  // (daemon/dataplane/cuda/cuda_backend.cc, armed).
  PFN_cuStreamWaitValue32_v11070 StreamWaitValue32 = nullptr;

  // The driver's functions, found and cuInit'ed once per process; the error (kept) says why
  // not, e.g. no driver or one too old for the runtime.
  static absl::StatusOr<const CudaDriver*> Get();

  // OK for CUDA_SUCCESS; else `code` with "<what>: <CUDA_ERROR_NAME> (<description>)".
  absl::Status Check(CUresult result, const std::string& what,
                     absl::StatusCode code = absl::StatusCode::kInternal) const;
};

}  // namespace refit
