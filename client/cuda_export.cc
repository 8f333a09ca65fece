#include "client/cuda_export.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cstdio>
#include <map>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

std::string NotShareable(const std::string& what) {
  return absl::StrCat(
      "the CUDA VMM allocation holding ", what,
      " was not created shareable as a POSIX file descriptor, so the daemon cannot map it: with "
      "PyTorch, use PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True only with an allocator that "
      "requests CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, or start the worker with "
      "expandable_segments:False; with your own cuMemCreate, allocate with "
      "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in prop.requestedHandleTypes");
}

std::string CuName(CUresult r) {
  const char* name = nullptr;
  if (cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr)
    return absl::StrCat("CUresult ", r);
  return name;
}

// The calling thread's current device, restored on the way out: exporting must not move the
// caller's own CUDA work to another GPU.
class KeepDevice {
 public:
  KeepDevice() { ok_ = cudaGetDevice(&device_) == cudaSuccess; }
  ~KeepDevice() {
    if (ok_) cudaSetDevice(device_);
  }

 private:
  int device_ = 0;
  bool ok_ = false;
};

// A physical VMM allocation, as mapped in this process.
struct Chunk {
  CUdeviceptr base = 0;
  size_t size = 0;
  int device = 0;
  int fd = -1;  // owned until handed to the CudaExport
};

// Exports the allocation mapped at `address`.
absl::StatusOr<Chunk> ExportChunk(CUdeviceptr address, const std::string& what) {
  CUmemGenericAllocationHandle handle = 0;
  if (CUresult r = cuMemRetainAllocationHandle(&handle, reinterpret_cast<void*>(address));
      r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " runs from CUDA VMM memory into memory that is not (cuMemRetainAllocationHandle: ",
        CuName(r), "): a buffer must lie in one kind of memory"));
  }
  struct Release {
    CUmemGenericAllocationHandle h;
    ~Release() {
      cuMemRelease(h);
    }  // the retain's reference; the worker's mapping keeps the memory
  } release{handle};
  Chunk c;
  // The physical allocation's own extent (one cuMemMap); the driver's allocation range is the
  // fallback for drivers without the mapping attributes.
  CUdeviceptr mapping_base = 0;
  size_t mapping_size = 0;
  if (cuPointerGetAttribute(&mapping_base, CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, address) ==
          CUDA_SUCCESS &&
      cuPointerGetAttribute(&mapping_size, CU_POINTER_ATTRIBUTE_MAPPING_SIZE, address) ==
          CUDA_SUCCESS &&
      mapping_size > 0) {
    c.base = mapping_base;
    c.size = mapping_size;
  } else if (CUresult r = cuMemGetAddressRange(&c.base, &c.size, address); r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(what, ": cuMemGetAddressRange: ", CuName(r)));
  }
  if (!(c.base <= address && address - c.base < c.size)) {
    return absl::InternalError(absl::StrCat(what, ": the driver gave the range [0x",
                                            absl::Hex(c.base), ", +", c.size, ") for address 0x",
                                            absl::Hex(address), ", which it does not hold"));
  }
  uint64_t allowed = 0;
  if (cuPointerGetAttribute(&allowed, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, address) ==
          CUDA_SUCCESS &&
      (allowed & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
    return absl::InvalidArgumentError(NotShareable(what));
  }
  CUmemAllocationProp prop{};
  if (CUresult r = cuMemGetAllocationPropertiesFromHandle(&prop, handle); r != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrCat(what, ": cuMemGetAllocationPropertiesFromHandle: ", CuName(r)));
  }
  if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " lies in CUDA VMM memory that is not on a GPU"));
  }
  c.device = prop.location.id;
  int fd = -1;
  if (CUresult r =
          cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      r != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat(NotShareable(what), " (cuMemExportToShareableHandle: ", CuName(r), ")"));
  }
  c.fd = fd;
  return c;
}

absl::Status ExportIpc(const void* pointer, int64_t bytes, int device, const std::string& what,
                       v1::BufferMemory* out) {
  CUdeviceptr base = 0;
  size_t size = 0;
  if (cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(pointer)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(absl::StrCat("cannot find the allocation that holds ", what));
  }
  cudaIpcMemHandle_t handle;
  const cudaError_t e = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "cudaIpcGetMemHandle refused the allocation holding ", what, " (", cudaGetErrorString(e),
        "); allocate the weights with cudaMalloc (PyTorch's caching allocator) or as shareable "
        "CUDA VMM memory"));
  }
  const int64_t offset = static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(pointer) - base);
  if (offset + bytes > static_cast<int64_t>(size)) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes, " bytes at offset ", offset,
                                                   " run past its allocation of ", size, " bytes"));
  }
  auto uuid = CudaDeviceUuid(device);
  if (!uuid.ok()) return uuid.status();
  v1::CudaIpc* ipc = out->mutable_cuda_ipc();
  ipc->set_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof handle));
  ipc->set_offset(offset);
  ipc->set_size(static_cast<int64_t>(size));
  ipc->set_device(device);
  ipc->set_gpu_uuid(*uuid);
  return absl::OkStatus();
}

}  // namespace

CudaExport::CudaExport(CudaExport&& other) noexcept { *this = std::move(other); }

CudaExport& CudaExport::operator=(CudaExport&& other) noexcept {
  if (this != &other) {
    for (int fd : fds) close(fd);
    memory = std::move(other.memory);
    vmm_ranges = std::move(other.vmm_ranges);
    fds = std::move(other.fds);
    gpu_uuid = std::move(other.gpu_uuid);
    other.fds.clear();
  }
  return *this;
}

