#include "daemon/dataplane/cuda/cuda_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <span>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/base/log_later.h"
#include "daemon/base/logging.h"
#include "daemon/dataplane/cuda/cuda_backend_state.h"
#include "daemon/dataplane/cuda/cuda_driver.h"
#include "daemon/dataplane/cuda/cuda_round_log.h"
#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"
#include "daemon/dataplane/cuda/device_memory.h"
#include "daemon/dataplane/cuda/event.h"
#include "daemon/dataplane/cuda/host_word.h"
#include "daemon/dataplane/cuda/ipc_import.h"
#include "daemon/dataplane/cuda/node_communicator.h"
#include "daemon/dataplane/cuda/staging.h"
#include "daemon/dataplane/cuda/stream.h"
#include "daemon/dataplane/cuda/vmm.h"
#include "daemon/worker/memory_refs.h"
#include "kernels/copy_kernels.h"
#include "kernels/network_schedule.h"
#include "plan/status_macros.h"

namespace refit {

// The page size legacy CUDA IPC imports are mapped with when the allocation is a whole number of
// them.
constexpr int64_t kIpcPageBytes = int64_t{2} << 20;

// An IPC allocation, opened in the context of its own GPU and, when another GPU's kernels read or
// write it, in that GPU's context too (with lazy peer access): a pointer from one device's import
// is not valid in another device's kernels. Shared by its buffers; the last one's going removes
// it from the backend's tables (the shared_ptr's deleter, CudaBackend::Map), then closes it.
struct CudaBackend::Allocation {
  std::string handle;
  int64_t size = 0;
  int32_t device = 0;
  IpcImport home;  // in the context of `device`
  void* base() const { return home.get(); }
  absl::Mutex mu;
  std::map<int32_t, IpcImport> on_device ABSL_GUARDED_BY(mu);  // other GPUs' imports
};

// A worker's VMM range mapped into this process: its chunks imported from their descriptors and
// mapped back to back in one reserved address range, readable and writable from every GPU this
// daemon serves, so that one address is valid in every local GPU's kernels (unlike IPC imports,
// which are opened again per GPU). Its deleter (MapVmmRange) removes it from vmm_by_base_ before
// the maps go (no new kernel is given these addresses), then the reservation.
struct CudaBackend::VmmMapping {
  VmmReservation reserved;
  std::vector<VmmMap> mapped;  // after `reserved`: unmapped before the range is freed
  CUdeviceptr base() const { return reserved.base(); }
};

// A group's state, held by one Transfer: taken out of groups_ under mu_ (refused while another
// Transfer of the group holds it), given back, and the round forgotten, when the lease ends.
class CudaBackend::GroupLease {
 public:
  static absl::StatusOr<GroupLease> Take(CudaBackend* b, const TransferJob& job)
      ABSL_LOCKS_EXCLUDED(b->mu_) {
    absl::MutexLock lock(&b->mu_);
    // A round's TRANSFER may meet its own arming (ArmAhead) or WorkersPrepared's launch, or those
    // of another round (a new coordinator's, while the old one's PREPARE still ends here).
    auto warm = [b, &job]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(b->mu_) {
      return !b->warming_.contains(job.group);
    };
    if (!b->mu_.AwaitWithTimeout(absl::Condition(&warm), absl::Seconds(1))) {
      return absl::UnavailableError(
          absl::StrCat("round ", job.round_id, ": group \"", job.group,
                       "\" is still being made ready for its transfer on this node (1 s)"));
    }
    if (b->leased_.contains(job.group)) {
      return absl::FailedPreconditionError(absl::StrCat("round ", job.round_id,
                                                        ": a transfer of group \"", job.group,
                                                        "\" is still running on this node"));
    }
    std::unique_ptr<Group>& slot = b->groups_[job.group];
    std::unique_ptr<Group> g = slot != nullptr ? std::move(slot) : std::make_unique<Group>();
    b->leased_.insert(job.group);
    b->active_.insert({job.group, job.round_id});
    return GroupLease(b, job, std::move(g));
  }
  GroupLease(GroupLease&& other) noexcept
      : b_(std::exchange(other.b_, nullptr)),
        group_(std::move(other.group_)),
        round_(other.round_),
        g_(std::move(other.g_)) {}
  GroupLease(const GroupLease&) = delete;
  GroupLease& operator=(const GroupLease&) = delete;
  GroupLease& operator=(GroupLease&&) = delete;
  ~GroupLease() {
    if (b_ == nullptr) return;
    absl::MutexLock lock(&b_->mu_);
    b_->groups_[group_] = std::move(g_);
    b_->leased_.erase(group_);
    b_->cancelled_.erase({group_, round_});
    b_->active_.erase({group_, round_});
  }
  Group& group() const { return *g_; }

