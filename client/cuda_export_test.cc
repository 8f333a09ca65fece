// Exporting GPU buffers: an interior pointer of a cudaMalloc allocation exports with its offset;
// memory from cuMemCreate (what PyTorch's expandable segments use) is refused, saying what to
// do. Skips, passing, where no GPU is present.
#include "client/cuda_export.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <catch2/catch.hpp>

namespace refit {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

TEST_CASE("a buffer inside a cudaMalloc allocation exports with its offset") {
  if (!HaveGpu()) {
    WARN("no GPU here: skipped");
    return;
  }
  char* base = nullptr;
  REQUIRE(cudaMalloc(&base, 1 << 20) == cudaSuccess);
  auto m = ExportCudaBuffer(base + 4096, 8192);
  INFO(m.status().message());
  REQUIRE(m.ok());
  CHECK(m->cuda_ipc().offset() == 4096);
  CHECK(m->cuda_ipc().size() >= (1 << 20));
  CHECK(m->cuda_ipc().handle().size() == sizeof(cudaIpcMemHandle_t));
  auto past = ExportCudaBuffer(base + 4096, 2 << 20);
  CHECK_FALSE(past.ok());
  cudaFree(base);
  int host = 0;
  CHECK(std::string(ExportCudaBuffer(&host, 4).status().message()).find("not device memory") != std::string::npos);
}

TEST_CASE("cuMemCreate memory (expandable segments) is refused with advice") {
  if (!HaveGpu()) {
    WARN("no GPU here: skipped");
    return;
  }
  REQUIRE(cudaFree(nullptr) == cudaSuccess);  // a context
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  size_t granularity = 0;
  REQUIRE(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS);
  CUmemGenericAllocationHandle handle;
  REQUIRE(cuMemCreate(&handle, granularity, &prop, 0) == CUDA_SUCCESS);
  CUdeviceptr ptr = 0;
  REQUIRE(cuMemAddressReserve(&ptr, granularity, 0, 0, 0) == CUDA_SUCCESS);
  REQUIRE(cuMemMap(ptr, granularity, 0, handle, 0) == CUDA_SUCCESS);
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  REQUIRE(cuMemSetAccess(ptr, granularity, &access, 1) == CUDA_SUCCESS);
  auto m = ExportCudaBuffer(reinterpret_cast<void*>(ptr), 256);
  REQUIRE_FALSE(m.ok());
  INFO(m.status().message());
  CHECK(std::string(m.status().message()).find("expandable_segments:False") != std::string::npos);
  cuMemUnmap(ptr, granularity);
  cuMemAddressFree(ptr, granularity);
  cuMemRelease(handle);
}

}  // namespace
}  // namespace refit
