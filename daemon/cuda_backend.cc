#include "daemon/cuda_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/strings/str_cat.h"
#include "daemon/logging.h"
#include "kernels/copy_kernels.h"

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

// Copies a work list's items to GPU `gpu` (the allocation is appended to `arrays`, for the caller
// to free once the stream is done) and launches the copy kernel on `stream`, all in stream order:
// nothing here blocks on earlier work (an NCCL receive from a dead peer must not hang us). The
// caller keeps `w` alive until the stream is done.
absl::Status Launch(int32_t gpu, cudaStream_t stream, const CopyWork& w,
                    std::vector<std::pair<int32_t, void*>>& arrays, const char* what) {
  const size_t item_bytes = w.items.size() * sizeof(CopyItem);
  const size_t begin_bytes = w.unit_begin.size() * sizeof(int64_t);
  void* device = nullptr;
  CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
  CUDA_RETURN_IF_ERROR(cudaMalloc(&device, item_bytes + begin_bytes), "cudaMalloc");
  arrays.push_back({gpu, device});
  char* units = static_cast<char*>(device) + item_bytes;
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(device, w.items.data(), item_bytes, cudaMemcpyHostToDevice, stream), what);
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(units, w.unit_begin.data(), begin_bytes, cudaMemcpyHostToDevice, stream), what);
  return CudaError(LaunchCopyItems(static_cast<const CopyItem*>(device), reinterpret_cast<const int64_t*>(units),
                                   static_cast<int>(w.items.size()), w.unit_begin.back(), stream),
                   what);
}

absl::Status NcclError(ncclResult_t r, const std::string& what) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

}  // namespace