 private:
  GroupLease(CudaBackend* b, const TransferJob& job, std::unique_ptr<Group> g)
      : b_(b), group_(job.group), round_(job.round_id), g_(std::move(g)) {}
  CudaBackend* b_;
  std::string group_;
  int64_t round_;
  std::unique_ptr<Group> g_;
};

CudaBackend::~CudaBackend() {
  {
    absl::MutexLock lock(&armed_mu_);
    stopping_ = true;
    for (auto& [group, a] : armed_)
      a->CallOff();  // before the groups' fences wait for their streams
    armed_changed_.SignalAll();
    arm_queued_.SignalAll();
  }
  // The armer first: the jobs it drops may hold the last references to workers' memory, whose
  // release calls back into this backend (ArmsHeldOff, Forget).
  if (armer_.joinable()) armer_.join();
  if (disarmer_.joinable()) disarmer_.join();
}

absl::StatusOr<std::string> CudaBackend::NewCommunicatorId() {
  ncclUniqueId id;
  if (auto s = NcclError(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

void CudaBackend::DropCommunicator(const std::string& group, Group& g) {
  if (g.comm == nullptr) return;
  ArmsHeldOff off(this);
  const absl::Time t0 = absl::Now();
  g.comm->Abort();
  ++comms_aborted_;
  Logger("data")->warn(
      "group \"{}\": NCCL communicator aborted in {:.0f} ms; the next round builds a new one",
      group, absl::ToDoubleMilliseconds(absl::Now() - t0));
  g.comm.reset();
}

absl::Status CudaBackend::CommunicatorFor(Group& g, const TransferJob& job) {
  if (g.comm != nullptr && g.comm->id() == job.collective.nccl_id && g.comm->ready())
    return absl::OkStatus();
  if (g.comm != nullptr) {  // of an earlier membership
    g.comm->Abort();
    ++comms_aborted_;
  }
  g.comm.reset();
  std::vector<std::pair<int32_t, int>> local;
  for (size_t r = 0; r < job.plan->gpus.size(); ++r) {
    const PlanGpu& p = job.plan->gpus[r];
    if (p.node == job.node) local.push_back({p.gpu, static_cast<int>(r)});
  }
  const int nranks = static_cast<int>(job.plan->gpus.size());
  auto c = NodeCommunicator::Start(job.collective.nccl_id, nranks, local);
  if (!c.ok()) return c.status();  // the ranks begun are aborted with it
  g.comm = *std::move(c);
  if (auto s = g.comm->WaitReady(
          [&] { return Interrupted(job); },
          absl::StrCat("round ", job.round_id, ": NCCL communicator of ", nranks, " ranks"));
      !s.ok()) {
    DropCommunicator(job.group, g);
    return s;
  }
  ++comms_built_;
  return absl::OkStatus();
}

void CudaBackend::Forget(const std::string& handle, uint64_t base) {
  absl::MutexLock lock(&mu_);
  ++released_;
  // Only entries that died: the same handle may have been opened again meanwhile (the driver
  // counts opens in one context, so a new import of it has the same base).
  if (auto it = opened_.find(handle); it != opened_.end() && it->second.expired())
    opened_.erase(it);
  if (auto it = by_base_.find(base); it != by_base_.end() && it->second.expired())
    by_base_.erase(it);
}

namespace {
class DeviceScratch : public MappedBuffer {
 public:
  // `release` takes the memory out of the backend's tables and frees it (arming held off).
  DeviceScratch(DeviceMemory memory, std::function<void(DeviceMemory&)> release)
      : memory_(std::move(memory)), release_(std::move(release)) {}
  ~DeviceScratch() override { release_(memory_); }
  std::span<std::byte> bytes() const override {
    return {static_cast<std::byte*>(memory_.get()), memory_.size()};
  }

 private:
  DeviceMemory memory_;
  std::function<void(DeviceMemory&)> release_;
};
}  // namespace

absl::StatusOr<std::unique_ptr<MappedBuffer>> CudaBackend::AllocateScratch(const Worker& worker,
                                                                           int64_t bytes) {
  if (!Serves(worker.gpu)) {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU ", worker.gpu, " of worker \"", worker.name, "\" is not served here"));
  }
  auto memory =
      DeviceMemory::Allocate(worker.gpu, static_cast<size_t>(std::max<int64_t>(bytes, 1)));
  if (!memory.ok()) return memory.status();
  const uint64_t base = reinterpret_cast<uint64_t>(memory->get());
  {
    absl::MutexLock lock(&mu_);
    scratch_by_base_[base] = {static_cast<uint64_t>(memory->size()), worker.gpu};
  }
  return std::make_unique<DeviceScratch>(*std::move(memory), [this, base](DeviceMemory& m) {
    ArmsHeldOff off(this);
    ForgetScratch(base);  // out of the tables before the memory goes
    m = DeviceMemory();
  });
}

void CudaBackend::ForgetScratch(uint64_t base) {
  absl::MutexLock lock(&mu_);
  ++released_;
  scratch_by_base_.erase(base);
}

void CudaBackend::ForgetVmm(uint64_t base) {
  absl::MutexLock lock(&mu_);
  ++released_;
  vmm_by_base_.erase(base);
}

absl::StatusOr<uint64_t> CudaBackend::AddressOn(int32_t gpu, uint64_t address) {
  if (address == 0) return address;
  std::shared_ptr<Allocation> a;  // outlives the lock: its deleter takes mu_
  uint64_t base = 0;
  {
    absl::MutexLock lock(&mu_);
    if (auto v = vmm_by_base_.upper_bound(address); v != vmm_by_base_.begin()) {
      --v;
      if (address < v->first + v->second) return address;  // mapped at this address for every GPU
    }
    if (auto v = scratch_by_base_.upper_bound(address); v != scratch_by_base_.begin()) {
      --v;
      if (address < v->first + v->second.first) return v->second.second == gpu ? address : 0;
    }
    auto it = by_base_.upper_bound(address);
    if (it != by_base_.begin()) {
      --it;
      base = it->first;
      a = it->second.lock();
    }
  }
  if (a == nullptr || address >= base + static_cast<uint64_t>(a->size)) {
    return absl::InternalError("address outside every mapped allocation");
  }
  if (a->device == gpu) return address;
  {
    absl::MutexLock lock(&a->mu);
    if (auto it = a->on_device.find(gpu); it != a->on_device.end()) {
      return reinterpret_cast<uint64_t>(it->second.get()) + (address - base);
    }
  }
  // Opened outside the lock; should another thread have opened it meanwhile, its import is kept
  // and this one closed (outside the lock too).
  auto opened = IpcImport::Open(gpu, a->handle,
                                absl::StrCat("opening GPU ", a->device, "'s buffer on GPU ", gpu));
  if (!opened.ok()) return opened.status();
  IpcImport spare;
  uint64_t at = 0;
  {
    absl::MutexLock lock(&a->mu);
    auto [it, inserted] = a->on_device.try_emplace(gpu);
    if (inserted)
      it->second = *std::move(opened);
    else
      spare = *std::move(opened);
    at = reinterpret_cast<uint64_t>(it->second.get());
  }
  return at + (address - base);
}

namespace {

class IpcBuffer : public MappedBuffer {
 public:
  IpcBuffer(std::shared_ptr<CudaBackend::Allocation> a, int64_t offset, int64_t bytes)
      : a_(std::move(a)), offset_(offset), bytes_(bytes) {}
  // Device memory: the span carries the address and size; it is never dereferenced on the host.
  std::span<std::byte> bytes() const override {
    return {static_cast<std::byte*>(a_->base()) + offset_, static_cast<size_t>(bytes_)};
  }

 private:
  std::shared_ptr<CudaBackend::Allocation> a_;
  int64_t offset_, bytes_;
};

class VmmBuffer : public MappedBuffer {
 public:
  VmmBuffer(std::shared_ptr<CudaBackend::VmmMapping> m, int64_t offset, int64_t bytes)
      : m_(std::move(m)), offset_(offset), bytes_(bytes) {}
  std::span<std::byte> bytes() const override {
    return {reinterpret_cast<std::byte*>(m_->base()) + offset_, static_cast<size_t>(bytes_)};
  }

 private:
  std::shared_ptr<CudaBackend::VmmMapping> m_;  // shared by every buffer of the range
  int64_t offset_, bytes_;
};

}  // namespace

namespace {

// Whether MPS shares every one of `gpus` (then rounds are armed under --arm-rounds=auto).
bool MpsSharesAll(const std::vector<int32_t>& gpus, int count) {
  bool mps = true;
  for (int32_t g : gpus) {
    int shared = 0;
    if (g < 0 || g >= count ||
        cudaDeviceGetAttribute(&shared, cudaDevAttrMpsEnabled, g) != cudaSuccess)
      shared = 0;
    mps = mps && shared != 0;
  }
  cudaGetLastError();
  return mps;
}

// GPU `g` (current) reaches every other of `gpus` directly.
absl::Status EnablePeerAccess(int32_t g, const std::vector<int32_t>& gpus) {
  for (int32_t peer : gpus) {
    if (peer == g) continue;
    int can = 0;
    cudaDeviceCanAccessPeer(&can, g, peer);
    if (!can)
      return absl::FailedPreconditionError(
          absl::StrCat("GPU ", g, " cannot access GPU ", peer, " (no peer access)"));
    const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
    if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
      return CudaError(e, "enabling peer access");
    cudaGetLastError();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Start(const std::vector<int32_t>& gpus,
                                                                int64_t staging_bytes,
                                                                bool nccl_stream_priority,
                                                                bool aligned_copy_kernel,
                                                                ArmRounds arm_rounds) {
  int count = 0;
  REFIT_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "no usable GPU for --backend=cuda");
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->gpus_ = gpus;
  b->staging_bytes_ = staging_bytes;
  b->nccl_stream_priority_ = nccl_stream_priority;
  b->aligned_copy_kernel_ = aligned_copy_kernel;
  if (b->gpus_.empty()) {
    for (int i = 0; i < count; ++i) b->gpus_.push_back(i);
  }
  const bool mps = MpsSharesAll(b->gpus_, count);
  b->arm_rounds_ = arm_rounds == ArmRounds::kAlways || (arm_rounds == ArmRounds::kAuto && mps);
  if (b->arm_rounds_) {
    b->disarmer_ = std::thread([p = b.get()] { p->DisarmLoop(); });
    b->armer_ = std::thread([p = b.get()] { p->ArmLoop(); });
  }
  Logger("data")->info(
      "cuda: rounds copied within the node {} (--arm-rounds; MPS {})",
      b->arm_rounds_ ? "armed at PREPARE, let go at TRANSFER" : "launched at TRANSFER",
      mps ? "shares these GPUs" : "off");
  DeviceGuard guard;
  for (int32_t g : b->gpus_) {
    if (g < 0 || g >= count)
      return absl::InvalidArgumentError(
          absl::StrCat("--gpus names GPU ", g, "; this node has ", count));
    REFIT_RETURN_IF_ERROR(Annotate(guard.Set(g), absl::StrCat("GPU ", g)));
    REFIT_RETURN_IF_ERROR(b->SetUpGpu(g));
    REFIT_RETURN_IF_ERROR(EnablePeerAccess(g, b->gpus_));
  }
  std::vector<std::string> names;
  for (const GpuName& n : b->names_)
    names.push_back(absl::StrCat(n.index, ": ", n.uuid, " (", n.pci_bus_id, ")"));
  Logger("data")->info("cuda backend on GPUs {}", absl::StrJoin(names, ", "));
  if (auto driver = CudaDriver::Get(); !driver.ok()) {
    // IPC memory still works; VMM registrations will be refused with this reason.
    Logger("data")->warn("CUDA VMM memory cannot be registered here: {}",
                         std::string(driver.status().message()));
  }
  return b;
}

absl::Status CudaBackend::SetUpGpu(int32_t g) {
  // Its names, for workers that name their GPU (their CUDA index is not this daemon's).
  cudaDeviceProp prop;
  REFIT_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, g),
                             absl::StrCat("the properties of GPU ", g));
  char pci[64] = {};
  REFIT_CUDA_RETURN_IF_ERROR(cudaDeviceGetPCIBusId(pci, sizeof pci, g),
                             absl::StrCat("the PCI bus id of GPU ", g));
  names_.push_back({g,
                    FormatGpuUuid(std::span<const unsigned char, 16>(
                        reinterpret_cast<const unsigned char*>(prop.uuid.bytes), 16)),
                    pci});
  int least = 0, greatest = 0;
  REFIT_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                             "stream priorities");
  // Loaded now: CUDA loads a kernel at its first launch, which may wait for the GPU's other
  // work (armed rounds of other groups included), and WorkersPrepared and ArmAhead launch them
  // holding the group. Not fatal: loaded at first use then.
  if (const cudaError_t e = LoadKernels(); e != cudaSuccess) {
    Logger("data")->warn(
        "GPU {}: the copy kernels not loaded ahead ({}); they load at their first launch", g,
        cudaGetErrorString(e));
    cudaGetLastError();
  }
  priorities_[g] = {least, greatest};
  return absl::OkStatus();
}

absl::StatusOr<int32_t> CudaBackend::GpuIndex(const std::string& name) {
  return FindGpu(names_, name);
}

bool CudaBackend::Serves(int32_t gpu) const {
  return std::find(gpus_.begin(), gpus_.end(), gpu) != gpus_.end();
}

absl::StatusOr<std::unique_ptr<MappedBuffer>> CudaBackend::Map(const v1::BufferMemory& memory,
                                                               int64_t bytes) {
  if (!memory.has_cuda_ipc()) {
    return absl::InvalidArgumentError(
        "the cuda backend reaches buffers through CUDA IPC handles (BufferMemory.cuda_ipc); this "
        "buffer has none (a host shared-memory buffer needs --backend=host)");
  }
  const v1::CudaIpc& ipc = memory.cuda_ipc();
  if (ipc.handle().size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a CUDA IPC handle has ", sizeof(cudaIpcMemHandle_t), " bytes, not ", ipc.handle().size()));
  }
  int32_t device = ipc.device();
  if (!ipc.gpu_uuid().empty()) {
    auto found = GpuIndex(ipc.gpu_uuid());
    if (!found.ok()) return found.status();
    device = *found;
  }
  if (!Serves(device)) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer on GPU ", device, ", which this daemon does not serve"));
  }
  if (ipc.offset() < 0 || bytes < 0 || ipc.offset() > ipc.size() - bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a buffer of ", bytes, " bytes at offset ",
                                                   ipc.offset(), " does not fit its allocation of ",
                                                   ipc.size(), " bytes"));
  }
  // Each allocation opened once, however many buffers it holds. Opened outside the lock: should
  // another registration of the same handle win the race, its import is used and this one closed.
  std::shared_ptr<Allocation> a;  // outlives the lock: its deleter takes mu_
  {
    absl::MutexLock lock(&mu_);
    if (auto it = opened_.find(ipc.handle()); it != opened_.end()) a = it->second.lock();
  }
  if (a != nullptr) return std::unique_ptr<MappedBuffer>(new IpcBuffer(a, ipc.offset(), bytes));
  auto home = IpcImport::Open(device, ipc.handle(),
                              "cudaIpcOpenMemHandle (is the worker alive, and on this node?)");
  if (!home.ok()) return home.status();
  if (ipc.size() % kIpcPageBytes != 0) {
    // Measured on an H200 (tests/bench/ipc_copy_bench, docs/BENCHMARKS.md): such an import is
    // mapped with small pages, and copy kernels walking it ran at 0.37 of the copy engine,
    // against 0.84 for the same allocation rounded up to 2 MiB.
    Logger("data")->warn(
        "a CUDA IPC allocation of {} bytes on GPU {} is not a whole number of 2 MiB: imported into "
        "this process it is mapped with small pages and refits through it run up to 3x slower; "
        "allocate multiples of 2 MiB (PyTorch's caching allocator does) or CUDA VMM memory",
        ipc.size(), device);
  }
  const uint64_t base = reinterpret_cast<uint64_t>(home->get());
  std::shared_ptr<Allocation> fresh(
      new Allocation(), [this, handle = ipc.handle(), base](Allocation* dead) {
        ArmsHeldOff off(this);
        Forget(handle, base);  // no new transfer finds it, then its imports close
        delete dead;
      });
  fresh->handle = ipc.handle();
  fresh->size = ipc.size();
  fresh->device = device;
  fresh->home = *std::move(home);
  {
    absl::MutexLock lock(&mu_);
    std::weak_ptr<Allocation>& slot = opened_[ipc.handle()];
    a = slot.lock();
    if (a == nullptr) {
      slot = fresh;
      by_base_[base] = fresh;
      a = fresh;
    }
  }
  return std::unique_ptr<MappedBuffer>(new IpcBuffer(a, ipc.offset(), bytes));
}

