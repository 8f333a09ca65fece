#include "daemon/dataplane/host/host_backend.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/shared_memory.h"
#include "daemon/base/culprit.h"
#include "daemon/base/logging.h"
#include "daemon/dataplane/host/data_frame.h"
#include "daemon/ops/memory_trim.h"
#include "kernels/copy_items.h"
#include "plan/status_macros.h"

namespace refit {
namespace {

// A reader thread needs little stack (no recursion, no large locals): 512 KiB instead of the
// default 8 MiB keeps max_incoming readers within a small share of a limited address space.
constexpr size_t kReaderStackBytes = 512 << 10;
constexpr size_t kDrainChunkBytes = 1 << 20;
constexpr absl::Duration kLogInterval = absl::Seconds(10);  // LogLimiter's
// After an idle connection's write side is shut (its sender sees the end at its next reuse),
// its reader still reads a frame that arrives within this: one the sender began before the end
// reached it. A sender writes within microseconds of checking the connection, so a frame later
// than this is not one that raced.
constexpr absl::Duration kIdleCloseGrace = absl::Seconds(2);
// Connections kept per destination node: one per round sending to it at once (a group's round
// sends each message on one connection at a time; several groups' rounds may overlap).
constexpr size_t kMaxCachedPerPeer = 8;

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

void* RunThread(void* arg) {
  std::unique_ptr<std::function<void()>> body(static_cast<std::function<void()>*>(arg));
  (*body)();
  return nullptr;
}

// Starts `body` on a thread of kReaderStackBytes of stack; false if none could be made.
bool StartSmallThread(std::function<void()> body, pthread_t* thread) {
  pthread_attr_t attr;
  if (pthread_attr_init(&attr) != 0) return false;
  pthread_attr_setstacksize(&attr, kReaderStackBytes);
  auto* arg = new std::function<void()>(std::move(body));
  const int r = pthread_create(thread, &attr, RunThread, arg);
  pthread_attr_destroy(&attr);
  if (r != 0) {
    delete arg;
    errno = r;
    return false;
  }
  return true;
}

// Reads and discards `bytes` of a frame's payload, so that the connection stays in step.
absl::Status Drain(DataStream& stream, int64_t bytes, std::vector<std::byte>& scratch,
                   absl::Time deadline) {
  scratch.resize(static_cast<size_t>(std::min<int64_t>(bytes, kDrainChunkBytes)));
  while (bytes > 0) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(bytes, kDrainChunkBytes));
    REFIT_RETURN_IF_ERROR(stream.RecvAll({scratch.data(), n}, deadline));
    bytes -= static_cast<int64_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

// One accepted connection, read by its own thread.
struct HostBackend::Connection {
  int64_t id = 0;
  // Closed by its reader when it ends (under mu_, so Shutdown never meets a reused fd); made TLS
  // by its reader, which keeps the descriptor (so Shutdown from another thread stays valid).
  DataStream stream;
  pthread_t thread{};
  // TLS: in its handshake (under mu_); the acceptor clears it when it cuts the handshake off.
  bool handshaking = false;
  // Under mu_, for the deadlines and for eviction: between a frame's first byte and its end;
  // whether a whole frame came on it (then it is likely a node's pooled connection); since
  // when it waits for a frame (its accept, or its last frame's end).
  bool in_frame = false;
  bool carried_frame = false;
  absl::Time idle_since;
  // Under mu_: shut down by the acceptor (a handshake cut off, or evicted for a newer
  // connection); it no longer counts against max_incoming.
  bool ending = false;
  bool evicted = false;
};

struct HostBackend::Job {
  TransferJob job;  // immutable while the job lives
  absl::Mutex mu;
  absl::CondVar changed;
  std::vector<char> arrived ABSL_GUARDED_BY(mu);               // per message: landed here
  std::vector<int64_t> missing_per_stage ABSL_GUARDED_BY(mu);  // incoming not yet landed, per stage
  absl::Status error ABSL_GUARDED_BY(mu);                      // first failure (or a Cancel)
  int64_t bytes_received ABSL_GUARDED_BY(mu) = 0;
  bool closed ABSL_GUARDED_BY(mu) = false;  // Transfer is returning: nothing lands any more
  int unpacking ABSL_GUARDED_BY(mu) = 0;    // readers writing into the round's memory now
  // Sockets in the middle of one of this round's frames (sending or receiving): shut down when
  // the round fails, so that neither side waits on it and neither reuses it.
  std::vector<int> busy ABSL_GUARDED_BY(mu);

  bool IsIncoming(const Message& m) const {
    return job.plan->gpus[m.dst_gpu].node == job.node && job.plan->gpus[m.src_gpu].node != job.node;
  }
  void Fail(absl::Status status) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (error.ok()) error = std::move(status);
    for (int fd : busy) shutdown(fd, SHUT_RDWR);
    changed.SignalAll();
  }
  absl::Status status() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    return error.ok() && closed ? absl::CancelledError("the round ended") : error;
  }
  // Takes the round's request: every incoming message still to land.
  void Prepare(const TransferJob& request) ABSL_LOCKS_EXCLUDED(mu) {
    job = request;
    const Plan& plan = *request.plan;
    absl::MutexLock lock(&mu);
    arrived.assign(plan.messages.size(), 0);
    missing_per_stage.assign(kMaxStages, 0);
    for (const Message& m : plan.messages) {
      if (IsIncoming(m)) ++missing_per_stage[m.stage];
    }
  }
  // Waits until every incoming message of the stages before `stage` has landed.
  absl::Status WaitForStagesBefore(int stage) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    while (true) {
      if (!error.ok()) return error;
      bool done = true;
      for (int s = 0; s < stage; ++s) done &= missing_per_stage[s] == 0;
      if (done) return absl::OkStatus();
      if (absl::Now() >= job.deadline) return Overdue(stage);
      changed.WaitWithDeadline(&mu, job.deadline);
    }
  }
  // The deadline passed with messages of the stages before `stage` still to land: names their
  // senders.
  absl::Status Overdue(int stage) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const Plan& plan = *job.plan;
    std::vector<std::string> owing;
    for (size_t i = 0; i < plan.messages.size(); ++i) {
      const Message& m = plan.messages[i];
      if (IsIncoming(m) && m.stage < stage && !arrived[i]) {
        const std::string who = absl::StrCat("node ", plan.gpus[m.src_gpu].node);
        if (std::find(owing.begin(), owing.end(), who) == owing.end()) owing.push_back(who);
      }
    }
    return absl::DeadlineExceededError(absl::StrCat("round ", job.round_id, ": node ", job.node,
                                                    " still waits for messages from ",
                                                    absl::StrJoin(owing, ", ")));
  }
  // Marks `fd` as carrying one of this round's frames; false (nothing marked) when the round has
  // failed or ended.
  bool BeginFrame(int fd) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (!error.ok() || closed) return false;
    busy.push_back(fd);
    return true;
  }
  // Unmarks it. False when the round failed meanwhile: the socket may have been shut down in the
  // middle of the frame, and must be dropped.
  bool EndFrame(int fd) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    busy.erase(std::find(busy.begin(), busy.end(), fd));
    return error.ok();
  }
  // Unpacks message `index` (received whole into `staging`) unless the round is over.
  void Land(int64_t index, std::span<const std::byte> staging) ABSL_LOCKS_EXCLUDED(mu) {
    const Plan& plan = *job.plan;
    const Message& m = plan.messages[index];
    {
      absl::MutexLock lock(&mu);
      if (closed || !error.ok()) return;
      ++unpacking;
    }
    UnpackMessage(plan, m, staging, job.dst);
    absl::MutexLock lock(&mu);
    --unpacking;
    if (!arrived[index]) {
      arrived[index] = 1;
      --missing_per_stage[m.stage];
      bytes_received += m.bytes;
    }
    changed.SignalAll();
  }
  // Nothing lands after this returns.
  void Close() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    closed = true;
    while (unpacking > 0) changed.Wait(&mu);
  }
};

