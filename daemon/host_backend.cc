#include "daemon/host_backend.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/shared_memory.h"
#include "daemon/logging.h"
#include "plan/status_macros.h"

namespace refit {
namespace {

constexpr uint32_t kMagic = 0x31544652;  // "RFT1"

// Sent before each message's payload, then the group name.
struct FrameHeader {
  uint32_t magic;
  uint32_t group_bytes;
  int64_t round_id;
  int64_t message;
  int64_t bytes;
};
static_assert(sizeof(FrameHeader) == 32);

class ShmBuffer : public MappedBuffer {
 public:
  ShmBuffer(std::shared_ptr<SharedMemory> shm, int64_t offset, int64_t bytes)
      : shm_(std::move(shm)), offset_(offset), bytes_(bytes) {}
  std::span<std::byte> bytes() const override {
    return shm_->bytes().subspan(static_cast<size_t>(offset_), static_cast<size_t>(bytes_));
  }

 private:
  std::shared_ptr<SharedMemory> shm_;  // shared by every buffer of the object
  int64_t offset_, bytes_;
};

}  // namespace

struct HostBackend::Job {
  TransferJob job;
  std::mutex mu;
  std::condition_variable changed;
  std::vector<char> arrived;               // per message: landed here
  std::vector<int64_t> missing_per_stage;  // incoming messages not yet landed, per stage
  absl::Status error;                      // first failure (or a Cancel)
  int64_t bytes_received = 0;

  bool IsIncoming(const Message& m) const {
    return job.plan->gpus[m.dst_gpu].node == job.node && job.plan->gpus[m.src_gpu].node != job.node;
  }
  void Fail(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu);
    if (error.ok()) error = std::move(status);
    changed.notify_all();
  }
};

absl::StatusOr<std::unique_ptr<HostBackend>> HostBackend::Start(const std::string& listen_address) {
  auto listening = TcpListen(listen_address);
  if (!listening.ok()) return listening.status();
  std::unique_ptr<HostBackend> b(new HostBackend());
  b->listener_ = std::move(listening->first);
  b->address_ = listening->second;
  b->acceptor_ = std::thread([p = b.get()] { p->AcceptLoop(); });
  return b;
}

HostBackend::~HostBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& [key, job] : jobs_) job->Fail(absl::CancelledError("data plane shutting down"));
    for (Fd& c : connections_) c.Shutdown();
  }
  jobs_changed_.notify_all();
  listener_.Shutdown();
  if (acceptor_.joinable()) acceptor_.join();
  for (std::thread& t : readers_) t.join();
}

void HostBackend::AcceptLoop() {
  while (true) {
    auto c = TcpAccept(listener_);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || !c.ok()) return;
    const int fd = c->get();
    connections_.push_back(*std::move(c));
    readers_.emplace_back([this, fd] { ReadLoop(fd); });
  }
}

std::shared_ptr<HostBackend::Job> HostBackend::WaitForJob(const std::string& group,
                                                          int64_t round_id, absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    auto it = jobs_.find(std::make_pair(group, round_id));
    if (it != jobs_.end()) return it->second;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return nullptr;
    jobs_changed_.wait_for(lock, absl::ToChronoNanoseconds(left));
  }
  return nullptr;
}