namespace {

// A VMM range's chunks imported on `device`, each checked to be a whole allocation on that GPU;
// and the largest granularity among them (the reservation's alignment).
struct ImportedChunks {
  std::vector<VmmHandle> handles;  // released on every way out; from cuMemMap on, the maps hold
  size_t alignment = 1;
};

absl::StatusOr<ImportedChunks> ImportVmmChunks(const CudaDriver& driver, int32_t device,
                                               const v1::VmmRange& range, std::span<const Fd> fds,
                                               const std::string& what) {
  ImportedChunks out;
  auto chunk_name = [&](int c) {
    return absl::StrCat(what, " chunk ", c, " (descriptor ", range.first_fd() + c, ")");
  };
  for (int c = 0; c < range.chunk_bytes_size(); ++c) {
    const Fd& fd = fds[static_cast<size_t>(range.first_fd() + c)];
    auto h = VmmHandle::Import(
        driver, device, fd.get(),
        absl::StrCat(chunk_name(c),
                     ": cuMemImportFromShareableHandle (is it a CUDA allocation exported with "
                     "cuMemExportToShareableHandle as a POSIX file descriptor, on this node?)"));
    if (!h.ok()) return h.status();
    out.handles.push_back(*std::move(h));
    CUmemAllocationProp prop{};
    REFIT_RETURN_IF_ERROR(
        driver.Check(driver.MemGetAllocationPropertiesFromHandle(&prop, out.handles.back().get()),
                     absl::StrCat(chunk_name(c), ": cuMemGetAllocationPropertiesFromHandle")));
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device) {
      return absl::InvalidArgumentError(
          absl::StrCat(chunk_name(c), " lives ",
                       prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE
                           ? absl::StrCat("on GPU ", prop.location.id)
                           : std::string("off the GPUs (host or another location)"),
                       ", not on GPU ", device, " (the range's gpu_uuid, else the worker's GPU)"));
    }
    size_t granularity = 0;
    REFIT_RETURN_IF_ERROR(driver.Check(
        driver.MemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        absl::StrCat(chunk_name(c), ": cuMemGetAllocationGranularity")));
    if (granularity == 0 || range.chunk_bytes(c) % static_cast<int64_t>(granularity) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(chunk_name(c), ": ", range.chunk_bytes(c),
                       " bytes, not a multiple of the allocation granularity (", granularity,
                       " bytes): not a whole allocation"));
    }
    out.alignment = std::max(out.alignment, granularity);
  }
  return out;
}

}  // namespace