struct CudaBackend::Communicator {
  std::string id;
  std::map<int32_t, ncclComm_t> by_gpu;  // local GPU -> its rank's communicator
  bool ready = false;
  void Abort() {
    for (auto& [g, c] : by_gpu) {
      cudaSetDevice(g);
      ncclCommAbort(c);
    }
    by_gpu.clear();
  }
  ~Communicator() {
    for (auto& [g, c] : by_gpu) {
      cudaSetDevice(g);
      ncclCommDestroy(c);
    }
  }
  // Polls every rank until none is in progress; errors (a dead peer) and the deadline fail.
  absl::Status Wait(absl::Time deadline, const std::string& what) {
    while (true) {
      bool pending = false;
      for (auto& [g, c] : by_gpu) {
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(c, &state);
        if (state == ncclInProgress) pending = true;
        else if (state != ncclSuccess) return NcclError(state, what);
      }
      if (!pending) return absl::OkStatus();
      if (absl::Now() > deadline) return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded"));
      absl::SleepFor(absl::Microseconds(100));
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
  it->second->Abort();
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
  if (auto s = slot->Wait(job.deadline, absl::StrCat("round ", job.round_id, ": NCCL communicator of ", nranks, " ranks"));
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

absl::StatusOr<uint64_t> CudaBackend::AddressOn(int32_t gpu, uint64_t address) {
  if (address == 0) return address;
  std::lock_guard<std::mutex> lock(mu_);
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

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Start(const std::vector<int32_t>& gpus) {
  int count = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "no usable GPU for --backend=cuda");
  std::unique_ptr<CudaBackend> b(new CudaBackend());
  b->gpus_ = gpus;
  if (b->gpus_.empty()) {
    for (int i = 0; i < count; ++i) b->gpus_.push_back(i);
  }
  for (int32_t g : b->gpus_) {
    if (g >= count) return absl::InvalidArgumentError(absl::StrCat("--gpus names GPU ", g, "; this node has ", count));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(g), absl::StrCat("GPU ", g));
    cudaStream_t s;
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    b->streams_[g] = s;
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
  return b;
}

CudaBackend::~CudaBackend() {
  for (auto& [g, s] : streams_) {
    cudaSetDevice(g);
    cudaStreamDestroy(static_cast<cudaStream_t>(s));
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
  if (std::find(gpus_.begin(), gpus_.end(), ipc.device()) == gpus_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("buffer on GPU ", ipc.device(), ", which this daemon does not serve"));
  }
  if (ipc.offset() < 0 || bytes < 0 || ipc.offset() > ipc.size() - bytes) {
    return absl::InvalidArgumentError(absl::StrCat("a buffer of ", bytes, " bytes at offset ", ipc.offset(),
                                                   " does not fit its allocation of ", ipc.size(), " bytes"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Allocation> a = opened_[ipc.handle()].lock();
  if (a == nullptr) {  // each allocation opened once, however many buffers it holds
    a = std::make_shared<Allocation>();
    a->device = ipc.device();
    a->handle = ipc.handle();
    a->size = ipc.size();
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ipc.device()), "cudaSetDevice");
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

absl::StatusOr<TransferStats> CudaBackend::Transfer(const TransferJob& job) {
  const Plan& plan = *job.plan;
  TransferStats stats;
  BufferAddresses src, dst;
  for (const auto& s : job.src) src.push_back(reinterpret_cast<uint64_t>(s.data()));
  for (const auto& s : job.dst) dst.push_back(reinterpret_cast<uint64_t>(s.data()));
  // Messages between nodes travel by NCCL: pack on the sending GPU, send/recv, unpack.
  Communicator* comm = nullptr;
  for (const Message& m : plan.messages) {
    const bool crosses = plan.gpus[m.src_gpu].node != plan.gpus[m.dst_gpu].node;
    if (crosses && (plan.gpus[m.src_gpu].node == job.node || plan.gpus[m.dst_gpu].node == job.node)) {
      auto c = CommunicatorFor(job);
      if (!c.ok()) return c.status();
      comm = *c;
      break;
    }
  }
  // Addresses as each receiving GPU's kernels see them (imports differ per GPU).
  std::map<int32_t, std::pair<BufferAddresses, BufferAddresses>> here;
  auto addresses_on = [&](int32_t gpu) -> absl::StatusOr<const std::pair<BufferAddresses, BufferAddresses>*> {
    auto [it, added] = here.try_emplace(gpu);
    if (added) {
      for (uint64_t a : src) {
        auto t = AddressOn(gpu, a);
        if (!t.ok()) return t.status();
        it->second.first.push_back(*t);
      }
      for (uint64_t a : dst) {
        auto t = AddressOn(gpu, a);
        if (!t.ok()) return t.status();
        it->second.second.push_back(*t);
      }
    }
    return &it->second;
  };
  // Device arrays of the stage in flight, freed whichever way the transfer ends; a Cancel of
  // this round is forgotten then too.
  std::vector<std::pair<int32_t, void*>> device_arrays;
  struct Cleanup {
    CudaBackend* b;
    const TransferJob& job;
    std::vector<std::pair<int32_t, void*>>& arrays;
    ~Cleanup() {
      for (auto& [gpu, p] : arrays) {
        cudaSetDevice(gpu);
        cudaStreamSynchronize(static_cast<cudaStream_t>(b->streams_[gpu]));
        cudaFree(p);
      }
      std::lock_guard<std::mutex> lock(b->mu_);
      b->cancelled_.erase({job.group, job.round_id});
      b->active_.erase({job.group, job.round_id});
    }
  } cleanup{this, job, device_arrays};
  {
    std::lock_guard<std::mutex> lock(mu_);
    active_.insert({job.group, job.round_id});
  }

  for (int stage = 0; stage < kMaxStages; ++stage) {
    // Every message of this stage, batched per receiving GPU: one launch per GPU per stage.
    std::map<int32_t, CopyWork> batch;
    for (const Message& m : plan.messages) {
      if (m.stage != stage || plan.gpus[m.dst_gpu].node != job.node) continue;
      if (plan.gpus[m.src_gpu].node != job.node) continue;  // arrives by NCCL, below
      const int32_t gpu = plan.gpus[m.dst_gpu].gpu;
      if (!streams_.contains(gpu)) return absl::FailedPreconditionError(absl::StrCat("GPU ", gpu, " is not served here"));
      auto addr = addresses_on(gpu);
      if (!addr.ok()) return addr.status();
      const CopyWork w = DirectWork(plan, m, (*addr)->first, (*addr)->second);
      CopyWork& all = batch[gpu];
      if (all.unit_begin.empty()) all.unit_begin.push_back(0);
      for (size_t i = 0; i < w.items.size(); ++i) {
        all.items.push_back(w.items[i]);
        all.unit_begin.push_back(all.unit_begin.back() + w.items[i].Units());
      }
      (plan.gpus[m.src_gpu].gpu == gpu ? stats.bytes_local : stats.bytes_received) += m.bytes;
    }
    for (const auto& [gpu, w] : batch) {
      if (auto st = Launch(gpu, static_cast<cudaStream_t>(streams_[gpu]), w, device_arrays, "copy"); !st.ok()) return st;
    }
    // Between nodes: staging per message on both ends (plan order on both sides keeps each pair
    // of GPUs' sends and receives matched), all in one NCCL group.
    std::vector<std::pair<int32_t, std::pair<CopyWork, void*>>> unpacks;  // (gpu, (work, staging))
    std::vector<CopyWork> packs;  // alive until the stage is done
    std::set<int32_t> nccl_gpus;
    if (comm != nullptr) {
      std::vector<std::tuple<int32_t, int, void*, int64_t, bool>> ops;  // gpu, peer, buffer, bytes, send
      for (size_t i = 0; i < plan.messages.size(); ++i) {
        const Message& m = plan.messages[i];
        const PlanGpu& from = plan.gpus[m.src_gpu];
        const PlanGpu& to = plan.gpus[m.dst_gpu];
        if (m.stage != stage || from.node == to.node) continue;
        if (from.node != job.node && to.node != job.node) continue;
        const int32_t gpu = from.node == job.node ? from.gpu : to.gpu;
        auto s = static_cast<cudaStream_t>(streams_[gpu]);
        CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
        void* staging = nullptr;
        CUDA_RETURN_IF_ERROR(cudaMalloc(&staging, std::max<int64_t>(m.bytes, 16)), "staging");
        device_arrays.push_back({gpu, staging});
        auto addr = addresses_on(gpu);
        if (!addr.ok()) return addr.status();
        if (from.node == job.node) {
          packs.push_back(PackWork(plan, m, (*addr)->first, (*addr)->second, reinterpret_cast<uint64_t>(staging)));
          if (auto st = Launch(gpu, s, packs.back(), device_arrays, "pack"); !st.ok()) return st;
          ops.emplace_back(gpu, m.dst_gpu, staging, m.bytes, true);
          stats.bytes_sent += m.bytes;
        } else {
          unpacks.push_back({gpu, {UnpackWork(plan, m, reinterpret_cast<uint64_t>(staging), (*addr)->second), staging}});
          ops.emplace_back(gpu, m.src_gpu, staging, m.bytes, false);
          stats.bytes_received += m.bytes;
        }
        nccl_gpus.insert(gpu);
      }
      if (auto st = NcclError(ncclGroupStart(), "ncclGroupStart"); !st.ok()) return st;
      for (auto& [gpu, peer, buffer, bytes, send] : ops) {
        cudaSetDevice(gpu);
        auto s = static_cast<cudaStream_t>(streams_[gpu]);
        const ncclResult_t r = send ? ncclSend(buffer, static_cast<size_t>(bytes), ncclUint8, peer, comm->by_gpu[gpu], s)
                                    : ncclRecv(buffer, static_cast<size_t>(bytes), ncclUint8, peer, comm->by_gpu[gpu], s);
        if (r != ncclSuccess && r != ncclInProgress) {
          ncclGroupEnd();
          DropCommunicator(job.group);
          return NcclError(r, "ncclSend/ncclRecv");
        }
      }
      const ncclResult_t end = ncclGroupEnd();
      if (end != ncclSuccess && end != ncclInProgress) {
        DropCommunicator(job.group);
        return NcclError(end, "ncclGroupEnd");
      }
      if (auto st = comm->Wait(job.deadline, absl::StrCat("round ", job.round_id, " stage ", stage)); !st.ok()) {
        DropCommunicator(job.group);
        return st;
      }
      for (auto& [gpu, ws] : unpacks) {
        if (auto st = Launch(gpu, static_cast<cudaStream_t>(streams_[gpu]), ws.first, device_arrays, "unpack"); !st.ok()) {
          return st;
        }
      }
    }
    for (int32_t gpu : nccl_gpus) batch.try_emplace(gpu);  // wait for these streams too
    // Wait for every GPU of the stage, polling: a deadline and a Cancel must be able to end it.
    for (const auto& [gpu, w] : batch) {
      auto s = static_cast<cudaStream_t>(streams_[gpu]);
      while (true) {
        const cudaError_t q = cudaStreamQuery(s);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) return CudaError(q, absl::StrCat("round ", job.round_id, " on GPU ", gpu));
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto c = cancelled_.find({job.group, job.round_id});
          if (c != cancelled_.end()) {
            if (comm != nullptr) DropCommunicator(job.group);  // its peer may be gone: abort, rebuild
            return absl::AbortedError(c->second);
          }
        }
        if (absl::Now() > job.deadline) {
          if (comm != nullptr) DropCommunicator(job.group);
          return absl::DeadlineExceededError(absl::StrCat("round ", job.round_id, ": GPU ", gpu, " did not finish stage ", stage,
                                                          comm != nullptr ? " (a peer daemon may be dead: NCCL aborted)" : ""));
        }
        absl::SleepFor(absl::Microseconds(20));
      }
    }
    for (auto& [gpu, p] : device_arrays) {
      cudaSetDevice(gpu);
      cudaFree(p);
    }
    device_arrays.clear();
  }
  return stats;
}

void CudaBackend::Cancel(const std::string& group, int64_t round_id, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (active_.contains({group, round_id})) cancelled_[{group, round_id}] = reason;
}

}  // namespace refit
