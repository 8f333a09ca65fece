#include "daemon/cuda_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <functional>
#include <span>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/cuda_driver.h"
#include "daemon/logging.h"
#include "daemon/memory_refs.h"
#include "kernels/copy_kernels.h"
#include "kernels/network_schedule.h"
#include "plan/status_macros.h"

namespace refit {
namespace {

absl::Status CudaError(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

#define CUDA_RETURN_IF_ERROR(call, what)                            \
  do {                                                              \
    if (auto s_ = CudaError((call), (what)); !s_.ok()) return s_;   \
  } while (0)

absl::Status NcclError(ncclResult_t r, const std::string& what) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

}  // namespace

struct CudaBackend::Communicator {
  std::string id;
  std::map<int32_t, ncclComm_t> by_gpu;  // local GPU -> its rank's communicator
  bool ready = false;
  std::map<void*, std::pair<int32_t, void*>> registered;  // buffer -> (GPU, NCCL's handle)
  void Abort() {
    for (auto& [g, c] : by_gpu) {
      cudaSetDevice(g);
      ncclCommAbort(c);
    }
    by_gpu.clear();
    registered.clear();  // released with the communicator
  }
  // Registers `buffer` (from ncclMemAlloc) with GPU `gpu`'s rank once; in progress until Wait.
  absl::Status Register(int32_t gpu, void* buffer, size_t bytes) {
    if (registered.contains(buffer)) return absl::OkStatus();
    cudaSetDevice(gpu);
    void* handle = nullptr;
    const ncclResult_t r = ncclCommRegister(by_gpu.at(gpu), buffer, bytes, &handle);
    if (r != ncclSuccess && r != ncclInProgress) {
      return NcclError(r, absl::StrCat("ncclCommRegister of ", bytes, " bytes of staging on GPU ", gpu));
    }
    registered[buffer] = {gpu, handle};
    return absl::OkStatus();
  }
  // Before the buffer is freed (its streams idle).
  void Deregister(void* buffer) {
    auto it = registered.find(buffer);
    if (it == registered.end()) return;
    cudaSetDevice(it->second.first);
    ncclCommDeregister(by_gpu.at(it->second.first), it->second.second);
    registered.erase(it);
  }
  ~Communicator() {
    while (!registered.empty()) Deregister(registered.begin()->first);
    for (auto& [g, c] : by_gpu) {
      cudaSetDevice(g);
      ncclCommDestroy(c);
    }
  }
  // An asynchronous error of any rank (a dead peer on the socket transport), or OK.
  absl::Status Errors(const std::string& what) {
    for (auto& [g, c] : by_gpu) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(c, &state);
      if (state != ncclSuccess && state != ncclInProgress) return NcclError(state, what);
    }
    return absl::OkStatus();
  }
  // Polls every rank until none is in progress; errors (a dead peer), `interrupted` (a cancel,
  // the deadline) fail.
  absl::Status Wait(const std::function<absl::Status()>& interrupted, const std::string& what) {
    const absl::Time spin_until = absl::Now() + absl::Milliseconds(2);
    while (true) {
      bool pending = false;
      for (auto& [g, c] : by_gpu) {
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(c, &state);
        if (state == ncclInProgress) pending = true;
        else if (state != ncclSuccess) return NcclError(state, what);
      }
      if (!pending) return absl::OkStatus();
      if (auto s = interrupted(); !s.ok()) return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
      // Spin at first: between the steps of a round the host must stay ahead of the GPU, and a
      // sleep costs tens of microseconds; an init that takes long is polled gently.
      if (absl::Now() > spin_until) absl::SleepFor(absl::Microseconds(50));
    }
  }
};

absl::StatusOr<std::string> CudaBackend::NewCommunicatorId() {
  ncclUniqueId id;
  if (auto s = NcclError(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

void CudaBackend::DropCommunicator(const std::string& group) {
  auto it = comms_.find(group);
  if (it == comms_.end()) return;
  const absl::Time t0 = absl::Now();
  it->second->Abort();
  Logger("data")->warn("group \"{}\": NCCL communicator aborted in {:.0f} ms; the next round builds a new one", group,
                       absl::ToDoubleMilliseconds(absl::Now() - t0));
  comms_.erase(it);
}

absl::StatusOr<CudaBackend::Communicator*> CudaBackend::CommunicatorFor(const TransferJob& job) {
  auto& slot = comms_[job.group];
  if (slot != nullptr && slot->id == job.nccl_id && slot->ready) return slot.get();
  if (slot != nullptr) slot->Abort();
  if (job.nccl_id.size() != sizeof(ncclUniqueId)) {
    return absl::FailedPreconditionError("the plan crosses nodes but came without an NCCL id");
  }
  slot = std::make_unique<Communicator>();
  slot->id = job.nccl_id;
  ncclUniqueId id;
  std::memcpy(&id, job.nccl_id.data(), sizeof id);
  const int nranks = static_cast<int>(job.plan->gpus.size());
  if (auto s = NcclError(ncclGroupStart(), "ncclGroupStart"); !s.ok()) return s;
  for (size_t r = 0; r < job.plan->gpus.size(); ++r) {
    const PlanGpu& g = job.plan->gpus[r];
    if (g.node != job.node) continue;
    cudaSetDevice(g.gpu);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init and abort must not hang on a dead peer
    ncclComm_t comm;
    const ncclResult_t res = ncclCommInitRankConfig(&comm, nranks, id, static_cast<int>(r), &config);
    if (res != ncclSuccess && res != ncclInProgress) {
      ncclGroupEnd();
      return NcclError(res, "ncclCommInitRankConfig");
    }
    slot->by_gpu[g.gpu] = comm;
  }
  if (auto s = NcclError(ncclGroupEnd(), "ncclGroupEnd"); !s.ok()) return s;
  if (auto s = slot->Wait([&] { return Interrupted(job); }, absl::StrCat("round ", job.round_id, ": NCCL communicator of ", nranks, " ranks"));
      !s.ok()) {
    DropCommunicator(job.group);
    return s;
  }
  slot->ready = true;
  return slot.get();
}


// An IPC allocation, opened in the context of its own GPU and, when another GPU's kernels read or
// write it, in that GPU's context too (with lazy peer access): a pointer from one device's import
// is not valid in another device's kernels.
struct CudaBackend::Allocation {
  std::string handle;
  int64_t size = 0;
  void* base = nullptr;  // in the context of `device`
  int32_t device = 0;
  std::map<int32_t, void*> on_device;  // other GPUs' imports
  CudaBackend* owner = nullptr;
  ~Allocation() {
    for (auto& [g, p] : on_device) {
      cudaSetDevice(g);
      cudaIpcCloseMemHandle(p);
    }
    if (base != nullptr) {
      cudaSetDevice(device);
      cudaIpcCloseMemHandle(base);
    }
    if (owner != nullptr) owner->Forget(this);
  }
};

void CudaBackend::Forget(Allocation* a) {
  std::lock_guard<std::mutex> lock(mu_);
  by_base_.erase(reinterpret_cast<uint64_t>(a->base));
}

void CudaBackend::ForgetVmm(uint64_t base) {
  std::lock_guard<std::mutex> lock(mu_);
  vmm_by_base_.erase(base);
}

absl::StatusOr<uint64_t> CudaBackend::AddressOn(int32_t gpu, uint64_t address) {
  if (address == 0) return address;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto v = vmm_by_base_.upper_bound(address); v != vmm_by_base_.begin()) {
    --v;
    if (address < v->first + v->second) return address;  // mapped at this address for every GPU
  }
  auto it = by_base_.upper_bound(address);
  if (it == by_base_.begin()) return absl::InternalError("address outside every mapped allocation");
  --it;
  Allocation* a = it->second;
  if (address >= it->first + static_cast<uint64_t>(a->size)) {
    return absl::InternalError("address outside every mapped allocation");
  }
  if (a->device == gpu) return address;
  void*& p = a->on_device[gpu];
  if (p == nullptr) {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, a->handle.data(), sizeof handle);
    CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess),
                         absl::StrCat("opening GPU ", a->device, "'s buffer on GPU ", gpu));
  }
  return reinterpret_cast<uint64_t>(p) + (address - it->first);
}