HostBackend::HostBackend(const HostBackendOptions& options) : options_(options) {
  int64_t physical = options.physical_memory_bytes;
  if (physical <= 0) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    physical = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : int64_t{1} << 40;
  }
  max_object_bytes_ = physical;
  max_mapped_bytes_ = options.max_mapped_bytes > 0 ? options.max_mapped_bytes : 2 * physical;
}

bool HostBackend::LogLimiter::Allow(std::string* suffix) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (now - last_ < kLogInterval) {
    ++unlogged_;
    return false;
  }
  last_ = now;
  *suffix = unlogged_ > 0
                ? absl::StrCat(" (and ", unlogged_, " more like it since the last such line)")
                : "";
  unlogged_ = 0;
  return true;
}

absl::StatusOr<std::unique_ptr<HostBackend>> HostBackend::Start(const std::string& listen_address) {
  return Start(listen_address, HostBackendOptions());
}

absl::StatusOr<std::unique_ptr<HostBackend>> HostBackend::Start(const std::string& listen_address,
                                                                const HostBackendOptions& options) {
  std::unique_ptr<TlsContext> tls;
  if (options.tls.enabled()) {
    auto loaded = TlsContext::Load(options.tls);
    if (!loaded.ok()) return Annotate(loaded.status(), "data plane TLS");
    tls = *std::move(loaded);
  }
  auto listening = TcpListen(listen_address);
  if (!listening.ok()) return listening.status();
  std::unique_ptr<HostBackend> b(new HostBackend(options));
  b->tls_ = std::move(tls);
  b->listener_ = std::move(listening->first);
  b->address_ = listening->second;
  // Non-blocking: the acceptor polls it beside its wake-up descriptor, and an accept after a
  // poll must never block (the connection may be gone by then).
  const int flags = fcntl(b->listener_.get(), F_GETFL);
  if (flags < 0 || fcntl(b->listener_.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("data plane listener: fcntl: ", std::strerror(errno)));
  }
  b->wake_ = Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!b->wake_.valid()) {
    return absl::InternalError(absl::StrCat("data plane: eventfd: ", std::strerror(errno)));
  }
  b->acceptor_ = std::thread([p = b.get()] { p->AcceptLoop(); });
  return b;
}

HostBackend::~HostBackend() {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [key, job] : jobs_) jobs.push_back(job);
    for (auto& [id, c] : connections_) c->stream.Shutdown();
    jobs_changed_.SignalAll();
  }
  for (auto& job : jobs) job->Fail(absl::CancelledError("data plane shutting down"));
  Wake();
  if (acceptor_.joinable()) acceptor_.join();
  // No reader begins any more; every one still running wakes (its socket is shut down, or
  // stopping_ ends its wait for a round) and ends.
  std::vector<std::unique_ptr<Connection>> all;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, c] : connections_) all.push_back(std::move(c));
    connections_.clear();
    finished_.clear();
  }
  for (auto& c : all) pthread_join(c->thread, nullptr);
}

void HostBackend::Wake() {
  const uint64_t one = 1;
  if (write(wake_.get(), &one, sizeof one) < 0) {
    // EAGAIN: the counter is full, the acceptor is awake anyway.
  }
}

std::vector<std::pair<std::string, int64_t>> HostBackend::ConnectionEvents() const {
  const HostConnectionStats s = connection_stats();
  return {{"accepted", s.accepted},
          {"refused", s.refused},
          {"evicted", s.evicted},
          {"first_byte_timeout", s.first_byte_timeouts},
          {"idle_closed", s.idle_closed},
          {"accept_error", s.accept_errors},
          {"tls_refused", s.tls_refused},
          {"user_refused", s.user_refused},
          {"handshake_cut", s.handshakes_cut},
          {"forged_frame", s.forged_frames},
          {"stale_frame", s.stale_frames}};
}

HostConnectionStats HostBackend::connection_stats() const {
  HostConnectionStats s;
  {
    absl::MutexLock lock(&mu_);
    s = counters_;
    s.reader_threads = static_cast<int64_t>(connections_.size());
    for (const auto& [id, c] : connections_) s.in_frame += c->in_frame;
    for (const auto& [address, streams] : outgoing_)
      s.cached_outgoing += static_cast<int64_t>(streams.size());
  }
  if (tls_ != nullptr) s.tls_reloads = tls_->reloads();  // its own lock, never held with mu_
  return s;
}

// Joins the readers that ended.
void HostBackend::Reap() {
  std::vector<std::unique_ptr<Connection>> done;
  {
    absl::MutexLock lock(&mu_);
    for (int64_t id : finished_) {
      auto it = connections_.find(id);
      if (it == connections_.end()) continue;
      done.push_back(std::move(it->second));
      connections_.erase(it);
    }
    finished_.clear();
  }
  for (auto& c : done) pthread_join(c->thread, nullptr);  // each has returned or is returning
}