absl::StatusOr<int32_t> CudaBackend::VmmRangeDevice(const v1::RegisterWorkerRequest& request,
                                                    const v1::VmmRange& range,
                                                    const std::string& what) {
  int32_t device = request.worker().gpu();  // the worker's GPU (Register resolved its gpu_uuid)
  if (!range.gpu_uuid().empty()) {
    auto found = GpuIndex(range.gpu_uuid());
    if (!found.ok()) return Annotate(found.status(), what);
    device = *found;
  }
  if (!Serves(device)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is on GPU ", device, ", which this daemon does not serve"));
  }
  return device;
}

absl::StatusOr<std::unique_ptr<CudaBackend::VmmMapping>> CudaBackend::ReserveAndMap(
    const CudaDriver& driver, int32_t device, const v1::VmmRange& range,
    const std::vector<VmmHandle>& handles, size_t alignment, const std::string& what) const {
  const size_t total = static_cast<size_t>(VmmRangeBytes(range));
  auto mapping = std::make_unique<VmmMapping>();
  auto reserved =
      VmmReservation::Reserve(driver, device, total, alignment,
                              absl::StrCat(what, ": cuMemAddressReserve of ", total, " bytes"));
  if (!reserved.ok()) return reserved.status();
  mapping->reserved = *std::move(reserved);
  size_t offset = 0;
  for (int c = 0; c < range.chunk_bytes_size(); ++c) {
    const size_t bytes = static_cast<size_t>(range.chunk_bytes(c));
    auto mapped = VmmMap::Map(
        driver, device, mapping->base() + offset, bytes, handles[c],
        absl::StrCat(what, " chunk ", c, " (descriptor ", range.first_fd() + c, "): cuMemMap of ",
                     bytes, " bytes (is the allocation that large?)"));
    if (!mapped.ok()) return mapped.status();
    mapping->mapped.push_back(*std::move(mapped));
    offset += bytes;
  }
  // Every GPU this daemon serves reads and writes the range (peers copy into it directly).
  std::vector<CUmemAccessDesc> access;
  for (int32_t g : gpus_) {
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = g;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access.push_back(a);
  }
  REFIT_RETURN_IF_ERROR(
      driver.Check(driver.MemSetAccess(mapping->base(), total, access.data(), access.size()),
                   absl::StrCat(what, ": cuMemSetAccess (read and write for GPUs ",
                                absl::StrJoin(gpus_, ", "), ")")));
  return mapping;
}

absl::StatusOr<std::shared_ptr<CudaBackend::VmmMapping>> CudaBackend::MapVmmRange(
    const v1::RegisterWorkerRequest& request, int r, std::span<const Fd> fds) {
  const v1::VmmRange& range = request.vmm_ranges(r);
  const std::string what = absl::StrCat("VMM range ", r);
  auto driver_or = CudaDriver::Get();
  if (!driver_or.ok()) return Annotate(driver_or.status(), what);
  const CudaDriver& driver = **driver_or;
  auto device = VmmRangeDevice(request, range, what);
  if (!device.ok()) return device.status();
  // Driver calls act on the current context: make GPU `device`'s primary context current.
  DeviceGuard guard(*device);
  REFIT_RETURN_IF_ERROR(Annotate(guard.status(), what));
  REFIT_CUDA_RETURN_IF_ERROR(cudaFree(nullptr),
                             absl::StrCat(what, ": the primary context of GPU ", *device));
  // Declared before the mapping: the imported handles are released after it is made or abandoned.
  auto imported = ImportVmmChunks(driver, *device, range, fds, what);
  if (!imported.ok()) return imported.status();
  auto mapping =
      ReserveAndMap(driver, *device, range, imported->handles, imported->alignment, what);
  if (!mapping.ok()) return mapping.status();
  const uint64_t base = static_cast<uint64_t>((*mapping)->base());
  const size_t total = static_cast<size_t>(VmmRangeBytes(range));
  std::shared_ptr<VmmMapping> m(mapping->release(), [this, base](VmmMapping* dead) {
    ArmsHeldOff off(this);
    ForgetVmm(base);  // no new kernel is given these addresses, then unmapped and freed
    delete dead;
  });
  absl::MutexLock lock(&mu_);
  vmm_by_base_[base] = total;
  return m;
}

absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> CudaBackend::MapBuffers(
    const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes,
    std::span<const Fd> fds) {
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
      out.push_back(std::unique_ptr<MappedBuffer>(
          new VmmBuffer(range, m.cuda_vmm().offset(), buffer_bytes[b])));
      continue;
    }
    if (m.has_shm()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what,
                       ": host shared memory needs --backend host; this daemon runs --backend cuda "
                       "(CUDA IPC or VMM)"));
    }
    auto mapped = Map(m, buffer_bytes[b]);
    if (!mapped.ok()) return Annotate(mapped.status(), what);
    out.push_back(*std::move(mapped));
  }
  return out;
}