namespace {

class IpcBuffer : public MappedBuffer {
 public:
  IpcBuffer(std::shared_ptr<CudaBackend::Allocation> a, int64_t offset, int64_t bytes)
      : a_(std::move(a)), offset_(offset), bytes_(bytes) {}
  // Device memory: the span carries the address and size; it is never dereferenced on the host.
  std::span<std::byte> bytes() const override {
    return {static_cast<std::byte*>(a_->base) + offset_, static_cast<size_t>(bytes_)};
  }

 private:
  std::shared_ptr<CudaBackend::Allocation> a_;
  int64_t offset_, bytes_;
};

}  // namespace

// A worker's VMM range mapped into this process: its chunks imported from their descriptors and
// mapped back to back in one reserved address range, readable and writable from every GPU this
// daemon serves, so that one address is valid in every local GPU's kernels (unlike IPC imports,
// which are opened again per GPU).
struct CudaBackend::VmmMapping {
  const CudaDriver* driver = nullptr;
  CudaBackend* owner = nullptr;  // set once registered in vmm_by_base_
  int32_t device = 0;
  CUdeviceptr base = 0;
  size_t reserved = 0;                            // bytes of address space reserved at base
  std::vector<std::pair<size_t, size_t>> mapped;  // (offset, bytes) of each chunk mapped
  ~VmmMapping() {
    if (owner != nullptr) owner->ForgetVmm(base);  // no new kernel is given these addresses
    cudaSetDevice(device);
    // One unmap per map: cuMemUnmap takes whole mappings only.
    for (auto [offset, bytes] : mapped) driver->MemUnmap(base + offset, bytes);
    if (reserved > 0) driver->MemAddressFree(base, reserved);
  }
};

namespace {

class VmmBuffer : public MappedBuffer {
 public:
  VmmBuffer(std::shared_ptr<CudaBackend::VmmMapping> m, int64_t offset, int64_t bytes)
      : m_(std::move(m)), offset_(offset), bytes_(bytes) {}
  std::span<std::byte> bytes() const override {
    return {reinterpret_cast<std::byte*>(m_->base) + offset_, static_cast<size_t>(bytes_)};
  }