void HostBackend::AcceptLoop() {
  while (true) {
    pollfd p[2] = {{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (poll(p, 2, -1) < 0 && errno != EINTR) {
      // Cannot happen with two valid descriptors; never spin on it.
      absl::SleepFor(options_.accept_backoff);
    }
    if (p[1].revents != 0) {
      uint64_t n;
      if (read(wake_.get(), &n, sizeof n) < 0) {
        // EAGAIN: woken by someone else already.
      }
    }
    // Accept what is waiting (a bounded batch, then poll again), reaping ended readers first so
    // that a closed connection's thread is joined before a new one counts against the bound.
    for (int batch = 0; batch < 64; ++batch) {
      Reap();
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
      }
      if ((p[0].revents & (POLLIN | POLLERR | POLLHUP)) == 0) break;
      const AcceptNext next = AcceptOne();
      if (next == AcceptNext::kStop) return;
      if (next == AcceptNext::kPoll) break;
    }
  }
}

namespace {

void SetDataSocketOptions(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  // A peer host that vanishes without a FIN is found within about two minutes.
  const int idle = 60, interval = 10, count = 6;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

// "host:port" of an accepted connection's peer, for log lines.
std::string PeerName(int fd) {
  std::string peer = "a peer";
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) == 0) {
    char host[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &sa.sin_addr, host, sizeof host);
    peer = absl::StrCat(host, ":", ntohs(sa.sin_port));
  }
  return peer;
}

}  // namespace

HostBackend::AcceptNext HostBackend::AcceptOne() {
  const int accepted = accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
  if (accepted < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK) return AcceptNext::kPoll;
    if (errno == EINTR || errno == ECONNABORTED) return AcceptNext::kNext;
    // EMFILE, ENFILE, ENOBUFS, ENOMEM, ...: the connection stays in the backlog; try again
    // shortly. Never give up: a node that stops accepting cannot take part in any round.
    BackOffAfterAcceptError(errno);
    return AcceptNext::kPoll;
  }
  Fd fd(accepted);
  SetDataSocketOptions(fd.get());
  const std::string peer = PeerName(fd.get());
  // Before anything is read from it: another user's bytes never reach an engine.
  if (options_.local_users != nullptr && !AdmitsLocalUser(fd)) return AcceptNext::kNext;
  return ServeConnection(std::move(fd), peer);
}

void HostBackend::BackOffAfterAcceptError(int err) {
  std::string more;
  if (accept_errors_log_.Allow(&more)) {
    Logger("xfer")->error("data plane {}: accept failed: {}; retrying every {} ms{}", address_,
                          std::strerror(err), absl::ToInt64Milliseconds(options_.accept_backoff),
                          more);
  }
  absl::MutexLock lock(&mu_);
  ++counters_.accept_errors;
  mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.accept_backoff);
}

bool HostBackend::AdmitsLocalUser(const Fd& fd) {
  absl::Status s = options_.local_users->CheckPeer(fd.get(), absl::StrCat("data plane ", address_));
  if (s.ok()) return true;
  std::string more;
  if (user_refusals_log_.Allow(&more)) Logger("xfer")->warn("{}{}", std::string(s.message()), more);
  absl::MutexLock lock(&mu_);
  ++counters_.user_refused;
  return false;
}

HostBackend::AcceptNext HostBackend::ServeConnection(Fd fd, const std::string& peer) {
  auto log = Logger("xfer");
  std::string more;
  absl::MutexLock lock(&mu_);
  if (stopping_) return AcceptNext::kStop;
  // Idle connections never lock senders out: the one idle the longest makes room. Those
  // ending still hold a thread for a moment; twice the bound caps them under a flood.
  if ((LiveConnections() >= options_.max_incoming && !EvictIdlest(peer)) ||
      static_cast<int64_t>(connections_.size()) >= 2 * int64_t{options_.max_incoming}) {
    ++counters_.refused;
    if (refusals_log_.Allow(&more)) {
      log->warn(
          "data plane {}: refusing a data connection from {}: {} are open, each inside a "
          "frame, the most this node serves at once{}",
          address_, peer, LiveConnections(), more);
    }
    return AcceptNext::kNext;  // fd closes
  }
  auto c = std::make_unique<Connection>();
  c->id = next_connection_++;
  c->idle_since = absl::Now();
  c->stream = DataStream(std::move(fd), absl::StrCat("the data connection from ", peer));
  Connection* raw = c.get();
  if (!StartSmallThread([this, raw] { ReadLoop(raw); }, &c->thread)) {
    log->error("data plane {}: no thread to read a data connection from {}: {}", address_, peer,
               std::strerror(errno));
    return AcceptNext::kNext;  // c (and its fd) go
  }
  ++counters_.accepted;
  ++counters_.open_incoming;
  if (tls_ != nullptr) BoundHandshakes(raw);
  connections_[raw->id] = std::move(c);
  return AcceptNext::kNext;
}

int HostBackend::MaxHandshaking() const {
  return options_.max_handshaking > 0 ? options_.max_handshaking
                                      : std::max(1, options_.max_incoming / 2);
}

void HostBackend::BoundHandshakes(Connection* incoming) {
  // Anyone can open connections that never handshake: at most max_handshaking of them at
  // once, the oldest cut off for the newest (a node's handshake takes milliseconds).
  if (counters_.handshaking >= MaxHandshaking()) {
    Connection* oldest = nullptr;
    for (auto& [id, other] : connections_) {
      if (other->handshaking && (oldest == nullptr || id < oldest->id)) oldest = other.get();
    }
    if (oldest != nullptr) {
      oldest->handshaking = false;
      oldest->ending = true;
      --counters_.handshaking;
      ++counters_.handshakes_cut;
      oldest->stream.Shutdown();  // its reader ends (it closes the descriptor, under mu_)
    }
  }
  incoming->handshaking = true;
  ++counters_.handshaking;
}

int64_t HostBackend::LiveConnections() const {
  int64_t live = 0;
  for (const auto& [id, c] : connections_) live += !c->ending;
  return live;
}

