// Exporting GPU buffers: an interior pointer of a cudaMalloc allocation exports as an IPC handle
// with its offset; CUDA VMM memory made shareable as POSIX file descriptors exports as ranges of
// physical allocations (each exported once, adjacent ones in one range); VMM memory that is not
// shareable is refused, saying what to do. Fails where no GPU is present (tagged "gpu": CI leaves
// it out).
#include "client/worker/cuda_export.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <fcntl.h>

#include <catch2/catch.hpp>

#include "tests/gpu/needs_gpu.h"

namespace refit {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

TEST_CASE("a buffer inside a cudaMalloc allocation exports with its offset and its GPU's UUID") {
  if (!HaveGpu()) FAIL(kNeedsGpu);
  char* base = nullptr;
  REQUIRE(cudaMalloc(&base, 1 << 20) == cudaSuccess);
  auto m = ExportCudaBuffer(base + 4096, 8192, "w");
  INFO(m.status().message());
  REQUIRE(m.ok());
  REQUIRE(m->memory.size() == 1);
  CHECK(m->memory[0].cuda_ipc().offset() == 4096);
  CHECK(m->memory[0].cuda_ipc().size() >= (1 << 20));
  CHECK(m->memory[0].cuda_ipc().handle().size() == sizeof(cudaIpcMemHandle_t));
  CHECK(m->memory[0].cuda_ipc().gpu_uuid().rfind("GPU-", 0) == 0);
  CHECK(m->memory[0].cuda_ipc().gpu_uuid().size() == 40);
  CHECK(m->gpu_uuid == m->memory[0].cuda_ipc().gpu_uuid());
  CHECK(m->fds.empty());
  CHECK(m->vmm_ranges.empty());
  auto past = ExportCudaBuffer(base + 4096, 2 << 20);
  CHECK_FALSE(past.ok());
  cudaFree(base);
  int host = 0;
  CHECK(std::string(ExportCudaBuffer(&host, 4).status().message()).find("not device memory") !=
        std::string::npos);
}

// `chunks` physical allocations of the minimum granularity, mapped back to back.
struct Vmm {
  CUdeviceptr ptr = 0;
  size_t granularity = 0, total = 0;
  std::vector<CUmemGenericAllocationHandle> handles;
  Vmm(int chunks, CUmemAllocationHandleType types) {
    REQUIRE(cudaFree(nullptr) == cudaSuccess);  // a context
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = types;
    REQUIRE(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) ==
            CUDA_SUCCESS);
    total = granularity * chunks;
    REQUIRE(cuMemAddressReserve(&ptr, total, 0, 0, 0) == CUDA_SUCCESS);
    for (int c = 0; c < chunks; ++c) {
      CUmemGenericAllocationHandle h;
      REQUIRE(cuMemCreate(&h, granularity, &prop, 0) == CUDA_SUCCESS);
      REQUIRE(cuMemMap(ptr + c * granularity, granularity, 0, h, 0) == CUDA_SUCCESS);
      handles.push_back(h);
    }
    CUmemAccessDesc access = {};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    REQUIRE(cuMemSetAccess(ptr, total, &access, 1) == CUDA_SUCCESS);
  }
  ~Vmm() {
    for (size_t c = 0; c < handles.size(); ++c) {
      cuMemUnmap(ptr + c * granularity, granularity);
      cuMemRelease(handles[c]);
    }
    cuMemAddressFree(ptr, total);
  }
};

TEST_CASE("shareable VMM memory exports as one range of its allocations, each once") {
  if (!HaveGpu()) FAIL(kNeedsGpu);
  Vmm vmm(3, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  const size_t g = vmm.granularity;
  auto* p = reinterpret_cast<char*>(vmm.ptr);
  // a: across chunks 0 and 1; b: inside chunk 1; c: in chunk 2 to its end.
  const std::vector<CudaBufferRef> buffers = {{p + g / 2, static_cast<int64_t>(g)},
                                              {p + g + 256, 1024},
                                              {p + 2 * g + 512, static_cast<int64_t>(g - 512)}};
  auto m = ExportCudaBuffers(buffers);
  INFO(m.status().message());
  REQUIRE(m.ok());
  REQUIRE(m->vmm_ranges.size() == 1);
  const v1::VmmRange& r = m->vmm_ranges[0];
  REQUIRE(r.chunk_bytes_size() == 3);
  for (int c = 0; c < 3; ++c) CHECK(r.chunk_bytes(c) == static_cast<int64_t>(g));
  CHECK(r.first_fd() == 0);
  CHECK(r.gpu_uuid() == m->gpu_uuid);
  REQUIRE(m->fds.size() == 3);
  for (int fd : m->fds) CHECK(fcntl(fd, F_GETFD) >= 0);
  REQUIRE(m->memory.size() == 3);
  CHECK(m->memory[0].cuda_vmm().range() == 0);
  CHECK(m->memory[0].cuda_vmm().offset() == static_cast<int64_t>(g / 2));
  CHECK(m->memory[1].cuda_vmm().offset() == static_cast<int64_t>(g + 256));
  CHECK(m->memory[2].cuda_vmm().offset() == static_cast<int64_t>(2 * g + 512));
  // The descriptors import again (the daemon's side does the same in another process).
  for (int fd : m->fds) {
    CUmemGenericAllocationHandle h;
    CHECK(cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == CUDA_SUCCESS);
    cuMemRelease(h);
  }
  // Past the reserved range's mapped memory: refused.
  auto past = ExportCudaBuffer(p + 2 * g, static_cast<int64_t>(2 * g));
  CHECK_FALSE(past.ok());
}

TEST_CASE("VMM memory not shareable as a file descriptor is refused with advice") {
  if (!HaveGpu()) FAIL(kNeedsGpu);
  Vmm vmm(1, CU_MEM_HANDLE_TYPE_NONE);
  auto m = ExportCudaBuffer(reinterpret_cast<void*>(vmm.ptr), 256, "w");
  REQUIRE_FALSE(m.ok());
  INFO(m.status().message());
  const std::string message(m.status().message());
  CHECK(message.find("buffer \"w\"") != std::string::npos);
  CHECK(message.find("not created shareable as a POSIX file descriptor") != std::string::npos);
  CHECK(message.find("expandable_segments:False") != std::string::npos);
  CHECK(message.find("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in prop.requestedHandleTypes") !=
        std::string::npos);
}

}  // namespace
}  // namespace refit