 private:
  std::shared_ptr<CudaBackend::VmmMapping> m_;  // shared by every buffer of the range
  int64_t offset_, bytes_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Start(const std::vector<int32_t>& gpus, int64_t staging_bytes,
                                                               bool nccl_stream_priority) {
  int count = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "no usable GPU for --backend=cuda");
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->gpus_ = gpus;
  b->staging_bytes_ = staging_bytes;
  if (b->gpus_.empty()) {
    for (int i = 0; i < count; ++i) b->gpus_.push_back(i);
  }
  for (int32_t g : b->gpus_) {
    if (g < 0 || g >= count) return absl::InvalidArgumentError(absl::StrCat("--gpus names GPU ", g, "; this node has ", count));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(g), absl::StrCat("GPU ", g));
    // Its names, for workers that name their GPU (their CUDA index is not this daemon's).
    cudaDeviceProp prop;
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, g), absl::StrCat("the properties of GPU ", g));
    char pci[64] = {};
    CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(pci, sizeof pci, g), absl::StrCat("the PCI bus id of GPU ", g));
    b->names_.push_back({g, FormatGpuUuid(std::span<const unsigned char, 16>(
                                reinterpret_cast<const unsigned char*>(prop.uuid.bytes), 16)),
                         pci});
    GpuStreams& streams = b->streams_[g];
    int least = 0, greatest = 0;
    CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest), "stream priorities");
    for (void** s : {&streams.compute, &streams.comm, &streams.direct}) {
      cudaStream_t created;
      const int priority = nccl_stream_priority && s == &streams.comm ? greatest : least;
      CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(&created, cudaStreamNonBlocking, priority), "stream");
      *s = created;
    }
    for (int32_t peer : b->gpus_) {
      if (peer == g) continue;
      int can = 0;
      cudaDeviceCanAccessPeer(&can, g, peer);
      if (!can) return absl::FailedPreconditionError(absl::StrCat("GPU ", g, " cannot access GPU ", peer, " (no peer access)"));
      const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) return CudaError(e, "enabling peer access");
      cudaGetLastError();
    }
  }
  std::vector<std::string> names;
  for (const GpuName& n : b->names_) names.push_back(absl::StrCat(n.index, ": ", n.uuid, " (", n.pci_bus_id, ")"));
  Logger("data")->info("cuda backend on GPUs {}", absl::StrJoin(names, ", "));
  if (auto driver = CudaDriver::Get(); !driver.ok()) {
    // IPC memory still works; VMM registrations will be refused with this reason.
    Logger("data")->warn("CUDA VMM memory cannot be registered here: {}", std::string(driver.status().message()));
  }
  return b;
}

absl::StatusOr<int32_t> CudaBackend::GpuIndex(const std::string& name) { return FindGpu(names_, name); }

CudaBackend::~CudaBackend() {
  std::vector<std::string> groups;
  for (const auto& [group, p] : prepared_) groups.push_back(group);
  for (const auto& group : groups) DropPrepared(group);
  comms_.clear();
  for (auto& [g, streams] : streams_) {
    cudaSetDevice(g);
    for (void* s : {streams.compute, streams.comm, streams.direct}) {
      if (s != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(s));
    }
  }
}

absl::StatusOr<std::unique_ptr<MappedBuffer>> CudaBackend::Map(const v1::BufferMemory& memory, int64_t bytes) {
  if (!memory.has_cuda_ipc()) {
    return absl::InvalidArgumentError(
        "the cuda backend reaches buffers through CUDA IPC handles (BufferMemory.cuda_ipc); this "
        "buffer has none (a host shared-memory buffer needs --backend=host)");
  }
  const v1::CudaIpc& ipc = memory.cuda_ipc();
  if (ipc.handle().size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC handle has ", sizeof(cudaIpcMemHandle_t),
                                                   " bytes, not ", ipc.handle().size()));
  }
  int32_t device = ipc.device();
  if (!ipc.gpu_uuid().empty()) {
    auto found = GpuIndex(ipc.gpu_uuid());
    if (!found.ok()) return found.status();
    device = *found;
  }
  if (std::find(gpus_.begin(), gpus_.end(), device) == gpus_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("buffer on GPU ", device, ", which this daemon does not serve"));
  }
  if (ipc.offset() < 0 || bytes < 0 || ipc.offset() > ipc.size() - bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a buffer of ", bytes, " bytes at offset ", ipc.offset(),
                                                   " does not fit its allocation of ", ipc.size(), " bytes"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Allocation> a = opened_[ipc.handle()].lock();
  if (a == nullptr) {  // each allocation opened once, however many buffers it holds
    a = std::make_shared<Allocation>();
    a->device = device;
    a->handle = ipc.handle();
    a->size = ipc.size();
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, ipc.handle().data(), sizeof handle);
    CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&a->base, handle, cudaIpcMemLazyEnablePeerAccess),
                         "cudaIpcOpenMemHandle (is the worker alive, and on this node?)");
    opened_[ipc.handle()] = a;
    a->owner = this;
    by_base_[reinterpret_cast<uint64_t>(a->base)] = a.get();
  }
  return std::unique_ptr<MappedBuffer>(new IpcBuffer(a, ipc.offset(), bytes));
}

