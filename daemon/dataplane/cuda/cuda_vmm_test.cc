// The cuda backend on a GPU: GPUs found by UUID and PCI bus id; CUDA VMM memory exported as file
// descriptors (client/worker/cuda_export.h), imported and mapped once per range, readable and
// writable at its new address and accessible from every GPU served, unmapped when its buffers go;
// and the errors of wrong chunks, GPUs and descriptors, naming the range and the CUDA call. Fails
// where no GPU is present (tagged "gpu": CI leaves it out).
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>

#include "client/worker/cuda_export.h"
#include "daemon/dataplane/cuda/cuda_backend.h"
#include "tests/gpu/needs_gpu.h"

namespace refit {
namespace {

int Gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

bool Has(const std::string& s, const std::string& part) {
  INFO(s);
  return s.find(part) != std::string::npos;
}

// `chunks` physical allocations on GPU `gpu`, mapped back to back, shareable as descriptors.
struct Vmm {
  CUdeviceptr ptr = 0;
  size_t granularity = 0, total = 0;
  std::vector<CUmemGenericAllocationHandle> handles;
  Vmm(int gpu, int chunks) {
    REQUIRE(cudaSetDevice(gpu) == cudaSuccess);
    REQUIRE(cudaFree(nullptr) == cudaSuccess);
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = gpu;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
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
  char* at(size_t offset) const { return reinterpret_cast<char*>(ptr) + offset; }
};

// A registration of worker "w" on GPU `gpu` with buffers b0, b1, ... as exported.
v1::RegisterWorkerRequest Request(const CudaExport& e, int gpu) {
  v1::RegisterWorkerRequest r;
  r.mutable_worker()->set_name("w");
  r.mutable_worker()->set_gpu(gpu);
  for (size_t b = 0; b < e.memory.size(); ++b) {
    r.mutable_worker()->add_buffers()->set_name("b" + std::to_string(b));
    *r.add_memory() = e.memory[b];
  }
  for (const auto& range : e.vmm_ranges) *r.add_vmm_ranges() = range;
  r.set_gpu_uuid(e.gpu_uuid);
  return r;
}

std::vector<Fd> Dup(const std::vector<int>& fds) {
  std::vector<Fd> out;
  for (int fd : fds) out.emplace_back(dup(fd));
  return out;
}

std::unique_ptr<CudaBackend> Backend() {
  auto b = CudaBackend::Start({}, 1 << 20);
  INFO(b.status().message());
  REQUIRE(b.ok());
  return *std::move(b);
}

TEST_CASE("GPUs are found by UUID and by PCI bus id") {
  if (Gpus() == 0) FAIL(kNeedsGpu);
  auto backend = Backend();
  for (int g = 0; g < Gpus(); ++g) {
    auto uuid = CudaDeviceUuid(g);
    REQUIRE(uuid.ok());
    CHECK(*backend->GpuIndex(*uuid) == g);
    char pci[64];
    REQUIRE(cudaDeviceGetPCIBusId(pci, sizeof pci, g) == cudaSuccess);
    CHECK(*backend->GpuIndex(pci) == g);
    std::string short_form = std::string(pci).substr(std::string(pci).find(':') + 1);  // "3B:00.0"
    for (char& ch : short_form)
      ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    CHECK(*backend->GpuIndex(short_form) == g);
  }
  auto unknown = backend->GpuIndex("GPU-00000000-0000-0000-0000-000000000000");
  REQUIRE_FALSE(unknown.ok());
  CHECK(Has(std::string(unknown.status().message()), *CudaDeviceUuid(0)));
}

TEST_CASE("a VMM range is mapped once at a new address, read and written through, on every GPU") {
  if (Gpus() == 0) FAIL(kNeedsGpu);
  auto backend = Backend();
  Vmm vmm(0, 3);
  const size_t g = vmm.granularity;
  std::vector<unsigned char> pattern(vmm.total);
  for (size_t i = 0; i < pattern.size(); ++i)
    pattern[i] = static_cast<unsigned char>(i * 7 + i / 4096);
  REQUIRE(cudaMemcpy(vmm.at(0), pattern.data(), pattern.size(), cudaMemcpyHostToDevice) ==
          cudaSuccess);
  // b0 across chunks 0 and 1, b1 inside chunk 2.
  const std::vector<CudaBufferRef> refs = {{vmm.at(g / 2), static_cast<int64_t>(g)},
                                           {vmm.at(2 * g + 64), 4096}};
  auto e = ExportCudaBuffers(refs);
  INFO(e.status().message());
  REQUIRE(e.ok());
  REQUIRE(e->vmm_ranges.size() == 1);
  const v1::RegisterWorkerRequest request = Request(*e, 0);
  const std::vector<int64_t> bytes = {static_cast<int64_t>(g), 4096};
  std::vector<Fd> fds = Dup(e->fds);
  auto mapped = backend->MapBuffers(request, bytes, fds);
  INFO(mapped.status().message());
  REQUIRE(mapped.ok());
  REQUIRE(mapped->size() == 2);
  fds.clear();  // the daemon closes them after registering: the mappings keep the memory
  const std::span<std::byte> b0 = (*mapped)[0]->bytes(), b1 = (*mapped)[1]->bytes();
  CHECK(b0.size() == g);
  CHECK(reinterpret_cast<char*>(b0.data()) != vmm.at(g / 2));  // its own mapping
  CHECK(reinterpret_cast<char*>(b1.data()) - reinterpret_cast<char*>(b0.data()) ==
        static_cast<ptrdiff_t>(3 * g / 2 + 64));
  std::vector<unsigned char> back(g);
  REQUIRE(cudaMemcpy(back.data(), b0.data(), g, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(std::memcmp(back.data(), pattern.data() + g / 2, g) == 0);
  // Written through the daemon's mapping, seen through the worker's.
  std::vector<unsigned char> fresh(4096, 0xA5);
  REQUIRE(cudaMemcpy(b1.data(), fresh.data(), fresh.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  std::vector<unsigned char> seen(4096);
  REQUIRE(cudaMemcpy(seen.data(), vmm.at(2 * g + 64), seen.size(), cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  CHECK(seen == fresh);
  // Readable and writable from every GPU at the same address.
  for (int gpu = 0; gpu < Gpus(); ++gpu) {
    CUmemLocation where = {};
    where.type = CU_MEM_LOCATION_TYPE_DEVICE;
    where.id = gpu;
    unsigned long long flags = 0;
    REQUIRE(cuMemGetAccess(&flags, &where, reinterpret_cast<CUdeviceptr>(b0.data())) ==
            CUDA_SUCCESS);
    CHECK(flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  }
  // Gone with its buffers: the address range is free again.
  const CUdeviceptr base = reinterpret_cast<CUdeviceptr>(b0.data());
  mapped->clear();
  CUdeviceptr range_base = 0;
  size_t range_size = 0;
  CHECK(cuMemGetAddressRange(&range_base, &range_size, base) != CUDA_SUCCESS);
}

TEST_CASE("mapping and dropping a range many times leaks no GPU memory") {
  if (Gpus() == 0) FAIL(kNeedsGpu);
  auto backend = Backend();
  Vmm vmm(0, 2);
  auto e = ExportCudaBuffer(vmm.at(0), static_cast<int64_t>(vmm.total));
  REQUIRE(e.ok());
  const v1::RegisterWorkerRequest request = Request(*e, 0);
  const std::vector<int64_t> bytes = {static_cast<int64_t>(vmm.total)};
  size_t free_before = 0, free_after = 0, total = 0;
  for (int i = 0; i < 200; ++i) {
    std::vector<Fd> fds = Dup(e->fds);
    auto mapped = backend->MapBuffers(request, bytes, fds);
    REQUIRE(mapped.ok());
    if (i == 0) REQUIRE(cudaMemGetInfo(&free_before, &total) == cudaSuccess);
  }
  REQUIRE(cudaMemGetInfo(&free_after, &total) == cudaSuccess);
  CHECK(free_after + (4 << 20) >= free_before);
}

TEST_CASE("wrong chunks, GPUs and descriptors are refused, naming the range and the CUDA call") {
  if (Gpus() == 0) FAIL(kNeedsGpu);
  auto backend = Backend();
  Vmm vmm(0, 2);
  auto e = ExportCudaBuffer(vmm.at(0), 4096, "b0");
  REQUIRE(e.ok());
  const std::vector<int64_t> bytes = {4096};
  SECTION("a chunk larger than its allocation") {
    auto r = Request(*e, 0);
    r.mutable_vmm_ranges(0)->set_chunk_bytes(0, static_cast<int64_t>(2 * vmm.granularity));
    std::vector<Fd> fds = Dup(e->fds);
    auto m = backend->MapBuffers(r, bytes, fds);
    REQUIRE_FALSE(m.ok());
    CHECK(Has(std::string(m.status().message()),
              "buffer \"b0\": VMM range 0 chunk 0 (descriptor 0): cuMemMap"));
  }
  SECTION("a chunk that is not a whole allocation") {
    auto r = Request(*e, 0);
    r.mutable_vmm_ranges(0)->set_chunk_bytes(0, 4096);
    std::vector<Fd> fds = Dup(e->fds);
    auto m = backend->MapBuffers(r, bytes, fds);
    REQUIRE_FALSE(m.ok());
    CHECK(Has(std::string(m.status().message()), "not a multiple of the allocation granularity"));
  }
  SECTION("a descriptor that is no CUDA allocation") {
    auto r = Request(*e, 0);
    std::vector<Fd> fds;
    fds.emplace_back(memfd_create("not-cuda", MFD_CLOEXEC));
    auto m = backend->MapBuffers(r, bytes, fds);
    REQUIRE_FALSE(m.ok());
    CHECK(m.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(Has(std::string(m.status().message()), "cuMemImportFromShareableHandle"));
  }
  SECTION("memory on another GPU than the range says") {
    if (Gpus() < 2) {
      WARN("one GPU: skipped");
      return;
    }
    auto r = Request(*e, 0);
    r.mutable_vmm_ranges(0)->set_gpu_uuid(*CudaDeviceUuid(1));
    std::vector<Fd> fds = Dup(e->fds);
    auto m = backend->MapBuffers(r, bytes, fds);
    REQUIRE_FALSE(m.ok());
    CHECK(Has(std::string(m.status().message()), "lives on GPU 0, not on GPU 1"));
  }
  SECTION("a GPU UUID this daemon does not serve") {
    auto r = Request(*e, 0);
    r.mutable_vmm_ranges(0)->set_gpu_uuid("GPU-00000000-0000-0000-0000-000000000000");
    std::vector<Fd> fds = Dup(e->fds);
    auto m = backend->MapBuffers(r, bytes, fds);
    REQUIRE_FALSE(m.ok());
    CHECK(Has(std::string(m.status().message()), "no GPU of this daemon has GPU UUID"));
  }
}

}  // namespace
}  // namespace refit
