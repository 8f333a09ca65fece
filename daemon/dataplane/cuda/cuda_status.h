// CUDA runtime and NCCL results as absl::Status, one place for both: every owner in daemon/cuda/
// and the backend report errors the same way ("<what>: <the library's message>"). A failed CUDA
// call's error, unless sticky, is cleared (cudaGetLastError) so that the next call does not
// report it again.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace refit {

inline absl::Status CudaError(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

// ncclInProgress is success for nonblocking communicators: the caller polls (NodeCommunicator).
inline absl::Status NcclError(ncclResult_t r, const std::string& what) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

}  // namespace refit

#define REFIT_CUDA_RETURN_IF_ERROR(call, what)                                        \
  do {                                                                                \
    if (auto refit_cuda_s_ = ::refit::CudaError((call), (what)); !refit_cuda_s_.ok()) \
      return refit_cuda_s_;                                                           \
  } while (0)