bool HostBackend::EvictIdlest(const std::string& for_peer) {
  // A connection that never carried a frame goes first (connections anyone can open: they
  // cannot push out a node's pooled one), then the one idle the longest.
  Connection* victim = nullptr;
  for (auto& [id, c] : connections_) {
    if (c->in_frame || c->ending) continue;
    if (victim == nullptr || std::pair(c->carried_frame, c->idle_since) <
                                 std::pair(victim->carried_frame, victim->idle_since)) {
      victim = c.get();
    }
  }
  if (victim == nullptr) return false;
  victim->ending = victim->evicted = true;
  if (victim->handshaking) {
    victim->handshaking = false;
    --counters_.handshaking;
  }
  ++counters_.evicted;
  std::string more;
  if (refusals_log_.Allow(&more)) {
    Logger("xfer")->warn(
        "data plane {}: closing {} (idle for {}) to serve a new one from {}: {} connections are "
        "open, the most this node serves at once{}",
        address_, victim->stream.peer(),
        absl::FormatDuration(absl::Trunc(absl::Now() - victim->idle_since, absl::Milliseconds(1))),
        for_peer, options_.max_incoming, more);
  }
  victim->stream.Shutdown();  // its reader ends (it closes the descriptor, under mu_)
  return true;
}

void HostBackend::MarkInFrame(Connection* c, bool in_frame) {
  absl::MutexLock lock(&mu_);
  c->in_frame = in_frame;
  if (!in_frame) {
    c->carried_frame = true;
    c->idle_since = absl::Now();
  }
}

bool HostBackend::ExpireIdle(Connection* c) {
  bool pooled;
  {
    absl::MutexLock lock(&mu_);
    pooled = c->carried_frame;
    ++(pooled ? counters_.idle_closed : counters_.first_byte_timeouts);
  }
  std::string more;
  if (idle_log_.Allow(&more)) {
    if (pooled) {
      Logger("xfer")->info("data plane {}: closing {}: idle for {} between frames{}", address_,
                           c->stream.peer(), absl::FormatDuration(options_.idle_timeout), more);
    } else {
      Logger("xfer")->warn(
          "data plane {}: closing {}: no frame began within {} of its connection{}", address_,
          c->stream.peer(), absl::FormatDuration(options_.first_byte_timeout), more);
    }
  }
  if (!pooled) return false;
  c->stream.ShutdownWrite();
  return true;
}

void HostBackend::EndReader(Connection* c) {
  {
    absl::MutexLock lock(&mu_);
    c->stream.Close();
    --counters_.open_incoming;
    finished_.push_back(c->id);
  }
  Wake();  // the acceptor joins this thread
}

HostBackend::FrameFate HostBackend::FindJob(const RoundKey& key, absl::Time deadline,
                                            std::shared_ptr<Job>* job) {
  absl::MutexLock lock(&mu_);
  while (true) {
    if (stopping_) return FrameFate::kGiveUp;
    if (auto it = jobs_.find(key); it != jobs_.end()) {
      *job = it->second;
      return FrameFate::kDeliver;
    }
    if (ended_.contains(key)) return FrameFate::kDrop;
    // One round per group at a time: a later round of the group running here means this one is
    // over everywhere.
    for (const auto& [k, j] : jobs_) {
      if (k.first == key.first && k.second > key.second) return FrameFate::kDrop;
    }
    if (absl::Now() >= deadline) return FrameFate::kGiveUp;
    jobs_changed_.WaitWithDeadline(&mu_, deadline);
  }
}

// One thread per accepted connection: read a frame, land it in this node's buffers, or drop it
// whole if its round is over here.
void HostBackend::ReadLoop(Connection* c) {
  DataStream& stream = c->stream;  // only EndReader closes it
  if (tls_ != nullptr && !HandshakeIncoming(c)) {
    EndReader(c);
    return;
  }
  std::vector<std::byte> staging;
  std::string group;
  // A frame's first byte comes by this: first_byte_timeout after the connection began,
  // idle_timeout after a frame, kIdleCloseGrace once the write side is shut for idleness.
  absl::Time idle_until = absl::Now() + options_.first_byte_timeout;
  bool closing_idle = false;
  while (true) {
    std::array<std::byte, kFrameHeaderBytes> wire;
    // The peer closing it, this backend stopping or the acceptor evicting it (shutdown wakes
    // the read) also end the wait. The rest of the frame comes by frame_wait.
    if (absl::Status first = stream.RecvAll({wire.data(), 1}, idle_until); !first.ok()) {
      if (!absl::IsDeadlineExceeded(first) || closing_idle || !ExpireIdle(c)) break;
      closing_idle = true;
      idle_until = absl::Now() + kIdleCloseGrace;
      continue;
    }
    MarkInFrame(c, true);
    if (!ReadFrame(stream, wire, staging, group)) break;
    // Landed or dropped whole: the connection waits for its next frame.
    MarkInFrame(c, false);
    idle_until = absl::Now() + (closing_idle ? kIdleCloseGrace : options_.idle_timeout);
  }
  // Its staging (up to a message, tens of MB) goes with this thread: past glibc's dynamic mmap
  // threshold it sits in the thread's arena, which keeps it unless asked (connections end when a
  // round fails, so a daemon whose rounds abort again and again grew by a message each time).
  const bool large = staging.capacity() >= static_cast<size_t>(kTrimAfterBytes);
  staging = {};
  if (large) RequestTrim();
  EndReader(c);
}

// Here, not in the acceptor: a peer that stalls its handshake holds only this thread, and
// only for handshake_timeout (or until newer handshakes cut it off).
bool HostBackend::HandshakeIncoming(Connection* c) {
  DataStream& stream = c->stream;
  absl::Status s = stream.AcceptTls(
      *tls_, absl::Now() + std::min(options_.frame_wait, options_.handshake_timeout));
  bool stopping, cut, evicted;
  {
    absl::MutexLock lock(&mu_);
    evicted = c->evicted;
    cut = !c->handshaking && !evicted;
    if (c->handshaking) {
      c->handshaking = false;
      --counters_.handshaking;
    }
    if ((!s.ok() && !evicted) || cut) ++counters_.tls_refused;
    // Its deadline for a first frame runs from here.
    c->idle_since = absl::Now();
    stopping = stopping_;  // then the handshake was cut off by the shutdown: nothing to say
  }
  if (cut) {
    s = absl::UnavailableError(absl::StrCat(
        "the TLS handshake of ", stream.peer(), " was cut off: it was the oldest of more than ",
        MaxHandshaking(), " connections in their handshake at once"));
  }
  if (evicted) return false;  // logged by the acceptor
  if (!s.ok()) {
    std::string more;
    if (!stopping && drops_log_.Allow(&more))
      Logger("xfer")->warn("data plane {}: refused a data connection: {}{}", address_,
                           std::string(s.message()), more);
    return false;
  }
  return true;
}