absl::Status CudaBackend::EnsureStreams(Group& g) {
  for (int32_t gpu : gpus_) {
    if (g.streams.contains(gpu)) continue;
    const auto [least, greatest] = priorities_.at(gpu);
    Group::Streams s;
    for (auto [stream, priority] : {std::pair{&s.compute, least},
                                    std::pair{&s.comm, nccl_stream_priority_ ? greatest : least},
                                    std::pair{&s.direct, least}}) {
      auto made = Stream::Create(gpu, priority);
      if (!made.ok()) return made.status();
      *stream = *std::move(made);
    }
    g.streams.emplace(gpu, std::move(s));
  }
  return absl::OkStatus();
}

namespace {

// A GPU's work lists, in upload order, each with the launch description UploadWork fills in.
using WorkList = std::vector<std::pair<const CopyWork*, CudaBackend::Prepared::DeviceWork*>>;
using WorkLists = std::map<int32_t, WorkList>;  // by GPU

// The GPU's event marking the round's first work on it, made once.
absl::Status EnsureStartEvent(CudaBackend::Prepared::OnGpu& on, int32_t gpu) {
  if (!on.start) {
    auto e = Event::Create(gpu);
    if (!e.ok()) return e.status();
    on.start = *std::move(e);
  }
  return absl::OkStatus();
}

// A GPU's copies inside the node in one stage: their work lists (`parts` keeps the halves of split
// work) and the event marking them done.
absl::Status ListDirectWork(CudaBackend::Prepared::OnGpu& on, int32_t gpu, int stage,
                            const CopyWork& w, bool aligned_copy_kernel, WorkList& list,
                            std::deque<CopyWork>& parts) {
  on.direct.resize(kMaxStages);
  // Mixed work in two launches: on one H200, a real 1 GB model's (Qwen2.5-0.5B) 0.555 -> 0.529
  // ms, 98,883 small tensors 2.063 -> 2.031 ms (local_copy_bench --split).
  CopyWork& aligned = parts.emplace_back();
  CopyWork& general = parts.emplace_back();
  if (aligned_copy_kernel && !AlignedOnly(w)) SplitAligned(w, aligned, general);
  // Spread is measured, and chosen, for direct work only (each launch by its own units).
  if (!aligned.items.empty() && !general.items.empty()) {
    on.direct[stage].resize(2);
    on.direct[stage][0].spread = SpreadPays(aligned);
    on.direct[stage][1].spread = SpreadPays(general);
    list.push_back({&aligned, &on.direct[stage][0]});
    list.push_back({&general, &on.direct[stage][1]});
  } else {
    on.direct[stage].resize(1);
    on.direct[stage][0].spread = SpreadPays(w);
    list.push_back({&w, &on.direct[stage][0]});
  }
  REFIT_RETURN_IF_ERROR(EnsureStartEvent(on, gpu));
  while (on.direct_done.size() <= static_cast<size_t>(stage)) {
    auto e = Event::Create(gpu);
    if (!e.ok()) return e.status();
    on.direct_done.push_back(*std::move(e));
  }
  return absl::OkStatus();
}

// A GPU's network steps in one stage: each step's pack and unpack work lists, and its events.
absl::Status ListStepWork(CudaBackend::Prepared::OnGpu& on, int32_t gpu, int stage,
                          const std::vector<NetworkStep>& steps, WorkList& list) {
  on.pack.resize(kMaxStages);
  on.unpack.resize(kMaxStages);
  for (auto* events : {&on.packed, &on.wire_begin, &on.moved, &on.unpacked}) {
    events->resize(kMaxStages);
  }
  REFIT_RETURN_IF_ERROR(EnsureStartEvent(on, gpu));
  on.pack[stage].resize(steps.size());
  on.unpack[stage].resize(steps.size());
  for (size_t k = 0; k < steps.size(); ++k) {
    list.push_back({&steps[k].pack, &on.pack[stage][k]});
    list.push_back({&steps[k].unpack, &on.unpack[stage][k]});
    for (auto* events :
         {&on.packed[stage], &on.wire_begin[stage], &on.moved[stage], &on.unpacked[stage]}) {
      auto e = Event::Create(gpu);
      if (!e.ok()) return e.status();
      events->push_back(*std::move(e));
    }
  }
  return absl::OkStatus();
}

// Every work list of the schedule, by GPU and in stage order, and the events that chain them.
absl::Status ListWork(CudaBackend::Prepared& p, bool aligned_copy_kernel, WorkLists& works,
                      std::deque<CopyWork>& parts) {
  for (int stage = 0; stage < kMaxStages; ++stage) {
    const StageSchedule& s = p.schedule.stages[stage];
    for (const auto& [gpu, w] : s.direct) {
      REFIT_RETURN_IF_ERROR(
          ListDirectWork(p.gpus[gpu], gpu, stage, w, aligned_copy_kernel, works[gpu], parts));
    }
    for (const auto& [gpu, steps] : s.steps) {
      REFIT_RETURN_IF_ERROR(ListStepWork(p.gpus[gpu], gpu, stage, steps, works[gpu]));
    }
  }
  return absl::OkStatus();
}

// Uploads every work list of each GPU into one device allocation, and points each launch
// description at its items and units there.
absl::Status UploadWork(CudaBackend::Prepared& p, bool aligned_copy_kernel, WorkLists& works) {
  DeviceGuard guard;
  for (auto& [gpu, list] : works) {
    std::vector<std::byte> host;
    struct At {
      size_t items = 0, units = 0;  // offsets
      int64_t total_units = 0;
      QuantizingUnits quantizing = QuantizingUnits::kNone;
    };
    std::vector<At> at;
    for (auto& [w, d] : list) {
      const size_t items = host.size();
      host.resize(items + w->items.size() * sizeof(CopyItem));
      std::memcpy(host.data() + items, w->items.data(), w->items.size() * sizeof(CopyItem));
      // With the quantizing kernel, none for the scales that twins write.
      const QuantizingUnits quantizing = QuantizingUnitsOf(*w);
      const std::vector<int64_t> begin =
          InQuantizingKernel(quantizing) ? QuantizingLaunchUnits(*w) : w->unit_begin;
      const size_t units = host.size();
      host.resize(units + begin.size() * sizeof(int64_t));
      std::memcpy(host.data() + units, begin.data(), begin.size() * sizeof(int64_t));
      host.resize((host.size() + 15) / 16 * 16);
      at.push_back({items, units, begin.empty() ? 0 : begin.back(), quantizing});
    }
    CudaBackend::Prepared::OnGpu& on = p.gpus[gpu];
    auto arrays = DeviceMemory::Allocate(gpu, std::max<size_t>(host.size(), 16));
    if (!arrays.ok()) return Annotate(arrays.status(), "copy items");
    on.arrays = *std::move(arrays);
    REFIT_RETURN_IF_ERROR(guard.Set(gpu));
    REFIT_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(on.arrays.get(), host.data(), host.size(), cudaMemcpyHostToDevice),
        "copy items");
    auto* base = static_cast<std::byte*>(on.arrays.get());
    for (size_t i = 0; i < list.size(); ++i) {
      auto& [w, d] = list[i];
      d->items = reinterpret_cast<const CopyItem*>(base + at[i].items);
      d->units = reinterpret_cast<const int64_t*>(base + at[i].units);
      d->n = static_cast<int>(w->items.size());
      d->total_units = at[i].total_units;
      // The aligned kernel where it applies (--aligned-copy-kernel=false: the general one always).
      d->aligned = aligned_copy_kernel && AlignedOnly(*w);
      d->quantizing = at[i].quantizing;
    }
  }
  return absl::OkStatus();
}

