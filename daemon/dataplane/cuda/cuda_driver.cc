#include "daemon/dataplane/cuda/cuda_driver.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

// One symbol at the ABI version its PFN_..._vNNNNN type describes: asking for a newer version
// could hand back a function with another signature.
template <typename Fn>
absl::Status Find(const char* symbol, unsigned int version, Fn* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(symbol, &fn, version, cudaEnableDefault, &found);
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA driver does not provide ", symbol, " (",
                     e != cudaSuccess ? cudaGetErrorString(e) : "symbol not found",
                     "): CUDA VMM memory cannot be mapped by this daemon; is the NVIDIA driver "
                     "installed and as new as CUDA ",
                     CUDART_VERSION / 1000, ".", CUDART_VERSION % 1000 / 10, "?"));
  }
  *out = reinterpret_cast<Fn>(fn);
  return absl::OkStatus();
}

absl::StatusOr<CudaDriver> Load() {
  CudaDriver d;
  for (absl::Status s :
       {Find("cuInit", 2000, &d.Init), Find("cuGetErrorName", 6000, &d.GetErrorName),
        Find("cuGetErrorString", 6000, &d.GetErrorString),
        Find("cuMemImportFromShareableHandle", 10020, &d.MemImportFromShareableHandle),
        Find("cuMemGetAllocationPropertiesFromHandle", 10020,
             &d.MemGetAllocationPropertiesFromHandle),
        Find("cuMemGetAllocationGranularity", 10020, &d.MemGetAllocationGranularity),
        Find("cuMemAddressReserve", 10020, &d.MemAddressReserve),
        Find("cuMemAddressFree", 10020, &d.MemAddressFree), Find("cuMemMap", 10020, &d.MemMap),
        Find("cuMemUnmap", 10020, &d.MemUnmap), Find("cuMemSetAccess", 10020, &d.MemSetAccess),
        Find("cuMemRelease", 10020, &d.MemRelease), Find("cuCtxGetCurrent", 4000, &d.CtxGetCurrent),
        Find("cuStreamWaitValue32", 11070, &d.StreamWaitValue32)}) {
    if (!s.ok()) return s;
  }
  if (auto s = d.Check(d.Init(0), "cuInit", absl::StatusCode::kFailedPrecondition); !s.ok())
    return s;
  return d;
}

}  // namespace

absl::StatusOr<const CudaDriver*> CudaDriver::Get() {
  static const absl::StatusOr<CudaDriver>* const loaded = new absl::StatusOr<CudaDriver>(Load());
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

absl::Status CudaDriver::Check(CUresult result, const std::string& what,
                               absl::StatusCode code) const {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  const char* description = nullptr;
  if (GetErrorName == nullptr || GetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
  if (GetErrorString == nullptr || GetErrorString(result, &description) != CUDA_SUCCESS)
    description = nullptr;
  return absl::Status(
      code, absl::StrCat(what, ": ", name != nullptr ? name : absl::StrCat("CUresult ", result),
                         description != nullptr ? absl::StrCat(" (", description, ")") : ""));
}

}  // namespace refit