bool HostBackend::ReadFrame(DataStream& stream, std::array<std::byte, kFrameHeaderBytes>& wire,
                            std::vector<std::byte>& staging, std::string& group) {
  const absl::Time deadline = absl::Now() + options_.frame_wait;
  FrameHeader h;
  if (!ReadFrameHeader(stream, wire, deadline, &h, group)) return false;
  std::shared_ptr<Job> job;
  const FrameFate fate = FindJob({group, h.round_id}, deadline, &job);
  if (fate == FrameFate::kGiveUp) {
    std::string more;
    if (absl::Now() >= deadline && drops_log_.Allow(&more)) {
      Logger("xfer")->warn("dropping {}: round {} of group \"{}\" did not begin here within {}{}",
                           stream.peer(), h.round_id, group,
                           absl::FormatDuration(options_.frame_wait), more);
    }
    return false;
  }
  if (fate == FrameFate::kDeliver) {
    const Delivery delivery = DeliverFrame(stream, *job, h, group, staging);
    if (delivery != Delivery::kRoundOver) return delivery == Delivery::kLanded;
    // The round failed or ended here before this frame: drop it like any late one.
  }
  return DropLateFrame(stream, h, group, staging);
}

bool HostBackend::ReadFrameHeader(DataStream& stream,
                                  std::array<std::byte, kFrameHeaderBytes>& wire,
                                  absl::Time deadline, FrameHeader* h, std::string& group) {
  std::string more;
  if (auto s = stream.RecvAll(std::span(wire).subspan(1), deadline); !s.ok()) {
    if (drops_log_.Allow(&more)) {
      Logger("xfer")->warn("dropping {}: a frame header broke off: {}{}", stream.peer(),
                           std::string(s.message()), more);
    }
    return false;
  }
  const absl::StatusOr<FrameHeader> parsed = ParseFrameHeader(wire);
  if (!parsed.ok()) {
    if (drops_log_.Allow(&more)) {
      Logger("xfer")->error("dropping {}: malformed frame header: {}{}", stream.peer(),
                            std::string(parsed.status().message()), more);
    }
    return false;
  }
  *h = *parsed;
  group.resize(h->group_bytes);
  if (auto s = stream.RecvAll({reinterpret_cast<std::byte*>(group.data()), group.size()}, deadline);
      !s.ok()) {
    if (drops_log_.Allow(&more)) {
      Logger("xfer")->warn("dropping {}: a frame header broke off: {}{}", stream.peer(),
                           std::string(s.message()), more);
    }
    return false;
  }
  return true;
}

HostBackend::Delivery HostBackend::DeliverFrame(DataStream& stream, Job& job, const FrameHeader& h,
                                                const std::string& group,
                                                std::vector<std::byte>& staging) {
  const Plan& plan = *job.job.plan;
  if (IsForgedFrame(stream, plan, h, group)) return Delivery::kDropConnection;
  if (absl::Status s = CheckFrameForPlan(h, plan, job.job.node); !s.ok()) {
    // Plain TCP (no identities), or the message's own sender: a broken peer, the round's
    // failure.
    job.Fail(std::move(s));
    return Delivery::kDropConnection;
  }
  const int fd = stream.fd().get();
  if (!job.BeginFrame(fd)) return Delivery::kRoundOver;  // failed or ended before this frame
  staging.resize(static_cast<size_t>(h.bytes));
  const absl::Status s = stream.RecvAll(staging, job.job.deadline);
  // The round failed meanwhile: the socket is shut down.
  if (!job.EndFrame(fd)) return Delivery::kDropConnection;
  if (!s.ok()) {
    // Not this round's failure: the sender sends the message again on a fresh connection
    // if it can; if it cannot, it reports why (its worker died, it was cancelled) or its
    // daemon is found gone, and that, not this symptom, is the round's reason. Failing
    // here would race that report and blame the wrong node.
    std::string more;
    if (drops_log_.Allow(&more)) {
      Logger("xfer")->warn(
          "dropping {}: message {} of round {} of group \"{}\" from node {} broke off: {}{}",
          stream.peer(), h.message, h.round_id, group,
          plan.gpus[plan.messages[h.message].src_gpu].node, std::string(s.message()), more);
    }
    return Delivery::kDropConnection;
  }
  job.Land(h.message, staging);
  return Delivery::kLanded;
}

bool HostBackend::IsForgedFrame(const DataStream& stream, const Plan& plan, const FrameHeader& h,
                                const std::string& group) {
  const bool in_range = h.message >= 0 && h.message < static_cast<int64_t>(plan.messages.size()) &&
                        plan.messages[h.message].src_gpu >= 0 &&
                        plan.messages[h.message].src_gpu < static_cast<int32_t>(plan.gpus.size());
  // With TLS the sender is known (its certificate's node): only the node the plan has send the
  // message may fail the round with a bad frame of it. Anyone else's frame (another node's
  // message, one that does not exist, for a round it has not begun yet) is dropped with its
  // connection, so that no certificate holder can abort rounds it takes no part in.
  const int32_t sender = in_range ? plan.gpus[plan.messages[h.message].src_gpu].node : -1;
  const std::vector<int32_t>& nodes = stream.peer_nodes();  // its certificate's
  const bool forged =
      stream.tls() && (sender < 0 || std::find(nodes.begin(), nodes.end(), sender) == nodes.end());
  if (!forged) return false;
  // Not the round's failure: the true sender's frame still comes on its own connection.
  {
    absl::MutexLock lock(&mu_);
    ++counters_.forged_frames;
  }
  std::string more;
  if (drops_log_.Allow(&more)) {
    if (sender < 0) {
      Logger("xfer")->error(
          "dropping {}: its certificate is {}'s, and it sent message {} of round {} of group "
          "\"{}\", "
          "which that round does not have{}",
          stream.peer(), stream.identity(), h.message, h.round_id, group, more);
    } else {
      Logger("xfer")->error(
          "dropping {}: its certificate is {}'s, but it sent message {} of round {} of group "
          "\"{}\", "
          "which node {} sends{}",
          stream.peer(), stream.identity(), h.message, h.round_id, group, sender, more);
    }
  }
  return true;
}