void LogPrepared(const TransferJob& job, const NodeSchedule& schedule) {
  std::string staging;
  for (const auto& [gpu, bytes] : schedule.region_bytes) {
    const auto depth = schedule.depth.find(gpu);  // none where the GPU's region is empty
    absl::StrAppend(&staging, staging.empty() ? "" : ", ", "GPU ", gpu, ": ",
                    schedule.StagingBytes(gpu), " bytes (",
                    depth == schedule.depth.end() ? 0 : depth->second, " steps in flight)");
  }
  Logger("data")->info(
      "group \"{}\" node {}: prepared; network {} bytes out, {} in ({} zero-copy) in {} "
      "operations; NVLink {} bytes; local {} bytes; staging {}{}",
      job.group, job.node, schedule.bytes_sent, schedule.bytes_received, schedule.bytes_zero_copy,
      schedule.network_ops, schedule.bytes_peer, schedule.bytes_local,
      staging.empty() ? "none" : staging,
      job.collective.nccl_register && !staging.empty() ? " (registered with NCCL)" : "");
}

}  // namespace

absl::StatusOr<CudaBackend::Prepared*> CudaBackend::PreparedFor(Group& g, const TransferJob& job,
                                                                const BufferAddresses& src,
                                                                const BufferAddresses& dst) {
  uint64_t released = 0;
  {
    absl::MutexLock lock(&mu_);
    released = released_;
  }
  // The same home addresses are not enough once memory was released: a new import may sit at an
  // old one's home address while the other GPUs' imports the schedule holds are gone.
  if (g.prepared != nullptr && g.prepared->plan == job.plan && g.prepared->src == src &&
      g.prepared->dst == dst && g.prepared->released == released) {
    return g.prepared.get();
  }
  DropPrepared(g);
  ++g.generation;  // a new schedule: whatever was armed on the old one is not this one's work
  auto p = std::make_unique<Prepared>();
  p->plan = job.plan;
  p->released = released;
  p->src = src;
  p->dst = dst;
  for (const auto& [gpu, streams] : g.streams) {
    for (const Stream* s : {&streams.compute, &streams.comm, &streams.direct}) p->idle.Add(*s);
  }
  REFIT_RETURN_IF_ERROR(BuildSchedule(*p, job, src, dst));
  WorkLists works;
  std::deque<CopyWork> parts;  // the halves of split direct work, until uploaded
  REFIT_RETURN_IF_ERROR(ListWork(*p, aligned_copy_kernel_, works, parts));
  REFIT_RETURN_IF_ERROR(UploadWork(*p, aligned_copy_kernel_, works));
  LogPrepared(job, p->schedule);
  g.prepared = std::move(p);
  return g.prepared.get();
}

absl::Status CudaBackend::BuildSchedule(Prepared& p, const TransferJob& job,
                                        const BufferAddresses& src, const BufferAddresses& dst) {
  ScheduleOptions options;
  options.node = job.node;
  options.staging_budget = staging_bytes_;
  options.step_bytes = job.collective.step_bytes;
  if (job.collective.zero_copy_min_bytes > 0)
    options.zero_copy_min_bytes = job.collective.zero_copy_min_bytes;
  auto schedule = BuildNodeSchedule(
      *job.plan, options,
      [&](int32_t gpu) -> absl::StatusOr<std::pair<BufferAddresses, BufferAddresses>> {
        if (!Serves(gpu)) {
          return absl::FailedPreconditionError(absl::StrCat("GPU ", gpu, " is not served here"));
        }
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
        Prepared::OnGpu& on = p.gpus[gpu];
        auto staging =
            StagingBuffer::Allocate(gpu, static_cast<size_t>(bytes), job.collective.nccl_register);
        if (!staging.ok()) return staging.status();
        on.staging = *std::move(staging);
        return reinterpret_cast<uint64_t>(on.staging.get());
      });
  if (!schedule.ok()) return schedule.status();
  p.schedule = *std::move(schedule);
  return absl::OkStatus();
}

void CudaBackend::DropPrepared(Group& g) {
  if (g.prepared == nullptr) return;
  ArmsHeldOff off(this);  // the fence below and the frees after it would wait for armed work
  std::unique_ptr<Prepared> old = std::move(g.prepared);
  old->idle.Wait();
  // NCCL must forget the staging before it is freed.
  if (g.comm != nullptr) {
    for (auto& [gpu, on] : old->gpus) {
      if (on.staging.nccl_memory()) g.comm->Deregister(on.staging.get());
    }
  }
}

absl::StatusOr<TransferStats> CudaBackend::Transfer(const TransferJob& job) {
  auto lease = GroupLease::Take(this, job);
  if (!lease.ok()) return lease.status();
  Group& g = lease->group();
  const absl::Time leased = absl::Now();
  // This round's work waits on the GPU since PREPARE (RoundPreparing, armed): let go first, so
  // that what follows (finding the schedule unchanged) runs while the GPU copies. Armed means
  // still valid: every change of memory or plan since the arming called it off. The caller holds
  // the workers' memory, and a failure below waits for the streams (DropPrepared) before the
  // lease ends. Rebuilt all the same (PreparedFor), it is launched again.
  absl::Time started = absl::Now();  // the data plane's start: let go, or the first launch
  uint32_t go = 0;
  bool fired = arm_rounds_ && Fire(job.group, job.round_id, &go);
  const uint64_t armed_with = g.generation;
  const BufferAddresses src = AddressesOf(job.src), dst = AddressesOf(job.dst);
  DeviceGuard
      guard;  // the caller's device again when done; declared after the lease: restored first
  // Whichever way the transfer fails: abort NCCL (its kernels may wait on a dead peer), let the
  // streams drain, and rebuild everything for the next round. Runs before the lease gives the
  // group back.
  bool ok = false;
  bool used_comm = false;
  absl::Cleanup on_failure = [&] {
    if (ok) return;
    if (used_comm) DropCommunicator(job.group, g);
    DropPrepared(g);
  };

  REFIT_RETURN_IF_ERROR(EnsureStreams(g));
  auto prepared = PreparedFor(g, job, src, dst);
  if (!prepared.ok()) return prepared.status();
  const Prepared& p = **prepared;
  // Rebuilt (a generation, not the address: a new Prepared may take the old one's): the old
  // schedule's fence waited for what was let go, and this round is launched below.
  if (fired && (g.generation != armed_with || ArmableStage(p.schedule) < 0)) fired = false;
  const NodeSchedule& schedule = p.schedule;
  NodeCommunicator* comm = nullptr;
  if (schedule.uses_network) {
    REFIT_RETURN_IF_ERROR(CommunicatorFor(g, job));
    comm = g.comm.get();
    used_comm = true;
    if (job.collective.nccl_register) REFIT_RETURN_IF_ERROR(RegisterStaging(job, p, *comm));
  }
  REFIT_ASSIGN_OR_RETURN(TransferStats stats,
                         RunPrepared(job, g, p, comm, fired, go, leased, started, guard));
  ok = true;
  return stats;
}