// One thread per accepted connection: read a frame, land it in this node's buffers.
void HostBackend::ReadLoop(int connection) {
  const Fd fd(dup(connection));  // our own descriptor: connections_ may move while we read
  const std::string peer = "a peer's data connection";
  std::vector<std::byte> staging;
  std::string group;
  while (true) {
    FrameHeader h;
    // Between rounds a connection idles: wait for the next frame without a deadline, until the
    // peer closes it or this backend stops (shutdown wakes the read).
    if (!RecvAll(fd, {reinterpret_cast<std::byte*>(&h), sizeof h}, absl::InfiniteFuture(), peer).ok()) {
      return;
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    if (h.magic != kMagic || h.group_bytes > 4096 || h.bytes < 0) {
      Logger("xfer")->error("dropping a data connection: malformed frame header");
      return;
    }
    group.resize(h.group_bytes);
    if (!RecvAll(fd, {reinterpret_cast<std::byte*>(group.data()), group.size()}, deadline, peer).ok()) {
      return;
    }
    std::shared_ptr<Job> job = WaitForJob(group, h.round_id, deadline);
    if (job == nullptr) {
      Logger("xfer")->warn("dropping a data connection: no round {} of group \"{}\" here", h.round_id,
                           group);
      return;
    }
    const Plan& plan = *job->job.plan;
    if (h.message < 0 || h.message >= static_cast<int64_t>(plan.messages.size()) ||
        !job->IsIncoming(plan.messages[h.message]) || plan.messages[h.message].bytes != h.bytes) {
      job->Fail(absl::DataLossError(absl::StrCat("round ", h.round_id, ": a peer sent message ",
                                                 h.message, " of ", h.bytes,
                                                 " bytes, which this node does not expect")));
      return;
    }
    staging.resize(static_cast<size_t>(h.bytes));
    if (auto s = RecvAll(fd, staging, job->job.deadline, peer); !s.ok()) {
      job->Fail(absl::UnavailableError(absl::StrCat("round ", h.round_id, ": message ", h.message,
                                                    " from node ", plan.gpus[plan.messages[h.message].src_gpu].node,
                                                    " broke off: ", s.message())));
      return;
    }
    const Message& m = plan.messages[h.message];
    UnpackMessage(plan, m, staging, job->job.dst);
    std::lock_guard<std::mutex> lock(job->mu);
    if (!job->arrived[h.message]) {
      job->arrived[h.message] = 1;
      --job->missing_per_stage[m.stage];
      job->bytes_received += m.bytes;
    }
    job->changed.notify_all();
  }
}

absl::StatusOr<std::unique_ptr<MappedBuffer>> HostBackend::Map(const v1::BufferMemory& memory,
                                                               int64_t bytes) {
  if (!memory.has_shm()) {
    return absl::InvalidArgumentError(
        "the host backend reaches buffers through POSIX shared memory (BufferMemory.shm); this "
        "buffer has no shared-memory handle");
  }
  const v1::SharedMemory& shm = memory.shm();
  if (shm.offset() < 0 || bytes < 0 || shm.offset() > shm.size() - bytes) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory \"", shm.name(), "\": a buffer of ",
                                                   bytes, " bytes at offset ", shm.offset(),
                                                   " does not fit its ", shm.size(), " bytes"));
  }
  // One mapping per object, shared by its buffers while any of them is mapped.
  std::lock_guard<std::mutex> lock(segments_mu_);
  const std::pair<std::string, int64_t> key{shm.name(), shm.size()};
  std::shared_ptr<SharedMemory> segment = segments_[key].lock();
  if (segment == nullptr) {
    auto opened = SharedMemory::Open(shm.name(), static_cast<size_t>(shm.size()));
    if (!opened.ok()) return opened.status();
    segment = std::make_shared<SharedMemory>(*std::move(opened));
    segments_[key] = segment;
    // Forget objects no buffer maps any more (their names may be reused); amortized over opens.
    if (++opens_since_prune_ >= segments_.size()) {
      opens_since_prune_ = 0;
      for (auto it = segments_.begin(); it != segments_.end();) it = it->second.expired() ? segments_.erase(it) : std::next(it);
    }
  }
  return std::unique_ptr<MappedBuffer>(new ShmBuffer(std::move(segment), shm.offset(), bytes));
}

absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> HostBackend::MapBuffers(
    const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes, std::span<const Fd> fds) {
  std::vector<std::unique_ptr<MappedBuffer>> out;
  std::vector<std::shared_ptr<SharedMemory>> by_fd(fds.size());  // this registration's, by index
  int unsealed = 0;
  for (int b = 0; b < request.memory_size(); ++b) {
    const v1::BufferMemory& m = request.memory(b);
    const std::string what = absl::StrCat("buffer \"", request.worker().buffers(b).name(), "\"");
    const int64_t bytes = buffer_bytes[b];
    if (m.has_cuda_vmm() || m.has_cuda_ipc()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": GPU memory (CUDA IPC or VMM) needs --backend cuda; this daemon runs --backend host"));
    }
    if (!m.has_shm() || m.shm().fd() == 0) {  // by name
      auto mapped = Map(m, bytes);
      if (!mapped.ok()) return Annotate(mapped.status(), what);
      out.push_back(*std::move(mapped));
      continue;
    }
    const v1::SharedMemory& shm = m.shm();
    const size_t index = static_cast<size_t>(shm.fd() - 1);
    const std::string object = absl::StrCat("descriptor ", shm.fd(), " (its shared memory)");
    std::shared_ptr<SharedMemory>& segment = by_fd[index];
    if (segment == nullptr) {
      struct stat st;
      if (fstat(fds[index].get(), &st) != 0) {
        return absl::InternalError(absl::StrCat(what, ": fstat of ", object, ": ", std::strerror(errno)));
      }
      std::lock_guard<std::mutex> lock(segments_mu_);
      std::weak_ptr<SharedMemory>& cached = fd_segments_[{st.st_dev, st.st_ino}];
      segment = cached.lock();
      if (segment == nullptr) {
        auto mapped = SharedMemory::MapDescriptor(fds[index].get(), object);
        if (!mapped.ok()) return Annotate(mapped.status(), what);
        segment = std::make_shared<SharedMemory>(*std::move(mapped));
        cached = segment;
        if (!segment->sealed_against_shrinking()) ++unsealed;
        if (++fd_maps_since_prune_ >= fd_segments_.size()) {
          fd_maps_since_prune_ = 0;
          std::erase_if(fd_segments_, [](const auto& e) { return e.second.expired(); });
        }
      }
    }
    // The object's size as the kernel has it now, not as the worker says: a claim that
    // disagrees is a confused worker, refused before its buffers are used.
    const int64_t size = static_cast<int64_t>(segment->bytes().size());
    if (shm.size() != size) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": its shared memory claims ", shm.size(), " bytes but ",
                                                     object, " has ", size));
    }
    if (shm.offset() < 0 || bytes < 0 || shm.offset() > size - bytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes, " bytes at offset ", shm.offset(),
                                                     " do not fit ", object, " of ", size, " bytes"));
    }
    out.push_back(std::unique_ptr<MappedBuffer>(new ShmBuffer(segment, shm.offset(), bytes)));
  }
  if (unsealed > 0) {
    // Mapped within the object's size; but its owner could still truncate it later, and this
    // daemon would die of SIGBUS touching the vanished pages. Sealed memfds cannot shrink.
    Logger("worker")->warn("worker \"{}\": {} of its shared-memory objects are not sealed against shrinking "
                           "(memfd with F_SEAL_SHRINK); a truncate would crash this daemon",
                           request.worker().name(), unsealed);
  }
  return out;
}

absl::StatusOr<int32_t> HostBackend::GpuIndex(const std::string& name) {
  return absl::InvalidArgumentError(absl::StrCat("gpu_uuid \"", name, "\" given but this daemon runs --backend host"));
}

absl::Status HostBackend::Send(Job& job, const Message& m, int64_t index,
                               std::vector<std::byte>& staging) {
  const Plan& plan = *job.job.plan;
  const int32_t node = plan.gpus[m.dst_gpu].node;
  auto addr = job.job.data_addresses.find(node);
  if (addr == job.job.data_addresses.end()) {
    return absl::FailedPreconditionError(absl::StrCat("no data address for node ", node));
  }
  const std::string peer = absl::StrCat("node ", node, " (", addr->second, ")");
  PackMessage(plan, m, job.job.src, job.job.dst, staging);
  FrameHeader h{kMagic, static_cast<uint32_t>(job.job.group.size()), job.job.round_id, index, m.bytes};
  // A cached connection may have died since the last round: one fresh try.
  for (int attempt = 0; attempt < 2; ++attempt) {
    Fd fd;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = outgoing_.find(addr->second);
      if (it != outgoing_.end()) {
        fd = std::move(it->second);
        outgoing_.erase(it);
      }
    }
    if (!fd.valid()) {
      auto c = TcpConnect(addr->second, job.job.deadline);
      if (!c.ok()) return absl::UnavailableError(absl::StrCat("cannot reach ", peer, ": ", c.status().message()));
      fd = *std::move(c);
    }
    absl::Status s = SendAll(fd, {reinterpret_cast<const std::byte*>(&h), sizeof h}, job.job.deadline, peer);
    if (s.ok()) {
      s = SendAll(fd, {reinterpret_cast<const std::byte*>(job.job.group.data()), job.job.group.size()},
                  job.job.deadline, peer);
    }
    if (s.ok()) s = SendAll(fd, staging, job.job.deadline, peer);
    if (s.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      outgoing_[addr->second] = std::move(fd);
      return absl::OkStatus();
    }
    if (attempt == 1 || absl::IsDeadlineExceeded(s)) return s;
  }
  return absl::InternalError("unreachable");
}