absl::StatusOr<std::shared_ptr<CudaBackend::VmmMapping>> CudaBackend::MapVmmRange(
    const v1::RegisterWorkerRequest& request, int r, std::span<const Fd> fds) {
  const v1::VmmRange& range = request.vmm_ranges(r);
  const std::string what = absl::StrCat("VMM range ", r);
  auto driver_or = CudaDriver::Get();
  if (!driver_or.ok()) return Annotate(driver_or.status(), what);
  const CudaDriver& driver = **driver_or;
  int32_t device = request.worker().gpu();  // the worker's GPU (Register resolved its gpu_uuid)
  if (!range.gpu_uuid().empty()) {
    auto found = GpuIndex(range.gpu_uuid());
    if (!found.ok()) return Annotate(found.status(), what);
    device = *found;
  }
  if (std::find(gpus_.begin(), gpus_.end(), device) == gpus_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is on GPU ", device, ", which this daemon does not serve"));
  }
  // Driver calls act on the current context: make GPU `device`'s primary context current.
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device), absl::StrCat(what, ": cudaSetDevice(", device, ")"));
  CUDA_RETURN_IF_ERROR(cudaFree(nullptr), absl::StrCat(what, ": the primary context of GPU ", device));

  auto m = std::make_shared<VmmMapping>();
  m->driver = &driver;
  m->device = device;
  // The imported handles, released on every way out (declared after `m`, so released before it
  // unmaps): from cuMemMap on, the mappings hold the memory.
  struct Handles {
    const CudaDriver& driver;
    std::vector<CUmemGenericAllocationHandle> h;
    ~Handles() {
      for (CUmemGenericAllocationHandle x : h) driver.MemRelease(x);
    }
  } handles{driver, {}};
  size_t alignment = 1;
  const int chunks = range.chunk_bytes_size();
  auto chunk_name = [&](int c) { return absl::StrCat(what, " chunk ", c, " (descriptor ", range.first_fd() + c, ")"); };
  for (int c = 0; c < chunks; ++c) {
    const Fd& fd = fds[static_cast<size_t>(range.first_fd() + c)];
    CUmemGenericAllocationHandle h = 0;
    REFIT_RETURN_IF_ERROR(driver.Check(
        driver.MemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd.get())),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        absl::StrCat(chunk_name(c), ": cuMemImportFromShareableHandle (is it a CUDA allocation exported with "
                                    "cuMemExportToShareableHandle as a POSIX file descriptor, on this node?)"),
        absl::StatusCode::kInvalidArgument));
    handles.h.push_back(h);
    CUmemAllocationProp prop{};
    REFIT_RETURN_IF_ERROR(driver.Check(driver.MemGetAllocationPropertiesFromHandle(&prop, h),
                                       absl::StrCat(chunk_name(c), ": cuMemGetAllocationPropertiesFromHandle")));
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device) {
      return absl::InvalidArgumentError(absl::StrCat(
          chunk_name(c), " lives ",
          prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? absl::StrCat("on GPU ", prop.location.id)
                                                            : std::string("off the GPUs (host or another location)"),
          ", not on GPU ", device, " (the range's gpu_uuid, else the worker's GPU)"));
    }
    size_t granularity = 0;
    REFIT_RETURN_IF_ERROR(driver.Check(
        driver.MemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        absl::StrCat(chunk_name(c), ": cuMemGetAllocationGranularity")));
    if (granularity == 0 || range.chunk_bytes(c) % static_cast<int64_t>(granularity) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(chunk_name(c), ": ", range.chunk_bytes(c),
                                                     " bytes, not a multiple of the allocation granularity (",
                                                     granularity, " bytes): not a whole allocation"));
    }
    alignment = std::max(alignment, granularity);
  }
  const size_t total = static_cast<size_t>(VmmRangeBytes(range));
  REFIT_RETURN_IF_ERROR(driver.Check(driver.MemAddressReserve(&m->base, total, alignment, 0, 0),
                                     absl::StrCat(what, ": cuMemAddressReserve of ", total, " bytes")));
  m->reserved = total;
  size_t offset = 0;
  for (int c = 0; c < chunks; ++c) {
    const size_t bytes = static_cast<size_t>(range.chunk_bytes(c));
    REFIT_RETURN_IF_ERROR(driver.Check(driver.MemMap(m->base + offset, bytes, 0, handles.h[c], 0),
                                       absl::StrCat(chunk_name(c), ": cuMemMap of ", bytes,
                                                    " bytes (is the allocation that large?)")));
    m->mapped.push_back({offset, bytes});
    offset += bytes;
  }
  std::vector<CUmemAccessDesc> access;
  for (int32_t g : gpus_) {
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = g;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access.push_back(a);
  }
  REFIT_RETURN_IF_ERROR(driver.Check(driver.MemSetAccess(m->base, total, access.data(), access.size()),
                                     absl::StrCat(what, ": cuMemSetAccess (read and write for GPUs ",
                                                  absl::StrJoin(gpus_, ", "), ")")));
  std::lock_guard<std::mutex> lock(mu_);
  vmm_by_base_[static_cast<uint64_t>(m->base)] = total;
  m->owner = this;
  return m;
}

absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> CudaBackend::MapBuffers(
    const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes, std::span<const Fd> fds) {
  std::vector<std::unique_ptr<MappedBuffer>> out;
  std::vector<std::shared_ptr<VmmMapping>> ranges(static_cast<size_t>(request.vmm_ranges_size()));
  for (int b = 0; b < request.memory_size(); ++b) {
    const v1::BufferMemory& m = request.memory(b);
    const std::string what = absl::StrCat("buffer \"", request.worker().buffers(b).name(), "\"");
    if (m.has_cuda_vmm()) {
      std::shared_ptr<VmmMapping>& range = ranges[static_cast<size_t>(m.cuda_vmm().range())];
      if (range == nullptr) {  // each range mapped once, for all of its buffers
        auto mapped = MapVmmRange(request, m.cuda_vmm().range(), fds);
        if (!mapped.ok()) return Annotate(mapped.status(), what);
        range = *std::move(mapped);
      }
      out.push_back(std::unique_ptr<MappedBuffer>(new VmmBuffer(range, m.cuda_vmm().offset(), buffer_bytes[b])));
      continue;
    }
    if (m.has_shm()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": host shared memory needs --backend host; this daemon runs --backend cuda (CUDA IPC or VMM)"));
    }
    auto mapped = Map(m, buffer_bytes[b]);
    if (!mapped.ok()) return Annotate(mapped.status(), what);
    out.push_back(*std::move(mapped));
  }
  return out;
}

