#include "client/worker/worker_client.h"

#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

// The handle socket's wire format (daemon/worker/handle_inbox.h, daemon/README.md).
constexpr char kMagic[4] = {'R', 'F', 'H', '1'};
constexpr size_t kPacketBytes = 44;
constexpr size_t kMaxFdsPerPacket = 250;

// Keepalive on the session: a ping after a second without traffic, the daemon dead or frozen
// when it does not answer within a second. The daemon accepts pings this often.
constexpr int kKeepaliveTimeMs = 1000;
constexpr int kKeepaliveTimeoutMs = 1000;

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

std::string RandomToken() {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string token;
  for (unsigned char b : bytes) {
    token.push_back(kHex[b >> 4]);
    token.push_back(kHex[b & 15]);
  }
  return token;
}

void StoreLe32(uint32_t v, char* p) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

uint32_t LoadLe32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

void SetTimeout(int fd, absl::Time deadline) {
  const absl::Duration left = std::max(deadline - absl::Now(), absl::Milliseconds(1));
  const timeval tv = absl::ToTimeval(left);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
}

class OwnedFd {
 public:
  explicit OwnedFd(int fd) : fd_(fd) {}
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// The handle socket's address; a path too long for one is refused.
absl::Status HandleSocketAddress(const std::string& path, sockaddr_un* addr) {
  addr->sun_family = AF_UNIX;
  if (path.size() >= sizeof addr->sun_path) {
    return absl::InvalidArgumentError(
        absl::StrCat("the handle socket path \"", path, "\" is too long"));
  }
  std::memcpy(addr->sun_path, path.data(), path.size());
  return absl::OkStatus();
}

// Connects `s` to the handle socket, waiting until `deadline` for one not there yet.
absl::Status ConnectHandleSocket(int s, const sockaddr_un& addr, const std::string& path,
                                 absl::Time deadline) {
  while (connect(s, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    // Not there yet (a daemon still starting), or its backlog is full: wait, like gRPC's
    // wait_for_ready does for the registration.
    if ((errno == ENOENT || errno == ECONNREFUSED || errno == EAGAIN || errno == EINTR) &&
        absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(50));
      continue;
    }
    return absl::UnavailableError(
        absl::StrCat("cannot reach the daemon's handle socket ", path, ": ", std::strerror(errno),
                     " (is refitd running, and new enough to take file descriptors?)"));
  }
  return absl::OkStatus();
}

// One packet: the magic, the token, how many descriptors it carries (`fds`, at most
// kMaxFdsPerPacket) and whether it is the last. False when it did not all go (errno says why).
bool SendPacket(int s, const std::string& token, std::span<const int> fds, bool last) {
  char data[kPacketBytes];
  std::memcpy(data, kMagic, 4);
  std::memcpy(data + 4, token.data(), token.size());
  StoreLe32(static_cast<uint32_t>(fds.size()), data + 36);
  StoreLe32(last ? 1 : 0, data + 40);
  iovec iov{data, sizeof data};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerPacket)];
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* h = CMSG_FIRSTHDR(&msg);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(h), fds.data(), sizeof(int) * fds.size());
  }
  return sendmsg(s, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof data);
}

// Sends `fds` under `token`, kMaxFdsPerPacket at a time (at least one packet, the last marked).
// A daemon that refused them stops reading: the sending ends there, and its answer says why.
absl::Status SendDescriptors(int s, const std::string& path, const std::string& token,
                             std::span<const int> fds) {
  size_t sent = 0;
  do {
    const size_t n = std::min(kMaxFdsPerPacket, fds.size() - sent);
    if (!SendPacket(s, token, fds.subspan(sent, n), sent + n == fds.size())) {
      if (errno == EPIPE || errno == ECONNRESET) break;  // the daemon refused: its answer says why
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return absl::DeadlineExceededError(
            absl::StrCat("handing descriptors to ", path, ": deadline exceeded"));
      }
      return Errno(absl::StrCat("handing descriptors to ", path));
    }
    sent += n;
  } while (sent < fds.size());
  return absl::OkStatus();
}