CudaExport::~CudaExport() {
  for (int fd : fds) close(fd);
}

absl::StatusOr<std::string> CudaDeviceUuid(int device) {
  cudaDeviceProp prop;
  if (cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("the properties of GPU ", device, ": ", cudaGetErrorString(e)));
  }
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char out[64];
  std::snprintf(out, sizeof out,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return std::string(out);
}

absl::StatusOr<CudaExport> ExportCudaBuffer(const void* device_pointer, int64_t bytes,
                                            const std::string& name) {
  const CudaBufferRef one{device_pointer, bytes, name};
  return ExportCudaBuffers({&one, 1});
}

absl::StatusOr<CudaExport> ExportCudaBuffers(std::span<const CudaBufferRef> buffers) {
  KeepDevice keep;
  CudaExport out;
  out.memory.resize(buffers.size());
  std::map<CUdeviceptr, Chunk> chunks;  // every VMM allocation exported, by base
  struct Closer {
    std::map<CUdeviceptr, Chunk>& chunks;
    ~Closer() {  // those not handed to `out` (a failure)
      for (auto& [base, c] : chunks) {
        if (c.fd >= 0) close(c.fd);
      }
    }
  } closer{chunks};
  struct VmmBuffer {
    size_t index;
    CUdeviceptr start, end;
    std::string what;
  };
  std::vector<VmmBuffer> vmm;
  bool driver_ready = false;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const std::string what = buffers[i].name.empty()
                                 ? absl::StrCat("buffer ", i)
                                 : absl::StrCat("buffer \"", buffers[i].name, "\"");
    const void* p = buffers[i].pointer;
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess ||
        attributes.type != cudaMemoryTypeDevice) {
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          what, " is not device memory: the cuda backend takes buffers allocated on a GPU"));
    }
    // Driver calls act on the current context: the buffer's GPU's primary context.
    if (cudaSetDevice(attributes.device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(
          absl::StrCat(what, ": cannot make GPU ", attributes.device, "'s context current"));
    }
    if (!driver_ready) {
      if (CUresult r = cuInit(0); r != CUDA_SUCCESS)
        return absl::InternalError(absl::StrCat("cuInit: ", CuName(r)));
      driver_ready = true;
    }
    if (out.gpu_uuid.empty()) {
      auto uuid = CudaDeviceUuid(attributes.device);
      if (!uuid.ok()) return uuid.status();
      out.gpu_uuid = *uuid;
    }
    const CUdeviceptr start = reinterpret_cast<CUdeviceptr>(p);
    CUmemGenericAllocationHandle probe = 0;
    if (cuMemRetainAllocationHandle(&probe, const_cast<void*>(p)) !=
        CUDA_SUCCESS) {  // legacy memory
      if (auto s = ExportIpc(p, buffers[i].bytes, attributes.device, what, &out.memory[i]); !s.ok())
        return s;
      continue;
    }
    cuMemRelease(probe);
    const CUdeviceptr end =
        start + static_cast<CUdeviceptr>(std::max<int64_t>(buffers[i].bytes, 1));
    // Every allocation under the buffer, each exported once however many buffers it holds.
    for (CUdeviceptr a = start; a < end;) {
      auto next = chunks.upper_bound(a);
      if (next != chunks.begin()) {
        const Chunk& prev = std::prev(next)->second;
        if (a < prev.base + prev.size) {
          a = prev.base + prev.size;
          continue;
        }
      }
      auto c = ExportChunk(a, absl::StrCat(what, " (at offset ", a - start, ")"));
      if (!c.ok()) return c.status();
      a = c->base + c->size;
      chunks[c->base] = *c;
    }
    vmm.push_back({i, start, end, what});
  }
  // Adjacent allocations on one GPU form one range; descriptors in address order.
  struct Range {
    CUdeviceptr start, end;
    int device;
  };
  std::vector<Range> ranges;
  for (auto& [base, c] : chunks) {
    if (ranges.empty() || ranges.back().end != base || ranges.back().device != c.device) {
      auto uuid = CudaDeviceUuid(c.device);
      if (!uuid.ok()) return uuid.status();
      ranges.push_back({base, base, c.device});
      v1::VmmRange& r = out.vmm_ranges.emplace_back();
      r.set_first_fd(static_cast<int32_t>(out.fds.size()));
      r.set_gpu_uuid(*uuid);
    }
    out.vmm_ranges.back().add_chunk_bytes(static_cast<int64_t>(c.size));
    ranges.back().end = base + c.size;
    out.fds.push_back(c.fd);
    c.fd = -1;  // `out` owns it now
  }
  for (const VmmBuffer& b : vmm) {
    for (size_t r = 0; r < ranges.size(); ++r) {
      if (ranges[r].start <= b.start && b.start < ranges[r].end) {
        if (b.end > ranges[r].end) {
          return absl::InvalidArgumentError(
              absl::StrCat(b.what, " spans CUDA VMM memory of two GPUs"));
        }
        v1::CudaVmm* m = out.memory[b.index].mutable_cuda_vmm();
        m->set_range(static_cast<int32_t>(r));
        m->set_offset(static_cast<int64_t>(b.start - ranges[r].start));
        break;
      }
    }
  }
  return out;
}

}  // namespace refit