// A group's plan as this node executes it, built once per plan and buffer addresses and reused
// round after round: the schedule, its copy items uploaded to each GPU, the staging and the
// events that chain the pipeline.
struct CudaBackend::Prepared {
  struct DeviceWork {
    const CopyItem* items = nullptr;
    const int64_t* units = nullptr;
    int n = 0;
    int64_t total_units = 0;
  };
  struct OnGpu {
    void* arrays = nullptr;   // every item of this GPU, one allocation
    void* staging = nullptr;
    int64_t staging_bytes = 0;
    bool nccl_memory = false;  // staging from ncclMemAlloc (registered with the communicator)
    std::vector<DeviceWork> direct;                 // per stage
    std::vector<std::vector<DeviceWork>> pack, unpack;  // per stage, per step
    // Per stage, per step, on the GPU's timeline (events with timing: the round's log says where
    // the time went): pack done (compute), on the wire (comm), off the wire (comm), unpacked.
    std::vector<std::vector<cudaEvent_t>> packed, wire_begin, moved, unpacked;
    cudaEvent_t start = nullptr;  // the round's first work on this GPU
  };
  std::shared_ptr<const Plan> plan;
  BufferAddresses src, dst;
  NodeSchedule schedule;
  std::map<int32_t, OnGpu> gpus;

  ~Prepared() {
    for (auto& [g, on] : gpus) {
      cudaSetDevice(g);
      if (on.start != nullptr) cudaEventDestroy(on.start);
      for (auto* list : {&on.packed, &on.wire_begin, &on.moved, &on.unpacked}) {
        for (auto& events : *list) {
          for (cudaEvent_t e : events) cudaEventDestroy(e);
        }
      }
      cudaFree(on.arrays);
      if (on.nccl_memory) ncclMemFree(on.staging);
      else cudaFree(on.staging);
    }
  }
};

absl::StatusOr<CudaBackend::Prepared*> CudaBackend::PreparedFor(const TransferJob& job, const BufferAddresses& src,
                                                                const BufferAddresses& dst) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = prepared_.find(job.group);
    if (it != prepared_.end() && it->second->plan == job.plan && it->second->src == src && it->second->dst == dst) {
      return it->second.get();
    }
  }
  DropPrepared(job.group);
  auto p = std::make_unique<Prepared>();
  p->plan = job.plan;
  p->src = src;
  p->dst = dst;
  ScheduleOptions options;
  options.node = job.node;
  options.staging_budget = staging_bytes_;
  options.step_bytes = job.step_bytes;
  if (job.zero_copy_min_bytes > 0) options.zero_copy_min_bytes = job.zero_copy_min_bytes;
  auto schedule = BuildNodeSchedule(
      *job.plan, options,
      [&](int32_t gpu) -> absl::StatusOr<std::pair<BufferAddresses, BufferAddresses>> {
        if (!streams_.contains(gpu)) return absl::FailedPreconditionError(absl::StrCat("GPU ", gpu, " is not served here"));
        std::pair<BufferAddresses, BufferAddresses> out;
        for (auto [from, to] : {std::pair{&src, &out.first}, std::pair{&dst, &out.second}}) {
          for (uint64_t a : *from) {
            auto t = AddressOn(gpu, a);
            if (!t.ok()) return t.status();
            to->push_back(*t);
          }
        }
        return out;
      },
      [&](int32_t gpu, int64_t bytes) -> absl::StatusOr<uint64_t> {
        Prepared::OnGpu& on = p->gpus[gpu];
        CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
        if (job.nccl_register) {
          if (auto s = NcclError(ncclMemAlloc(&on.staging, static_cast<size_t>(bytes)),
                                 absl::StrCat("ncclMemAlloc of ", bytes, " bytes of staging on GPU ", gpu));
              !s.ok()) {
            return s;
          }
          on.nccl_memory = true;
        } else {
          CUDA_RETURN_IF_ERROR(cudaMalloc(&on.staging, bytes), absl::StrCat("staging of ", bytes, " bytes on GPU ", gpu));
        }
        on.staging_bytes = bytes;
        return reinterpret_cast<uint64_t>(on.staging);
      });
  if (!schedule.ok()) return schedule.status();
  p->schedule = *std::move(schedule);
  // Upload every work list of each GPU into one device allocation.
  std::map<int32_t, std::vector<std::pair<const CopyWork*, Prepared::DeviceWork*>>> works;
  for (int stage = 0; stage < kMaxStages; ++stage) {
    const StageSchedule& s = p->schedule.stages[stage];
    for (const auto& [gpu, w] : s.direct) {
      Prepared::OnGpu& on = p->gpus[gpu];
      on.direct.resize(kMaxStages);
      works[gpu].push_back({&w, &on.direct[stage]});
    }
    for (const auto& [gpu, steps] : s.steps) {
      Prepared::OnGpu& on = p->gpus[gpu];
      on.pack.resize(kMaxStages);
      on.unpack.resize(kMaxStages);
      for (auto* list : {&on.packed, &on.wire_begin, &on.moved, &on.unpacked}) list->resize(kMaxStages);
      if (on.start == nullptr) CUDA_RETURN_IF_ERROR(cudaEventCreate(&on.start), "cudaEventCreate");
      on.pack[stage].resize(steps.size());
      on.unpack[stage].resize(steps.size());
      CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
      for (size_t k = 0; k < steps.size(); ++k) {
        works[gpu].push_back({&steps[k].pack, &on.pack[stage][k]});
        works[gpu].push_back({&steps[k].unpack, &on.unpack[stage][k]});
        for (auto* events : {&on.packed[stage], &on.wire_begin[stage], &on.moved[stage], &on.unpacked[stage]}) {
          cudaEvent_t e;
          CUDA_RETURN_IF_ERROR(cudaEventCreate(&e), "cudaEventCreate");
          events->push_back(e);
        }
      }
    }
  }
  for (auto& [gpu, list] : works) {
    std::vector<std::byte> host;
    std::vector<std::pair<size_t, size_t>> at;  // (items, units) offsets
    for (auto& [w, d] : list) {
      const size_t items = host.size();
      host.resize(items + w->items.size() * sizeof(CopyItem));
      std::memcpy(host.data() + items, w->items.data(), w->items.size() * sizeof(CopyItem));
      const size_t units = host.size();
      host.resize(units + w->unit_begin.size() * sizeof(int64_t));
      std::memcpy(host.data() + units, w->unit_begin.data(), w->unit_begin.size() * sizeof(int64_t));
      host.resize((host.size() + 15) / 16 * 16);
      at.push_back({items, units});
    }
    Prepared::OnGpu& on = p->gpus[gpu];
    CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
    CUDA_RETURN_IF_ERROR(cudaMalloc(&on.arrays, std::max<size_t>(host.size(), 16)), "copy items");
    CUDA_RETURN_IF_ERROR(cudaMemcpy(on.arrays, host.data(), host.size(), cudaMemcpyHostToDevice), "copy items");
    auto* base = static_cast<std::byte*>(on.arrays);
    for (size_t i = 0; i < list.size(); ++i) {
      auto& [w, d] = list[i];
      d->items = reinterpret_cast<const CopyItem*>(base + at[i].first);
      d->units = reinterpret_cast<const int64_t*>(base + at[i].second);
      d->n = static_cast<int>(w->items.size());
      d->total_units = w->unit_begin.empty() ? 0 : w->unit_begin.back();
    }
  }
  std::string staging;
  for (const auto& [gpu, bytes] : p->schedule.region_bytes) {
    absl::StrAppend(&staging, staging.empty() ? "" : ", ", "GPU ", gpu, ": ", p->schedule.StagingBytes(gpu), " bytes (",
                    p->schedule.depth[gpu], " steps in flight)");
  }
  Logger("data")->info("group \"{}\" node {}: prepared; network {} bytes out, {} in ({} zero-copy) in {} operations; "
                       "NVLink {} bytes; local {} bytes; staging {}{}",
                       job.group, job.node, p->schedule.bytes_sent, p->schedule.bytes_received,
                       p->schedule.bytes_zero_copy, p->schedule.network_ops, p->schedule.bytes_peer,
                       p->schedule.bytes_local, staging.empty() ? "none" : staging,
                       job.nccl_register && !staging.empty() ? " (registered with NCCL)" : "");
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = prepared_[job.group];
  slot = std::move(p);
  return slot.get();
}