// The daemon's answer to a delivery of `count` descriptors: `token` when it took them all.
// `busy` when it refused them only for now.
absl::StatusOr<std::string> ReadAnswer(int s, const std::string& path, const std::string& token,
                                       size_t count, bool* busy) {
  char answer[2048];
  ssize_t got = recv(s, answer, sizeof answer, 0);
  // A daemon that closed with packets of ours unread makes the first read fail; its answer is
  // queued behind that error.
  if (got < 0 && errno == ECONNRESET) got = recv(s, answer, sizeof answer, 0);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    return absl::DeadlineExceededError(
        absl::StrCat("the daemon's handle socket ", path, " did not answer in time"));
  }
  if (got < 0) return Errno(absl::StrCat("the answer of the daemon's handle socket ", path));
  if (got >= 8 && std::memcmp(answer, "OK\0\0", 4) == 0) {
    const uint32_t received = LoadLe32(answer + 4);
    if (received != count) {
      return absl::DataLossError(
          absl::StrCat("the daemon received ", received, " of ", count, " descriptors"));
    }
    return token;
  }
  if (got >= 8 && std::memcmp(answer, "ER\0\0", 4) == 0) {
    const size_t length = std::min<size_t>(LoadLe32(answer + 4), static_cast<size_t>(got) - 8);
    const std::string message(answer + 8, length);
    *busy = absl::StartsWith(message, "busy");
    return absl::FailedPreconditionError(
        absl::StrCat("the daemon refused the descriptors: ", message));
  }
  return absl::UnavailableError(
      absl::StrCat("the daemon's handle socket ", path,
                   got == 0 ? " closed without answering" : " gave an answer not understood"));
}

// One attempt: the daemon's answer, or why there is none. `busy` when the daemon asked to retry.
absl::StatusOr<std::string> DeliverOnce(const std::string& path, std::span<const int> fds,
                                        absl::Time deadline, bool* busy) {
  *busy = false;
  sockaddr_un addr{};
  if (auto st = HandleSocketAddress(path, &addr); !st.ok()) return st;
  OwnedFd s(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (s.get() < 0) return Errno("socket(AF_UNIX, SOCK_SEQPACKET)");
  if (auto st = ConnectHandleSocket(s.get(), addr, path, deadline); !st.ok()) return st;
  SetTimeout(s.get(), deadline);
  const std::string token = RandomToken();
  if (auto st = SendDescriptors(s.get(), path, token, fds); !st.ok()) return st;
  return ReadAnswer(s.get(), path, token, fds.size(), busy);
}

// The registration of `layout`'s worker, without its memory: the tensors, the worker encoded, and
// a trainer's rank when it declares one.
absl::StatusOr<v1::RegisterWorkerRequest> RegistrationRequest(const std::string& group,
                                                              v1::Role role, const Layout& layout,
                                                              const ConnectOptions& options) {
  const v1::Layout proto = LayoutToProto(layout);
  v1::RegisterWorkerRequest request;
  request.set_group(group);
  request.set_role(role);
  if (options.trainer_world_size != 0) {
    if (role != v1::TRAINER || options.trainer_world_size < 0 || options.trainer_rank < 0 ||
        options.trainer_rank >= options.trainer_world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "trainer_rank ", options.trainer_rank, " of trainer_world_size ",
          options.trainer_world_size,
          ": a trainer declares a rank in [0, trainer_world_size) (an inference worker declares "
          "its replica in its layout instead)"));
    }
    request.set_trainer_rank(options.trainer_rank);
    request.set_trainer_world_size(options.trainer_world_size);
  }
  *request.mutable_tensors() = proto.tensors();
  // Encoded: the daemon then receives one string, not a message per piece (10x its size there).
  request.set_worker_encoded(proto.workers(0).SerializeAsString());
  return request;
}

// The handle socket to register through: the one given, else the unix socket's.
absl::StatusOr<std::string> HandleSocketOf(const std::string& daemon,
                                           const ConnectOptions& options) {
  const std::string handles =
      options.handle_socket.empty() ? HandleSocketPath(daemon) : options.handle_socket;
  if (handles.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a worker registers through the daemon's handle socket, which a TCP address (", daemon,
        ") does not name: connect through its unix socket, \"unix:/tmp/refitd-<node>.sock\", or "
        "give ConnectOptions::handle_socket"));
  }
  return handles;
}