absl::StatusOr<TransferStats> CudaBackend::RunPrepared(const TransferJob& job, const Group& g,
                                                       const Prepared& p, NodeCommunicator* comm,
                                                       bool fired, uint32_t go, absl::Time leased,
                                                       absl::Time started, DeviceGuard& guard) {
  const NodeSchedule& schedule = p.schedule;
  if (auto s = Interrupted(job); !s.ok()) {
    CallOff(job.group, job.round_id);
    return s;
  }
  if (!fired) started = absl::Now();
  absl::Time launched = started;  // the last stage's launches done
  // Not let go at the start: every armed round is called off first (this group's, of a round that
  // never transferred, and other groups', whose waits could hold up launches queued behind them).
  if (fired) {
    REFIT_ASSIGN_OR_RETURN(fired, ArmedWorkRan(job, g, p, go));
  } else {
    DisarmAll();
  }
  // A second arm of this round still queued (a PREPARE of the same id again) arms nothing now.
  if (arm_rounds_) CallOff(job.group, job.round_id);
  if (!fired) REFIT_RETURN_IF_ERROR(RecordStarts(g, p, guard));
  for (int stage = 0; stage < kMaxStages; ++stage) {
    const StageSchedule& s = schedule.stages[stage];
    if (fired || (s.direct.empty() && s.steps.empty())) continue;
    REFIT_ASSIGN_OR_RETURN(const std::set<int32_t> busy,
                           LaunchStage(job, g, p, stage, comm, guard));
    launched = absl::Now();
    REFIT_RETURN_IF_ERROR(WaitForStage(job, g, busy, stage, comm));
  }
  const absl::Time done = absl::Now();
  TransferStats stats;
  stats.bytes_sent = schedule.bytes_sent;
  stats.bytes_received = schedule.bytes_received + schedule.bytes_peer;
  stats.bytes_local = schedule.bytes_local;
  stats.bytes_nvlink = schedule.bytes_peer;
  LogRound(job, p, {leased, started, launched, done, fired}, &stats);
  if (schedule.uses_network) LogNetworkTimeline(job, p);
  return stats;
}

absl::Status CudaBackend::RegisterStaging(const TransferJob& job, const Prepared& p,
                                          NodeCommunicator& comm) {
  for (const auto& [gpu, on] : p.gpus) {
    if (on.staging.nccl_memory()) {
      REFIT_RETURN_IF_ERROR(comm.Register(gpu, on.staging.get(), on.staging.size()));
    }
  }
  return comm.Wait([&] { return Interrupted(job); }, "registering staging with NCCL");
}

absl::StatusOr<bool> CudaBackend::ArmedWorkRan(const TransferJob& job, const Group& g,
                                               const Prepared& p, uint32_t go) {
  const NodeSchedule& schedule = p.schedule;
  const int stage = ArmableStage(schedule);
  std::set<int32_t> busy;
  for (const auto& [gpu, w] : schedule.stages[stage].direct) busy.insert(gpu);
  REFIT_RETURN_IF_ERROR(WaitForStage(job, g, busy, stage, nullptr));
  // What each GPU's gate decided: go, or the work did nothing (it read an older word): then the
  // round is launched as usual, never reported done without its bytes.
  std::string missed = GatesMissed(job.group, busy, go);
  if (!missed.empty()) {
    Logger("data")->warn(
        "group \"{}\" round {}: the work armed at PREPARE did not run on GPU {}; launched again",
        job.group, job.round_id, missed);
    return false;
  }
  return true;
}