namespace {

// Where a round's time went on each GPU that used the network, from the events of its steps
// (read after the round, when all of them have completed): time on the wire and its rate, the
// wire's idle time between steps (waiting for a pack, or for the host), the pipeline's fill and
// drain. One info line per GPU, one debug line per step.
void LogTimeline(const TransferJob& job, const CudaBackend::Prepared& p) {
  for (const auto& [gpu, on] : p.gpus) {
    if (on.start == nullptr) continue;
    cudaSetDevice(gpu);
    auto at = [&, start = on.start](cudaEvent_t e) {  // clang 14 cannot capture a structured binding
      float ms = 0;
      return cudaEventElapsedTime(&ms, start, e) == cudaSuccess ? double{ms} : -1.0;
    };
    int steps = 0;
    int64_t bytes = 0;
    double wire = 0, idle = 0, first = -1, last = 0;
    std::vector<double> rates;
    for (int stage = 0; stage < kMaxStages; ++stage) {
      auto it = p.schedule.stages[stage].steps.find(gpu);
      if (it == p.schedule.stages[stage].steps.end()) continue;
      for (size_t k = 0; k < it->second.size(); ++k) {
        int64_t step_bytes = 0;
        for (const NetworkOp& op : it->second[k].ops) step_bytes += op.bytes;
        const double packed = at(on.packed[stage][k]), begin = at(on.wire_begin[stage][k]),
                     end = at(on.moved[stage][k]), unpacked = at(on.unpacked[stage][k]);
        if (begin < 0 || end < 0) return;  // an event never recorded: nothing to say
        ++steps;
        bytes += step_bytes;
        wire += end - begin;
        if (k > 0) idle += std::max(0.0, begin - at(on.moved[stage][k - 1]));
        if (first < 0) first = begin;
        last = std::max(last, unpacked);
        if (end > begin) rates.push_back(step_bytes / 1e6 / (end - begin));
        Logger("data")->debug("round {} GPU {} stage {} step {}: {} bytes in {} operations; packed at {:.3f} ms, on the "
                              "wire {:.3f}-{:.3f} ms, unpacked at {:.3f} ms",
                              job.round_id, gpu, stage, k, step_bytes, it->second[k].ops.size(), packed, begin, end, unpacked);
      }
    }
    if (steps == 0) continue;
    std::sort(rates.begin(), rates.end());
    Logger("data")->info("group \"{}\" round {} GPU {} timeline: {} steps, {} bytes; on the wire {:.3f} ms ({:.1f} GB/s; "
                         "steps {:.0f}-{:.0f} GB/s), wire idle between steps {:.3f} ms, first step on the wire at {:.3f} ms, "
                         "last unpacked at {:.3f} ms",
                         job.group, job.round_id, gpu, steps, bytes, wire, wire > 0 ? bytes / 1e6 / wire : 0.0,
                         rates.empty() ? 0.0 : rates.front(), rates.empty() ? 0.0 : rates.back(), idle, first, last);
  }
}

}  // namespace