// Memory the worker exported itself, one handle per buffer, into the registration.
absl::Status AddWorkerMemory(const Layout& layout, WorkerMemory& memory,
                             v1::RegisterWorkerRequest& request) {
  if (memory.memory.size() != layout.buffers.size()) {
    return absl::InvalidArgumentError(absl::StrCat(layout.buffers.size(), " buffers but ",
                                                   memory.memory.size(), " memory handles"));
  }
  for (auto& m : memory.memory) *request.add_memory() = std::move(m);
  for (auto& r : memory.vmm_ranges) *request.add_vmm_ranges() = std::move(r);
  request.set_gpu_uuid(memory.gpu_uuid);
  return absl::OkStatus();
}

// The session's channel. Keepalive notices a dead or frozen daemon; a daemon that is starting (or
// restarting) is reached within a fraction of a second, not after gRPC's default back-off of up to
// minutes.
grpc::ChannelArguments SessionChannelArguments() {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(1 << 30);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // keep pinging an idle session
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  return args;
}

}  // namespace

std::string HandleSocketPath(const std::string& daemon) {
  if (!absl::StartsWith(daemon, "unix:")) return "";
  std::string path = daemon.substr(5);
  if (absl::StartsWith(path, "//")) path = path.substr(2);  // unix:///abs/path
  return path + ".handles";
}

absl::StatusOr<std::string> DeliverHandles(const std::string& path, std::span<const int> fds,
                                           absl::Time deadline) {
  while (true) {
    bool busy = false;
    auto token = DeliverOnce(path, fds, deadline, &busy);
    if (token.ok() || !busy || absl::Now() >= deadline) return token;
    absl::SleepFor(absl::Milliseconds(50));  // other workers are handing theirs over right now
  }
}

// One session's stream. The reader (the session thread) and the writer (the callback thread)
// share it; `write_mu` keeps Finish() from racing a write, and no write follows Finish().
struct WorkerClient::Session {
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::RoundEvent>> stream;
  std::mutex write_mu;
  bool ended = false;  // guarded by write_mu

  bool Write(const v1::WorkerMessage& m) {
    std::lock_guard<std::mutex> lock(write_mu);
    return !ended && stream->Write(m);
  }
  bool Ended() {
    std::lock_guard<std::mutex> lock(write_mu);
    return ended;
  }
  grpc::Status Finish() {
    std::lock_guard<std::mutex> lock(write_mu);
    ended = true;
    return stream->Finish();
  }
};

absl::StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(
    const std::string& daemon, const std::string& group, v1::Role role, const Layout& layout,
    WorkerCallbacks callbacks, absl::Duration timeout, std::vector<v1::BufferMemory> memory) {
  ConnectOptions options;
  options.timeout = timeout;
  options.memory.memory = std::move(memory);
  return Connect(daemon, group, role, layout, std::move(callbacks), std::move(options));
}

absl::StatusOr<std::unique_ptr<WorkerClient>> WorkerClient::Connect(
    const std::string& daemon, const std::string& group, v1::Role role, const Layout& layout,
    WorkerCallbacks callbacks, ConnectOptions options) {
  if (layout.workers.size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a worker's layout holds exactly one worker, not ", layout.workers.size()));
  }
  const absl::Time deadline = absl::Now() + options.timeout;
  std::unique_ptr<WorkerClient> c(new WorkerClient());
  c->role_ = role;
  c->callbacks_ = std::move(callbacks);
  c->daemon_ = daemon;
  c->timeout_ = options.timeout;
  c->reconnect_ = options.reconnect;
  auto request = RegistrationRequest(group, role, layout, options);
  if (!request.ok()) return request.status();
  std::vector<int> fds = options.memory.fds;
  auto handles = HandleSocketOf(daemon, options);
  if (!handles.ok()) return handles.status();
  if (!options.memory.memory.empty()) {
    if (auto s = AddWorkerMemory(layout, options.memory, *request); !s.ok()) return s;
  } else if (!layout.buffers.empty()) {
    if (auto s = c->AllocateHostMemory(layout, *request, fds); !s.ok()) return s;
  }
  c->request_ = *std::move(request);
  c->fds_ = std::move(fds);
  c->handle_socket_ = *std::move(handles);
  c->stub_ = v1::RefitWorker::NewStub(grpc::CreateCustomChannel(
      daemon, grpc::InsecureChannelCredentials(), SessionChannelArguments()));
  // A refusal the daemon marks transient (UNAVAILABLE: its coordinator unreachable for a moment,
  // or its node rejoining after a restart) is tried again until the deadline, as re-registrations
  // are: on a loaded machine a TLS handshake to the coordinator can outlast one attempt.
  for (absl::Duration backoff = absl::Milliseconds(100);;
       backoff = std::min(backoff * 2, absl::Seconds(1))) {
    const absl::Status s = c->Register(deadline);
    if (s.ok()) break;
    if (s.code() != absl::StatusCode::kUnavailable || absl::Now() + backoff >= deadline) return s;
    absl::SleepFor(backoff);
  }
  if (!c->OpenSession()) {
    return absl::UnavailableError(absl::StrCat("the daemon at ", daemon, " closed the session"));
  }
  c->session_thread_ = std::thread([p = c.get()] { p->SessionLoop(); });
  return c;
}

