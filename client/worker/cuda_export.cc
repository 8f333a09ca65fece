#include "client/worker/cuda_export.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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

// Every VMM allocation exported so far, by base; closes the descriptors not handed on (a
// failure).
class ExportedChunks {
 public:
  ExportedChunks() = default;
  ExportedChunks(const ExportedChunks&) = delete;
  ExportedChunks& operator=(const ExportedChunks&) = delete;
  ~ExportedChunks() {
    for (auto& [base, c] : chunks) {
      if (c.fd >= 0) close(c.fd);
    }
  }

  std::map<CUdeviceptr, Chunk> chunks;
};

// A buffer in VMM memory, placed in its range once the ranges are known.
struct VmmBuffer {
  size_t index;
  CUdeviceptr start, end;
  std::string what;
};

// Adjacent allocations on one GPU.
struct Range {
  CUdeviceptr start, end;
  int device;
};

// What one ExportCudaBuffers call has gathered so far.
struct ExportState {
  CudaExport out;
  ExportedChunks exported;
  std::vector<VmmBuffer> vmm;
  bool driver_ready = false;
};

// Makes the primary context of the GPU that holds `p` current (driver calls act on the current
// context) and returns that GPU.
absl::StatusOr<int> MakeBufferDeviceCurrent(const void* p, const std::string& what) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess ||
      attributes.type != cudaMemoryTypeDevice) {
    cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        what, " is not device memory: the cuda backend takes buffers allocated on a GPU"));
  }
  if (cudaSetDevice(attributes.device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat(what, ": cannot make GPU ", attributes.device, "'s context current"));
  }
  return attributes.device;
}

// Whether `p` lies in CUDA VMM memory (cuMemCreate) rather than a legacy allocation (cudaMalloc).
bool IsVmmMemory(const void* p) {
  CUmemGenericAllocationHandle probe = 0;
  if (cuMemRetainAllocationHandle(&probe, const_cast<void*>(p)) != CUDA_SUCCESS) return false;
  cuMemRelease(probe);
  return true;
}

// Every allocation under [start, end), each exported once however many buffers it holds.
absl::Status ExportVmmChunks(CUdeviceptr start, CUdeviceptr end, const std::string& what,
                             std::map<CUdeviceptr, Chunk>& chunks) {
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
  return absl::OkStatus();
}

// Buffer `i`: an IPC handle for legacy memory; for VMM memory, its allocations exported and the
// buffer noted, to be placed once every buffer's allocations are known.
absl::Status ExportBuffer(size_t i, const CudaBufferRef& buffer, ExportState& state) {
  const std::string what = buffer.name.empty() ? absl::StrCat("buffer ", i)
                                               : absl::StrCat("buffer \"", buffer.name, "\"");
  const void* p = buffer.pointer;
  absl::StatusOr<int> device = MakeBufferDeviceCurrent(p, what);
  if (!device.ok()) return device.status();
  if (!state.driver_ready) {
    if (CUresult r = cuInit(0); r != CUDA_SUCCESS)
      return absl::InternalError(absl::StrCat("cuInit: ", CuName(r)));
    state.driver_ready = true;
  }
  if (state.out.gpu_uuid.empty()) {
    auto uuid = CudaDeviceUuid(*device);
    if (!uuid.ok()) return uuid.status();
    state.out.gpu_uuid = *uuid;
  }
  if (!IsVmmMemory(p)) return ExportIpc(p, buffer.bytes, *device, what, &state.out.memory[i]);
  const CUdeviceptr start = reinterpret_cast<CUdeviceptr>(p);
  const CUdeviceptr end = start + static_cast<CUdeviceptr>(std::max<int64_t>(buffer.bytes, 1));
  if (absl::Status s = ExportVmmChunks(start, end, what, state.exported.chunks); !s.ok()) return s;
  state.vmm.push_back({i, start, end, what});
  return absl::OkStatus();
}

// Hands every exported allocation's descriptor to `out`, adjacent allocations on one GPU forming
// one range; descriptors in address order.
absl::StatusOr<std::vector<Range>> HandOverRanges(std::map<CUdeviceptr, Chunk>& chunks,
                                                  CudaExport& out) {
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
  return ranges;
}

// Each VMM buffer's range and its offset there; a buffer may not run past its range.
absl::Status PlaceVmmBuffers(const std::vector<VmmBuffer>& vmm, const std::vector<Range>& ranges,
                             CudaExport& out) {
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
  ExportState state;
  state.out.memory.resize(buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (absl::Status s = ExportBuffer(i, buffers[i], state); !s.ok()) return s;
  }
  absl::StatusOr<std::vector<Range>> ranges = HandOverRanges(state.exported.chunks, state.out);
  if (!ranges.ok()) return ranges.status();
  if (absl::Status s = PlaceVmmBuffers(state.vmm, *ranges, state.out); !s.ok()) return s;
  return std::move(state.out);
}

}  // namespace refit