void CudaBackend::DropPrepared(const std::string& group) {
  std::unique_ptr<Prepared> old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = prepared_.find(group);
    if (it == prepared_.end()) return;
    old = std::move(it->second);
    prepared_.erase(it);
  }
  for (auto& [gpu, on] : old->gpus) SyncStreams(gpu);
  // NCCL must forget the staging before it is freed.
  auto c = comms_.find(group);
  if (c != comms_.end() && c->second != nullptr) {
    for (auto& [gpu, on] : old->gpus) {
      if (on.nccl_memory) c->second->Deregister(on.staging);
    }
  }
}

void CudaBackend::SyncStreams(int32_t gpu) {
  auto it = streams_.find(gpu);
  if (it == streams_.end()) return;
  cudaSetDevice(gpu);
  for (void* s : {it->second.compute, it->second.comm, it->second.direct}) cudaStreamSynchronize(static_cast<cudaStream_t>(s));
}

absl::StatusOr<TransferStats> CudaBackend::Transfer(const TransferJob& job) {
  BufferAddresses src, dst;
  for (const auto& s : job.src) src.push_back(reinterpret_cast<uint64_t>(s.data()));
  for (const auto& s : job.dst) dst.push_back(reinterpret_cast<uint64_t>(s.data()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_.insert({job.group, job.round_id});
  }
  Communicator* comm = nullptr;
  // Whichever way the transfer fails: abort NCCL (its kernels may wait on a dead peer), let the
  // streams drain, and rebuild everything for the next round.
  bool ok = false;
  struct Cleanup {
    CudaBackend* b;
    const TransferJob& job;
    Communicator*& comm;
    bool& ok;
    ~Cleanup() {
      if (!ok) {
        if (comm != nullptr) b->DropCommunicator(job.group);
        b->DropPrepared(job.group);
      }
      std::lock_guard<std::mutex> lock(b->mu_);
      b->cancelled_.erase({job.group, job.round_id});
      b->active_.erase({job.group, job.round_id});
    }
  } cleanup{this, job, comm, ok};

  auto prepared = PreparedFor(job, src, dst);
  if (!prepared.ok()) return prepared.status();
  const Prepared& p = **prepared;
  const NodeSchedule& schedule = p.schedule;
  if (schedule.uses_network) {
    auto c = CommunicatorFor(job);
    if (!c.ok()) return c.status();
    comm = *c;
    if (job.nccl_register) {
      for (const auto& [gpu, on] : p.gpus) {
        if (on.nccl_memory) {
          if (auto s = comm->Register(gpu, on.staging, static_cast<size_t>(on.staging_bytes)); !s.ok()) return s;
        }
      }
      if (auto s = comm->Wait([&] { return Interrupted(job); }, "registering staging with NCCL"); !s.ok()) return s;
    }
  }
  const auto started = absl::Now();
  for (const auto& [gpu, on] : p.gpus) {
    if (on.start == nullptr) continue;
    CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
    CUDA_RETURN_IF_ERROR(cudaEventRecord(on.start, static_cast<cudaStream_t>(streams_.at(gpu).compute)), "cudaEventRecord");
  }
  for (int stage = 0; stage < kMaxStages; ++stage) {
    const StageSchedule& s = schedule.stages[stage];
    if (s.direct.empty() && s.steps.empty()) continue;
    std::set<int32_t> busy;
    // Pack the first steps ahead, then copy inside the node on a stream of its own.
    for (const auto& [gpu, steps] : s.steps) {
      const Prepared::OnGpu& on = p.gpus.at(gpu);
      const GpuStreams& st = streams_.at(gpu);
      const int32_t depth = std::max(1, schedule.depth.count(gpu) ? schedule.depth.at(gpu) : 1);
      for (int32_t k = 0; k < depth && k < static_cast<int32_t>(steps.size()); ++k) {
        const auto& w = on.pack[stage][k];
        CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
        CUDA_RETURN_IF_ERROR(LaunchCopyItems(w.items, w.units, w.n, w.total_units, static_cast<cudaStream_t>(st.compute)), "pack");
        CUDA_RETURN_IF_ERROR(cudaEventRecord(on.packed[stage][k], static_cast<cudaStream_t>(st.compute)), "cudaEventRecord");
      }
      busy.insert(gpu);
    }
    for (const auto& [gpu, w] : s.direct) {
      const auto& d = p.gpus.at(gpu).direct[stage];
      CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
      CUDA_RETURN_IF_ERROR(LaunchCopyItems(d.items, d.units, d.n, d.total_units, static_cast<cudaStream_t>(streams_.at(gpu).direct)),
                           "copy");
      busy.insert(gpu);
    }
    // Step k: its sends wait for their pack; one NCCL group for every local GPU's operations;
    // the unpack of step k and the pack of step k + depth (into the slots step k freed) follow.
    for (int32_t k = 0; k < s.num_steps; ++k) {
      for (const auto& [gpu, steps] : s.steps) {
        if (k >= static_cast<int32_t>(steps.size())) continue;
        const Prepared::OnGpu& on = p.gpus.at(gpu);
        auto comm_stream = static_cast<cudaStream_t>(streams_.at(gpu).comm);
        CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
        CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comm_stream, on.packed[stage][k], 0), "ordering a step's sends after its pack");
        CUDA_RETURN_IF_ERROR(cudaEventRecord(on.wire_begin[stage][k], comm_stream), "cudaEventRecord");
      }
      if (auto st = NcclError(ncclGroupStart(), "ncclGroupStart"); !st.ok()) return st;
      for (const auto& [gpu, steps] : s.steps) {
        if (k >= static_cast<int32_t>(steps.size())) continue;
        auto comm_stream = static_cast<cudaStream_t>(streams_.at(gpu).comm);
        if (cudaSetDevice(gpu) != cudaSuccess) {
          ncclGroupEnd();
          return CudaError(cudaGetLastError(), "cudaSetDevice");
        }
        for (const NetworkOp& op : steps[k].ops) {
          auto* buffer = reinterpret_cast<void*>(op.buffer);
          const ncclResult_t r =
              op.send ? ncclSend(buffer, static_cast<size_t>(op.bytes), ncclUint8, op.peer, comm->by_gpu.at(gpu), comm_stream)
                      : ncclRecv(buffer, static_cast<size_t>(op.bytes), ncclUint8, op.peer, comm->by_gpu.at(gpu), comm_stream);
          if (r != ncclSuccess && r != ncclInProgress) {
            ncclGroupEnd();
            return NcclError(r, op.send ? "ncclSend" : "ncclRecv");
          }
        }
      }
      const ncclResult_t end = ncclGroupEnd();
      if (end != ncclSuccess && end != ncclInProgress) return NcclError(end, "ncclGroupEnd");
      if (auto st = comm->Wait([&] { return Interrupted(job); }, absl::StrCat("round ", job.round_id, " stage ", stage, " step ", k)); !st.ok()) {
        return st;
      }
      for (const auto& [gpu, steps] : s.steps) {
        if (k >= static_cast<int32_t>(steps.size())) continue;
        const Prepared::OnGpu& on = p.gpus.at(gpu);
        const GpuStreams& st = streams_.at(gpu);
        auto compute = static_cast<cudaStream_t>(st.compute);
        CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
        CUDA_RETURN_IF_ERROR(cudaEventRecord(on.moved[stage][k], static_cast<cudaStream_t>(st.comm)), "cudaEventRecord");
        CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute, on.moved[stage][k], 0), "cudaStreamWaitEvent");
        const auto& u = on.unpack[stage][k];
        CUDA_RETURN_IF_ERROR(LaunchCopyItems(u.items, u.units, u.n, u.total_units, compute), "unpack");
        CUDA_RETURN_IF_ERROR(cudaEventRecord(on.unpacked[stage][k], compute), "cudaEventRecord");
        const int32_t next = k + std::max(1, schedule.depth.count(gpu) ? schedule.depth.at(gpu) : 1);
        if (next < static_cast<int32_t>(steps.size())) {
          const auto& w = on.pack[stage][next];
          CUDA_RETURN_IF_ERROR(LaunchCopyItems(w.items, w.units, w.n, w.total_units, compute), "pack");
          CUDA_RETURN_IF_ERROR(cudaEventRecord(on.packed[stage][next], compute), "cudaEventRecord");
        }
      }
    }
    // Wait for every stream of the stage, polling: a deadline, a Cancel and an NCCL error (a
    // dead peer on the socket transport) must be able to end it.
    for (int32_t gpu : busy) {
      const GpuStreams& st = streams_.at(gpu);
      for (void* stream : {st.direct, st.comm, st.compute}) {
        while (true) {
          const cudaError_t q = cudaStreamQuery(static_cast<cudaStream_t>(stream));
          if (q == cudaSuccess) break;
          if (q != cudaErrorNotReady) return CudaError(q, absl::StrCat("round ", job.round_id, " on GPU ", gpu));
          if (comm != nullptr) {
            if (auto e = comm->Errors(absl::StrCat("round ", job.round_id, " stage ", stage)); !e.ok()) return e;
          }
          if (auto s = Interrupted(job); !s.ok()) {
            return absl::Status(s.code(), absl::StrCat("round ", job.round_id, ": GPU ", gpu, " did not finish stage ", stage,
                                                       comm != nullptr ? " (NCCL aborted)" : "", ": ", s.message()));
          }
          absl::SleepFor(absl::Microseconds(20));
        }
      }
    }
  }
  ok = true;
  TransferStats stats;
  stats.bytes_sent = schedule.bytes_sent;
  stats.bytes_received = schedule.bytes_received + schedule.bytes_peer;
  stats.bytes_local = schedule.bytes_local;
  LogMoved(job, started);
  LogTimeline(job, p);
  return stats;
}

absl::Status CudaBackend::Interrupted(const TransferJob& job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto c = cancelled_.find({job.group, job.round_id});
    if (c != cancelled_.end()) return absl::AbortedError(c->second);
  }
  if (absl::Now() > job.deadline) return absl::DeadlineExceededError("the transfer deadline passed");
  return absl::OkStatus();
}

void CudaBackend::Cancel(const std::string& group, int64_t round_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (active_.contains({group, round_id})) cancelled_[{group, round_id}] = reason;
}

}  // namespace refit