absl::Status WorkerClient::AllocateHostMemory(const Layout& layout,
                                              v1::RegisterWorkerRequest& request,
                                              std::vector<int>& fds) {
  // Every buffer in one object, each at an offset aligned for any element type.
  constexpr int64_t kAlign = 256;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const Buffer& b : layout.buffers) {
    offsets.push_back(total);
    total += (b.NumBytes() + kAlign - 1) / kAlign * kAlign;
  }
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(total, 1));
  // Sealed against shrinking and growing: the daemon maps it, and a shrinking object would kill
  // it.
  auto shm =
      SharedMemory::CreateAnonymous(absl::StrCat(getpid(), "-", layout.workers[0].name), bytes);
  if (!shm.ok()) return shm.status();
  arena_ = *std::move(shm);
  fds.push_back(arena_.fd());
  for (size_t i = 0; i < layout.buffers.size(); ++i) {
    v1::SharedMemory* m = request.add_memory()->mutable_shm();
    m->set_fd(static_cast<int32_t>(fds.size()));  // 1-based: the arena is the last descriptor
    m->set_offset(offsets[i]);
    m->set_size(static_cast<int64_t>(arena_.bytes().size()));
    buffers_.push_back(arena_.bytes().subspan(static_cast<size_t>(offsets[i]),
                                              static_cast<size_t>(layout.buffers[i].NumBytes())));
  }
  return absl::OkStatus();
}

absl::Status WorkerClient::Register(absl::Time deadline) {
  v1::RegisterWorkerRequest request = request_;
  // Always, even with no descriptor: the delivery is what identifies this process (its uid) to
  // the daemon. A fresh token each time: a delivery is claimed once.
  auto token = DeliverHandles(handle_socket_, fds_, deadline);
  if (!token.ok()) return token.status();
  request.set_fd_token(*token);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(std::max(deadline, absl::Now() + absl::Seconds(1))));
  ctx.set_wait_for_ready(true);  // the daemon may still be starting
  v1::RegisterWorkerResponse response;
  auto s = FromGrpc(stub_->Register(&ctx, request, &response));
  if (!s.ok()) return s;
  if (worker_id_.empty()) worker_id_ = response.worker_id();  // the same name every time
  std::unique_lock<std::mutex> lock(mu_);
  session_key_ = response.session_key();
  return absl::OkStatus();
}

bool WorkerClient::OpenSession() {
  std::unique_lock<std::mutex> lock(mu_);
  if (closed_) return false;
  auto session = std::make_shared<Session>();
  session->context = std::make_unique<grpc::ClientContext>();
  session->stream = stub_->Session(session->context.get());
  v1::WorkerMessage hello;
  hello.set_hello(worker_id_);
  hello.set_session_key(session_key_);  // mu_ held
  if (!session->Write(hello)) {
    session->context->TryCancel();
    session->Finish();
    return false;
  }
  session_ = std::move(session);
  connected_ = true;
  return true;
}

bool WorkerClient::SleepUnlessClosed(absl::Duration d) {
  std::unique_lock<std::mutex> lock(mu_);
  closing_.wait_for(lock, absl::ToChronoNanoseconds(d), [this] { return closed_.load(); });
  return !closed_;
}