absl::StatusOr<TransferStats> HostBackend::Transfer(const TransferJob& request) {
  const absl::Time started = absl::Now();
  auto job = std::make_shared<Job>();
  job->job = request;
  const Plan& plan = *request.plan;
  job->arrived.assign(plan.messages.size(), 0);
  job->missing_per_stage.assign(kMaxStages, 0);
  for (const Message& m : plan.messages) {
    if (job->IsIncoming(m)) ++job->missing_per_stage[m.stage];
  }
  const auto key = std::make_pair(request.group, request.round_id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (jobs_.contains(key)) {
      return absl::AlreadyExistsError(absl::StrCat("round ", request.round_id, " is already running"));
    }
    jobs_[key] = job;
  }
  jobs_changed_.notify_all();

  TransferStats stats;
  std::vector<std::byte> staging;
  // Waits until every incoming message of the stages before `stage` has landed.
  auto wait_for_stages_before = [&](int stage) -> absl::Status {
    std::unique_lock<std::mutex> lock(job->mu);
    while (true) {
      if (!job->error.ok()) return job->error;
      bool done = true;
      for (int s = 0; s < stage; ++s) done &= job->missing_per_stage[s] == 0;
      if (done) return absl::OkStatus();
      const absl::Duration left = request.deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        std::vector<std::string> owing;
        for (size_t i = 0; i < plan.messages.size(); ++i) {
          const Message& m = plan.messages[i];
          if (job->IsIncoming(m) && m.stage < stage && !job->arrived[i]) {
            const std::string who = absl::StrCat("node ", plan.gpus[m.src_gpu].node);
            if (std::find(owing.begin(), owing.end(), who) == owing.end()) owing.push_back(who);
          }
        }
        return absl::DeadlineExceededError(absl::StrCat(
            "round ", request.round_id, ": node ", request.node, " still waits for messages from ",
            absl::StrJoin(owing, ", ")));
      }
      job->changed.wait_for(lock, absl::ToChronoNanoseconds(left));
    }
  };
  absl::Status status;
  for (int stage = 0; stage < kMaxStages && status.ok(); ++stage) {
    status = wait_for_stages_before(stage);
    for (size_t i = 0; i < plan.messages.size() && status.ok(); ++i) {
      const Message& m = plan.messages[i];
      if (m.stage != stage || plan.gpus[m.src_gpu].node != request.node) continue;
      if (plan.gpus[m.dst_gpu].node == request.node) {
        PackMessage(plan, m, request.src, request.dst, staging);
        UnpackMessage(plan, m, staging, request.dst);
        stats.bytes_local += m.bytes;
      } else {
        status = Send(*job, m, static_cast<int64_t>(i), staging);
        if (status.ok()) stats.bytes_sent += m.bytes;
      }
      std::lock_guard<std::mutex> lock(job->mu);
      if (!job->error.ok()) status = job->error;
    }
  }
  if (status.ok()) status = wait_for_stages_before(kMaxStages);
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.erase(key);
  }
  if (!status.ok()) return status;
  LogMoved(request, started);
  std::lock_guard<std::mutex> lock(job->mu);
  stats.bytes_received = job->bytes_received;
  return stats;
}

void HostBackend::Cancel(const std::string& group, int64_t round_id, const std::string& reason) {
  std::shared_ptr<Job> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = jobs_.find(std::make_pair(group, round_id));
    if (it == jobs_.end()) return;
    job = it->second;
  }
  job->Fail(absl::AbortedError(reason));
}

}  // namespace refit