bool HostBackend::DropLateFrame(DataStream& stream, const FrameHeader& h, const std::string& group,
                                std::vector<std::byte>& staging) {
  std::string more;
  if (auto s = Drain(stream, h.bytes, staging, absl::Now() + options_.frame_wait); !s.ok()) {
    if (drops_log_.Allow(&more)) {
      Logger("xfer")->warn("dropping {}: a late frame of round {} of group \"{}\" broke off: {}{}",
                           stream.peer(), h.round_id, group, std::string(s.message()), more);
    }
    return false;
  }
  {
    absl::MutexLock lock(&mu_);
    ++counters_.stale_frames;
  }
  if (stale_log_.Allow(&more)) {
    Logger("xfer")->info(
        "dropped a late frame ({} bytes) of round {} of group \"{}\" from {}: that round is over "
        "here{}",
        h.bytes, h.round_id, group, stream.peer(), more);
  }
  return true;
}

namespace {
// Mapped anonymous memory, unmapped when the plan's buffers go: heap memory of this size, once
// freed, stayed in glibc's arenas, so every aborted round that made a worker re-register (and the
// node allocate the plan's scratch again) grew the daemon (6 MiB of scratch: RssAnon 15.7 -> 59
// MiB over 12 aborts, tests/integration/fp8_fault_matrix_test).
class HostScratch : public MappedBuffer {
 public:
  static absl::StatusOr<std::unique_ptr<HostScratch>> Allocate(int64_t bytes) {
    if (bytes == 0) return std::unique_ptr<HostScratch>(new HostScratch(nullptr, 0));
    void* p = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mapping ", bytes, " bytes of scratch: ", std::strerror(errno)));
    }
    return std::unique_ptr<HostScratch>(
        new HostScratch(static_cast<std::byte*>(p), static_cast<size_t>(bytes)));
  }
  ~HostScratch() override {
    if (data_ != nullptr) munmap(data_, size_);
  }
  HostScratch(const HostScratch&) = delete;
  HostScratch& operator=(const HostScratch&) = delete;
  std::span<std::byte> bytes() const override { return {data_, size_}; }

 private:
  HostScratch(std::byte* data, size_t size) : data_(data), size_(size) {}
  std::byte* data_;
  size_t size_;
};
}  // namespace

absl::StatusOr<std::unique_ptr<MappedBuffer>> HostBackend::AllocateScratch(const Worker&,
                                                                           int64_t bytes) {
  if (bytes < 0) return absl::InvalidArgumentError("scratch of negative size");
  auto scratch = HostScratch::Allocate(bytes);
  if (!scratch.ok()) return scratch.status();
  return std::unique_ptr<MappedBuffer>(*std::move(scratch));
}

absl::StatusOr<std::unique_ptr<MappedBuffer>> HostBackend::Map(const v1::BufferMemory& memory,
                                                               int64_t bytes) {
  if (!memory.has_shm()) {
    return absl::InvalidArgumentError(
        "the host backend reaches buffers through POSIX shared memory (BufferMemory.shm); this "
        "buffer has no shared-memory handle");
  }
  // Never by name: this daemon (often root) opening a path a worker names would read and write
  // any object the worker can name, another program's included. Memory comes as a descriptor,
  // which only its owner can hand over (MapBuffers); Map has none to offer.
  (void)bytes;
  return absl::InvalidArgumentError(absl::StrCat(
      "shared memory by name (\"", memory.shm().name(),
      "\") is refused: the daemon opens no path a worker names; hand the object (a sealed memfd) "
      "over "
      "the handle socket and give its index (SharedMemory.fd, RegisterWorkerRequest.fd_token)"));
}

absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> HostBackend::MapBuffers(
    const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes,
    std::span<const Fd> fds) {
  std::vector<std::unique_ptr<MappedBuffer>> out;
  std::vector<std::shared_ptr<SharedMemory>> by_fd(fds.size());  // this registration's, by index
  for (int b = 0; b < request.memory_size(); ++b) {
    const v1::BufferMemory& m = request.memory(b);
    const std::string what = absl::StrCat("buffer \"", request.worker().buffers(b).name(), "\"");
    const int64_t bytes = buffer_bytes[b];
    if (m.has_cuda_vmm() || m.has_cuda_ipc()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what,
          ": GPU memory (CUDA IPC or VMM) needs --backend cuda; this daemon runs --backend host"));
    }
    if (!m.has_shm() || m.shm().fd() == 0) {  // by name, or nothing: refused
      return Annotate(Map(m, bytes).status(), what);
    }
    const v1::SharedMemory& shm = m.shm();
    // Checked at registration already (memory_refs.h); checked again here because this interface
    // is public and an index past the descriptors would read out of bounds.
    if (shm.fd() < 1 || static_cast<size_t>(shm.fd()) > fds.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": its shared memory is descriptor ",
                                                     shm.fd(), " (1-based), but ", fds.size(),
                                                     " descriptors came with it"));
    }
    const size_t index = static_cast<size_t>(shm.fd() - 1);
    const std::string object = absl::StrCat("descriptor ", shm.fd(), " (its shared memory)");
    std::shared_ptr<SharedMemory>& segment = by_fd[index];
    if (segment == nullptr) {
      auto mapped = MapObjectOnce(fds[index].get(), what, object, bytes);
      if (!mapped.ok()) return mapped.status();
      segment = *std::move(mapped);
    }
    // The object's size as the kernel has it now, not as the worker says: a claim that
    // disagrees is a confused worker, refused before its buffers are used.
    const int64_t size = static_cast<int64_t>(segment->bytes().size());
    if (shm.size() != size) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": its shared memory claims ", shm.size(), " bytes but ", object, " has ", size));
    }
    if (shm.offset() < 0 || bytes < 0 || shm.offset() > size - bytes) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", bytes, " bytes at offset ",
                                                     shm.offset(), " do not fit ", object, " of ",
                                                     size, " bytes"));
    }
    out.push_back(std::unique_ptr<MappedBuffer>(new ShmBuffer(segment, shm.offset(), bytes)));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<SharedMemory>> HostBackend::MapObjectOnce(int fd,
                                                                         const std::string& what,
                                                                         const std::string& object,
                                                                         int64_t bytes) {
  // Sealed before it is measured and mapped, so that it cannot shrink from under the mapping
  // (SIGBUS in this daemon); an object that cannot be sealed is refused.
  if (auto s = SharedMemory::SealAgainstShrinking(fd, object); !s.ok()) {
    return Annotate(s, what);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return absl::InternalError(
        absl::StrCat(what, ": fstat of ", object, ": ", std::strerror(errno)));
  }
  absl::MutexLock lock(&segments_mu_);
  std::weak_ptr<SharedMemory>& cached = fd_segments_[{st.st_dev, st.st_ino}];
  std::shared_ptr<SharedMemory> segment = cached.lock();
  if (segment != nullptr) return segment;
  // Mapped whole, so bounded before it is mapped: a sparse object costs no memory but
  // as much address space as it claims (terabytes would leave no room for threads).
  const int64_t size = static_cast<int64_t>(st.st_size);
  if (size > max_object_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", object, " has ", size, " bytes, more than this machine's physical memory (",
        max_object_bytes_, " bytes): refused (the buffer needs ", bytes, ")"));
  }
  int64_t now = mapped_bytes_->load();
  do {
    if (size > 0 && now > max_mapped_bytes_ - size) {
      return absl::ResourceExhaustedError(
          absl::StrCat(what, ": ", object, " has ", size, " bytes, and this daemon maps ", now,
                       " bytes of shared memory already: more than max_mapped_bytes (",
                       max_mapped_bytes_, " bytes) would be mapped at once"));
    }
  } while (!mapped_bytes_->compare_exchange_weak(now, now + std::max<int64_t>(size, 0)));
  const int64_t reserved = std::max<int64_t>(size, 0);
  // At most the size measured (and reserved): an object grown since is refused.
  auto mapped = SharedMemory::MapDescriptor(fd, object, static_cast<size_t>(reserved));
  if (!mapped.ok()) {
    mapped_bytes_->fetch_sub(reserved);
    return Annotate(mapped.status(), what);
  }
  segment = std::shared_ptr<SharedMemory>(new SharedMemory(*std::move(mapped)),
                                          [counter = mapped_bytes_, reserved](SharedMemory* m) {
                                            delete m;  // unmapped: its bytes no longer count
                                            counter->fetch_sub(reserved);
                                          });
  cached = segment;
  if (++fd_maps_since_prune_ >= fd_segments_.size()) {
    fd_maps_since_prune_ = 0;
    std::erase_if(fd_segments_, [](const auto& e) { return e.second.expired(); });
  }
  return segment;
}

