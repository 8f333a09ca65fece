#include "daemon/cuda_backend.h"

#include <cuda_runtime.h>

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

}  // namespace

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
  for (const Message& m : plan.messages) {
    if (plan.gpus[m.src_gpu].node != plan.gpus[m.dst_gpu].node &&
        (plan.gpus[m.src_gpu].node == job.node || plan.gpus[m.dst_gpu].node == job.node)) {
      return absl::UnimplementedError(absl::StrCat(
          "round ", job.round_id, ": the plan moves data between nodes ", plan.gpus[m.src_gpu].node, " and ",
          plan.gpus[m.dst_gpu].node, "; the cuda backend does not run NCCL yet (use --backend=host)"));
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
      auto s = static_cast<cudaStream_t>(streams_[gpu]);
      const size_t item_bytes = w.items.size() * sizeof(CopyItem), begin_bytes = w.unit_begin.size() * sizeof(int64_t);
      void* arrays = nullptr;
      CUDA_RETURN_IF_ERROR(cudaSetDevice(gpu), "cudaSetDevice");
      CUDA_RETURN_IF_ERROR(cudaMalloc(&arrays, item_bytes + begin_bytes), "cudaMalloc");
      device_arrays.push_back({gpu, arrays});
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arrays, w.items.data(), item_bytes, cudaMemcpyHostToDevice, s), "copy items");
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(static_cast<char*>(arrays) + item_bytes, w.unit_begin.data(), begin_bytes,
                                           cudaMemcpyHostToDevice, s), "copy units");
      CUDA_RETURN_IF_ERROR(LaunchCopyItems(static_cast<const CopyItem*>(arrays),
                                           reinterpret_cast<const int64_t*>(static_cast<char*>(arrays) + item_bytes),
                                           static_cast<int>(w.items.size()), w.unit_begin.back(), s), "copy kernel");
    }
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
          if (c != cancelled_.end()) return absl::AbortedError(c->second);
        }
        if (absl::Now() > job.deadline) {
          return absl::DeadlineExceededError(absl::StrCat("round ", job.round_id, ": GPU ", gpu, " did not finish stage ", stage));
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