void WorkerClient::SessionLoop() {
  while (true) {
    const std::string why = RunSession();
    if (closed_) return;
    callbacks_thread_.Post([this, why] {  // after the lost session's events
      if (open_round_ >= 0) {  // the round never ended here: an engine's buffers may be partial
        const int64_t round = std::exchange(open_round_, -1);
        if (role_ == v1::INFERENCE) version_ = 0;
        if (callbacks_.on_abort) callbacks_.on_abort(round, absl::StrCat("lost the daemon: ", why));
      }
      if (callbacks_.on_disconnected) callbacks_.on_disconnected(why);
    });
    if (!reconnect_) return;
    // As soon as the daemon is back (a restarted one, or a frozen one that dropped us on waking:
    // ALREADY_EXISTS until it did), with back-off from 100 ms to 1 s.
    absl::Duration backoff = absl::Milliseconds(100);
    while (true) {
      if (!SleepUnlessClosed(backoff)) return;
      // Bounded, so that closing the client never waits long for an attempt.
      const absl::Status s = Register(absl::Now() + std::min(timeout_, absl::Seconds(3)));
      if (s.ok() && OpenSession()) break;
      if (closed_) return;
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
    if (callbacks_.on_reconnected) {
      callbacks_thread_.Post([this, id = worker_id_] { callbacks_.on_reconnected(id); });
    }
  }
}

std::string WorkerClient::RunSession() {
  std::shared_ptr<Session> session;
  {
    std::unique_lock<std::mutex> lock(mu_);
    session = session_;
  }
  v1::RoundEvent e;
  while (session->stream->Read(&e)) {
    callbacks_thread_.Post([this, session, e] { HandleEvent(*session, e); });
  }
  connected_ = false;
  const grpc::Status status = session->Finish();
  return status.ok() ? std::string("the daemon ended the session")
                     : absl::StrCat("the session with the daemon ended: ", status.error_message());
}

void WorkerClient::HandleEvent(Session& session, const v1::RoundEvent& e) {
  v1::WorkerMessage reply;
  switch (e.kind()) {
    case v1::RoundEvent::PREPARE: {
      // The session ended before its turn came: that daemon forgot the round (nobody waits for
      // the answer); a daemon still running it tells a new session nothing of it.
      if (session.Ended()) return;
      open_round_ = e.round_id();
      if (role_ == v1::INFERENCE) version_ = 0;  // the buffers are about to change
      absl::Status s =
          callbacks_.on_prepare ? callbacks_.on_prepare(e.version()) : absl::OkStatus();
      if (!s.ok()) {  // the round cannot happen: say so, and the daemon aborts it at once
        v1::Refusal* refused = reply.mutable_refused();
        refused->set_round_id(e.round_id());
        refused->set_reason(s.message().empty() ? s.ToString() : std::string(s.message()));
        break;
      }
      reply.set_prepared(e.round_id());
      break;
    }
    case v1::RoundEvent::COMMIT:
      open_round_ = -1;
      if (role_ == v1::INFERENCE) version_ = e.version();
      if (callbacks_.on_commit) callbacks_.on_commit(e.version());
      reply.set_resumed(e.round_id());
      break;
    case v1::RoundEvent::ABORT:
      // A round this worker was prepared for: its buffers may be partial. Another (it never
      // got, or skipped, that PREPARE): nothing of it was written.
      if (e.round_id() == open_round_) {
        open_round_ = -1;
        if (role_ == v1::INFERENCE) version_ = 0;
      }
      if (callbacks_.on_abort) callbacks_.on_abort(e.round_id(), e.reason());
      reply.set_resumed(e.round_id());
      break;
    default:
      return;
  }
  session.Write(reply);  // false: the session ended meanwhile; its reader saw that too
}

std::string WorkerClient::session_key() {
  std::unique_lock<std::mutex> lock(mu_);
  return session_key_;
}

absl::Status WorkerClient::Unregister() {
  if (closed_.exchange(true)) return absl::OkStatus();
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::UnregisterWorkerRequest request;
  request.set_worker_id(worker_id_);
  {
    std::unique_lock<std::mutex> lock(mu_);
    request.set_session_key(session_key_);
  }
  v1::UnregisterWorkerResponse response;
  const absl::Status s = FromGrpc(stub_->Unregister(&ctx, request, &response));
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (session_) session_->context->TryCancel();
    closing_.notify_all();
  }
  if (session_thread_.joinable()) session_thread_.join();
  // No callback runs once Unregister returned (from a callback: once that callback returns).
  callbacks_thread_.Stop();
  return s;
}

WorkerClient::~WorkerClient() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    if (session_) session_->context->TryCancel();
    closing_.notify_all();
  }
  if (session_thread_.joinable()) session_thread_.join();
}

}  // namespace refit