absl::StatusOr<int32_t> HostBackend::GpuIndex(const std::string& name) {
  return absl::InvalidArgumentError(
      absl::StrCat("gpu_uuid \"", name, "\" given but this daemon runs --backend host"));
}

DataStream HostBackend::TakeCached(const std::string& address) {
  DataStream stream;
  {
    absl::MutexLock lock(&mu_);
    auto it = outgoing_.find(address);
    if (it == outgoing_.end()) return stream;
    stream = std::move(it->second.back());
    it->second.pop_back();
    if (it->second.empty()) outgoing_.erase(it);
  }
  // The peer never writes on a data connection (after TLS's handshake and its one byte, which
  // ConnectTls consumed): anything to read is its close or an error (it restarted, or dropped
  // the connection). Such a connection could swallow a frame without an error here, so it is
  // never reused.
  pollfd p{stream.fd().get(), POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) != 0) stream.Close();
  return stream;
}

void HostBackend::DropOutgoing(const std::vector<std::string>& peers) {
  for (const std::string& address : peers) outgoing_.erase(address);
}

void HostBackend::RememberEnded(const RoundKey& key) {
  Ended& e = ended_[key];
  e.seq = ++ended_seq_;
  ended_order_.emplace_back(key, e.seq);
  while (ended_order_.size() > static_cast<size_t>(std::max(options_.ended_rounds, 1))) {
    const auto& [oldest, seq] = ended_order_.front();
    if (auto it = ended_.find(oldest); it != ended_.end() && it->second.seq == seq)
      ended_.erase(it);
    ended_order_.pop_front();
  }
}

namespace {

// A frame's header and group name, sent in one write (one TLS record).
std::vector<std::byte> FramePrefix(const std::string& group, int64_t round_id, int64_t message,
                                   int64_t bytes) {
  FrameHeader h;
  h.group_bytes = static_cast<uint32_t>(group.size());
  h.round_id = round_id;
  h.message = message;
  h.bytes = bytes;
  std::vector<std::byte> prefix(kFrameHeaderBytes + group.size());
  const auto wire = EncodeFrameHeader(h);
  std::copy(wire.begin(), wire.end(), prefix.begin());
  std::memcpy(prefix.data() + kFrameHeaderBytes, group.data(), group.size());
  return prefix;
}

}  // namespace