absl::Status CudaBackend::RecordStarts(const Group& g, const Prepared& p, DeviceGuard& guard) {
  for (const auto& [gpu, on] : p.gpus) {
    if (!on.start) continue;
    REFIT_RETURN_IF_ERROR(guard.Set(gpu));
    REFIT_CUDA_RETURN_IF_ERROR(cudaEventRecord(on.start.get(), g.streams.at(gpu).compute.get()),
                               "cudaEventRecord");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::set<int32_t>> CudaBackend::LaunchStage(const TransferJob& job, const Group& g,
                                                           const Prepared& p, int stage,
                                                           NodeCommunicator* comm,
                                                           DeviceGuard& guard) {
  std::set<int32_t> busy;
  // Pack the first steps ahead, then copy inside the node on a stream of its own.
  REFIT_RETURN_IF_ERROR(PackFirstSteps(g, p, stage, guard, busy));
  REFIT_RETURN_IF_ERROR(LaunchDirectCopies(g, p, stage, guard, busy));
  for (int32_t k = 0; k < p.schedule.stages[stage].num_steps; ++k) {
    REFIT_RETURN_IF_ERROR(RunNetworkStep(job, g, p, stage, k, comm, guard));
  }
  return busy;
}

absl::Status CudaBackend::PackFirstSteps(const Group& g, const Prepared& p, int stage,
                                         DeviceGuard& guard, std::set<int32_t>& busy) {
  const NodeSchedule& schedule = p.schedule;
  const StageSchedule& s = schedule.stages[stage];
  for (const auto& [gpu, steps] : s.steps) {
    const Prepared::OnGpu& on = p.gpus.at(gpu);
    const cudaStream_t compute = g.streams.at(gpu).compute.get();
    const int32_t depth = std::max(1, schedule.depth.count(gpu) ? schedule.depth.at(gpu) : 1);
    for (int32_t k = 0; k < depth && k < static_cast<int32_t>(steps.size()); ++k) {
      const auto& w = on.pack[stage][k];
      REFIT_RETURN_IF_ERROR(guard.Set(gpu));
      REFIT_CUDA_RETURN_IF_ERROR(LaunchCopyItems(w.items, w.units, w.n, w.total_units, compute,
                                                 false, w.aligned, nullptr, 0, w.quantizing),
                                 "pack");
      REFIT_CUDA_RETURN_IF_ERROR(cudaEventRecord(on.packed[stage][k].get(), compute),
                                 "cudaEventRecord");
    }
    busy.insert(gpu);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LaunchDirectCopies(const Group& g, const Prepared& p, int stage,
                                             DeviceGuard& guard, std::set<int32_t>& busy) {
  const StageSchedule& s = p.schedule.stages[stage];
  for (const auto& [gpu, w] : s.direct) {
    REFIT_RETURN_IF_ERROR(guard.Set(gpu));
    for (const auto& d : p.gpus.at(gpu).direct[stage]) {
      REFIT_CUDA_RETURN_IF_ERROR(
          LaunchCopyItems(d.items, d.units, d.n, d.total_units, g.streams.at(gpu).direct.get(),
                          d.spread, d.aligned, nullptr, 0, d.quantizing),
          "copy");
    }
    REFIT_CUDA_RETURN_IF_ERROR(
        cudaEventRecord(p.gpus.at(gpu).direct_done[stage].get(), g.streams.at(gpu).direct.get()),
        "cudaEventRecord");
    busy.insert(gpu);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::RunNetworkStep(const TransferJob& job, const Group& g, const Prepared& p,
                                         int stage, int32_t k, NodeCommunicator* comm,
                                         DeviceGuard& guard) {
  // Step k: its sends wait for their pack; one NCCL group for every local GPU's operations;
  // the unpack of step k and the pack of step k + depth (into the slots step k freed) follow.
  const StageSchedule& s = p.schedule.stages[stage];
  for (const auto& [gpu, steps] : s.steps) {
    if (k >= static_cast<int32_t>(steps.size())) continue;
    const Prepared::OnGpu& on = p.gpus.at(gpu);
    const cudaStream_t comm_stream = g.streams.at(gpu).comm.get();
    REFIT_RETURN_IF_ERROR(guard.Set(gpu));
    REFIT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(comm_stream, on.packed[stage][k].get(), 0),
                               "ordering a step's sends after its pack");
    REFIT_CUDA_RETURN_IF_ERROR(cudaEventRecord(on.wire_begin[stage][k].get(), comm_stream),
                               "cudaEventRecord");
  }
  REFIT_RETURN_IF_ERROR(PostNetworkOps(g, p, stage, k, comm, guard));
  REFIT_RETURN_IF_ERROR(
      comm->Wait([&] { return Interrupted(job); },
                 absl::StrCat("round ", job.round_id, " stage ", stage, " step ", k)));
  return UnpackAndPackNext(g, p, stage, k, guard);
}

absl::Status CudaBackend::PostNetworkOps(const Group& g, const Prepared& p, int stage, int32_t k,
                                         NodeCommunicator* comm, DeviceGuard& guard) {
  const StageSchedule& s = p.schedule.stages[stage];
  REFIT_RETURN_IF_ERROR(NcclError(ncclGroupStart(), "ncclGroupStart"));
  for (const auto& [gpu, steps] : s.steps) {
    if (k >= static_cast<int32_t>(steps.size())) continue;
    const cudaStream_t comm_stream = g.streams.at(gpu).comm.get();
    if (auto st = guard.Set(gpu); !st.ok()) {
      ncclGroupEnd();
      return st;
    }
    for (const NetworkOp& op : steps[k].ops) {
      auto* buffer = reinterpret_cast<void*>(op.buffer);
      const ncclResult_t r = op.send ? ncclSend(buffer, static_cast<size_t>(op.bytes), ncclUint8,
                                                op.peer, comm->on(gpu), comm_stream)
                                     : ncclRecv(buffer, static_cast<size_t>(op.bytes), ncclUint8,
                                                op.peer, comm->on(gpu), comm_stream);
      if (r != ncclSuccess && r != ncclInProgress) {
        ncclGroupEnd();
        return NcclError(r, op.send ? "ncclSend" : "ncclRecv");
      }
    }
  }
  return NcclError(ncclGroupEnd(), "ncclGroupEnd");
}

absl::Status CudaBackend::UnpackAndPackNext(const Group& g, const Prepared& p, int stage, int32_t k,
                                            DeviceGuard& guard) {
  const NodeSchedule& schedule = p.schedule;
  const StageSchedule& s = schedule.stages[stage];
  for (const auto& [gpu, steps] : s.steps) {
    if (k >= static_cast<int32_t>(steps.size())) continue;
    const Prepared::OnGpu& on = p.gpus.at(gpu);
    const Group::Streams& st = g.streams.at(gpu);
    const cudaStream_t compute = st.compute.get();
    REFIT_RETURN_IF_ERROR(guard.Set(gpu));
    REFIT_CUDA_RETURN_IF_ERROR(cudaEventRecord(on.moved[stage][k].get(), st.comm.get()),
                               "cudaEventRecord");
    REFIT_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(compute, on.moved[stage][k].get(), 0),
                               "cudaStreamWaitEvent");
    const auto& u = on.unpack[stage][k];
    REFIT_CUDA_RETURN_IF_ERROR(LaunchCopyItems(u.items, u.units, u.n, u.total_units, compute, false,
                                               u.aligned, nullptr, 0, u.quantizing),
                               "unpack");
    REFIT_CUDA_RETURN_IF_ERROR(cudaEventRecord(on.unpacked[stage][k].get(), compute),
                               "cudaEventRecord");
    const int32_t next = k + std::max(1, schedule.depth.count(gpu) ? schedule.depth.at(gpu) : 1);
    if (next < static_cast<int32_t>(steps.size())) {
      const auto& w = on.pack[stage][next];
      REFIT_CUDA_RETURN_IF_ERROR(LaunchCopyItems(w.items, w.units, w.n, w.total_units, compute,
                                                 false, w.aligned, nullptr, 0, w.quantizing),
                                 "pack");
      REFIT_CUDA_RETURN_IF_ERROR(cudaEventRecord(on.packed[stage][next].get(), compute),
                                 "cudaEventRecord");
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::WaitForStage(const TransferJob& job, const Group& g,
                                       const std::set<int32_t>& busy, int stage,
                                       NodeCommunicator* comm) {
  // Polls rather than blocking in the driver: a deadline, a Cancel and an NCCL error (a dead peer
  // on the socket transport) must be able to end the wait. The first kSpin without sleeping: a
  // colocated refit's copies end within a millisecond or two, and one sleep's wake-up (60-80 us
  // under the kernel's default 50 us timer slack) was a tenth of a 1 GB refit's transfer phase.
  // Then every kPoll, with this thread's timer slack at 1 us so the sleep is what it says.
  constexpr absl::Duration kSpin = absl::Milliseconds(2), kPoll = absl::Microseconds(20);
  static thread_local bool precise_sleep = prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0;
  (void)precise_sleep;
  const absl::Time spin_until = absl::Now() + kSpin;
  for (int32_t gpu : busy) {
    const Group::Streams& st = g.streams.at(gpu);
    for (const Stream* stream : {&st.direct, &st.comm, &st.compute}) {
      while (true) {
        const cudaError_t q = cudaStreamQuery(stream->get());
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady)
          return CudaError(q, absl::StrCat("round ", job.round_id, " on GPU ", gpu));
        if (comm != nullptr)
          REFIT_RETURN_IF_ERROR(
              comm->Errors(absl::StrCat("round ", job.round_id, " stage ", stage)));
        if (auto s = Interrupted(job); !s.ok()) {
          return absl::Status(
              s.code(),
              absl::StrCat("round ", job.round_id, ": GPU ", gpu, " did not finish stage ", stage,
                           comm != nullptr ? " (NCCL aborted)" : "", ": ", s.message()));
        }
        if (absl::Now() > spin_until) absl::SleepFor(kPoll);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Interrupted(const TransferJob& job) {
  {
    absl::MutexLock lock(&mu_);
    auto c = cancelled_.find({job.group, job.round_id});
    if (c != cancelled_.end()) return absl::AbortedError(c->second);
  }
  if (absl::Now() > job.deadline)
    return absl::DeadlineExceededError("the transfer deadline passed");
  return absl::OkStatus();
}

void CudaBackend::Cancel(const std::string& group, int64_t round_id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  // The first reason stays (try_emplace): the node names the first worker lost as the culprit.
  if (active_.contains({group, round_id})) cancelled_.try_emplace({group, round_id}, reason);
  // Armed for it and not let go: its work, launched ahead, is called off.
  CallOff(group, round_id);
}

}  // namespace refit