absl::Status HostBackend::Send(Job& job, const Message& m, int64_t index,
                               std::vector<std::byte>& staging) {
  const Plan& plan = *job.job.plan;
  const int32_t node = plan.gpus[m.dst_gpu].node;
  auto addr = job.job.data_addresses.find(node);
  if (addr == job.job.data_addresses.end()) {
    return absl::FailedPreconditionError(absl::StrCat("no data address for node ", node));
  }
  const std::string peer = absl::StrCat("node ", node, " (", addr->second, ")");
  // A destination that cannot be reached, fails the handshake or drops the stream is the culprit,
  // not this (sending) node, which the coordinator would otherwise blame for its own TRANSFER.
  auto blame = [&](absl::Status s) {
    return WithCulprit(std::move(s), NodeCulprit(node, addr->second, "TRANSFER"));
  };
  PackMessage(plan, m, job.job.src, job.job.dst, staging);
  const std::vector<std::byte> prefix =
      FramePrefix(job.job.group, job.job.round_id, index, m.bytes);
  // A cached connection may have died since the last round: one fresh try.
  for (int attempt = 0; attempt < 2; ++attempt) {
    DataStream stream = attempt == 0 ? TakeCached(addr->second) : DataStream();
    const bool fresh = !stream.valid();
    if (fresh) {
      auto c = TcpConnect(addr->second, job.job.deadline);
      if (!c.ok())
        return blame(absl::UnavailableError(
            absl::StrCat("cannot reach ", peer, ": ", c.status().message())));
      if (options_.local_users != nullptr) {
        // The listener must be a daemon's: a process of another user that took a dead node's
        // port would otherwise receive the weights.
        if (absl::Status u =
                options_.local_users->CheckPeer(c->get(), absl::StrCat("sending to ", peer));
            !u.ok()) {
          return blame(absl::PermissionDeniedError(u.message()));
        }
      }
      stream = DataStream(*std::move(c), peer);
    }
    const int fd = stream.fd().get();
    // Marked before the handshake too, so that a Cancel ends a handshake that stalls.
    if (!job.BeginFrame(fd)) return job.status();  // the round failed: the stream goes unused
    absl::Status s;
    if (fresh && tls_ != nullptr) {
      // The destination must prove it is that node (another node's certificate will not do).
      s = stream.ConnectTls(*tls_, node, job.job.deadline);
      if (!s.ok()) {
        if (!job.EndFrame(fd)) return job.status();
        return blame(
            absl::Status(s.code(), absl::StrCat("cannot reach ", peer, ": ", s.message())));
      }
    }
    s = stream.SendAll(prefix, job.job.deadline);
    if (s.ok()) s = stream.SendAll(staging, job.job.deadline);
    // Failed meanwhile (a Cancel): the frame may be cut off, and the stream goes with it.
    if (!job.EndFrame(fd)) return job.status();
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      if (!stopping_) {
        std::vector<DataStream>& cached = outgoing_[addr->second];
        cached.push_back(std::move(stream));
        // The oldest goes: it carried its last frame before every other one here.
        if (cached.size() > kMaxCachedPerPeer) cached.erase(cached.begin());
      }
      return absl::OkStatus();
    }
    if (attempt == 1 || absl::IsDeadlineExceeded(s))
      return blame(s);  // it goes: it may hold half a frame
  }
  return absl::InternalError("unreachable");
}

absl::StatusOr<TransferStats> HostBackend::Transfer(const TransferJob& request) {
  const absl::Time started = absl::Now();
  auto shared = std::make_shared<Job>();
  Job& job = *shared;
  job.Prepare(request);
  std::vector<std::string> peers;  // the other nodes' data addresses
  for (const auto& [node, address] : request.data_addresses) {
    if (node != request.node) peers.push_back(address);
  }
  const RoundKey key(request.group, request.round_id);
  REFIT_RETURN_IF_ERROR(BeginRound(key, shared));
  TransferStats stats;
  absl::Status status = RunStages(job, &stats);
  // A failure resets every connection in the middle of one of this round's frames (shut down:
  // both ends drop it); then nothing lands in the round's memory any more.
  if (!status.ok()) job.Fail(status);
  job.Close();
  EndRound(key, status.ok(), peers);
  if (!status.ok()) {
    RequestTrim();  // what the failed round held (its staging, dropped connections') goes back
    return status;
  }
  LogMoved(request, started, &stats);
  absl::MutexLock lock(&job.mu);
  stats.bytes_received = job.bytes_received;
  return stats;
}

absl::Status HostBackend::BeginRound(const RoundKey& key, const std::shared_ptr<Job>& job) {
  absl::MutexLock lock(&mu_);
  if (jobs_.contains(key)) {
    return absl::AlreadyExistsError(absl::StrCat("round ", key.second, " is already running"));
  }
  if (auto e = ended_.find(key); e != ended_.end()) {
    // Over here already: cancelled before it began (the cancel is honoured once), or an
    // earlier round of the same id (round ids start again when the coordinator restarts).
    if (!e->second.cancelled.ok()) {
      absl::Status cancelled = std::move(e->second.cancelled);
      e->second.cancelled = absl::OkStatus();
      return cancelled;
    }
    ended_.erase(e);
  }
  jobs_[key] = job;
  jobs_changed_.SignalAll();
  return absl::OkStatus();
}

absl::Status HostBackend::RunStages(Job& job, TransferStats* stats) {
  const TransferJob& request = job.job;
  const Plan& plan = *request.plan;
  std::vector<std::byte> staging;
  const BufferAddresses local_src = AddressesOf(request.src), local_dst = AddressesOf(request.dst);
  absl::Status status;
  for (int stage = 0; stage < kMaxStages && status.ok(); ++stage) {
    status = job.WaitForStagesBefore(stage);
    for (size_t i = 0; i < plan.messages.size() && status.ok(); ++i) {
      const Message& m = plan.messages[i];
      if (m.stage != stage || plan.gpus[m.src_gpu].node != request.node) continue;
      if (plan.gpus[m.dst_gpu].node == request.node) {
        // Straight from the sources into the destinations, as the cuda backend copies inside a
        // node (the kernels' CPU twin): not packed into staging and unpacked again.
        RunCopyWorkOnHost(DirectWork(plan, m, local_src, local_dst));
        stats->bytes_local += m.bytes;
      } else {
        status = Send(job, m, static_cast<int64_t>(i), staging);
        if (status.ok()) stats->bytes_sent += m.bytes;
      }
      absl::MutexLock lock(&job.mu);
      if (!job.error.ok()) status = job.error;
    }
  }
  if (status.ok()) status = job.WaitForStagesBefore(kMaxStages);
  return status;
}

void HostBackend::EndRound(const RoundKey& key, bool ok, const std::vector<std::string>& peers) {
  absl::MutexLock lock(&mu_);
  jobs_.erase(key);
  // Its late frames are dropped from now on; after a failure nothing of it may precede the next
  // round on a cached connection.
  if (!ok) DropOutgoing(peers);
  RememberEnded(key);
  jobs_changed_.SignalAll();
}

void HostBackend::Cancel(const std::string& group, int64_t round_id, const std::string& reason) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    const RoundKey key(group, round_id);
    if (auto it = jobs_.find(key); it != jobs_.end()) {
      job = it->second;
    } else if (ended_.contains(key)) {
      // Ended here, aborted elsewhere (rare): no connection it used is reused.
      outgoing_.clear();
    } else {
      // Not begun here: its frames are late ones, and a Transfer of it ends at once.
      RememberEnded(key);
      // The first reason stays: the node names the first worker lost as the culprit.
      if (ended_[key].cancelled.ok()) ended_[key].cancelled = absl::AbortedError(reason);
      jobs_changed_.SignalAll();
    }
  }
  if (job != nullptr) job->Fail(absl::AbortedError(reason));
}

}  // namespace refit
