#include "daemon/worker/handle_inbox.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/base/logging.h"

namespace refit {
namespace {

constexpr size_t kMaxErrorBytes = 1024;
constexpr size_t kExpiredRemembered = 256;
constexpr absl::Duration kAcceptBackoff = absl::Milliseconds(100);

uint32_t LoadLe32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

void StoreLe32(uint32_t v, char* p) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

bool IsToken(std::string_view t) {
  return t.size() == kHandleTokenChars && std::all_of(t.begin(), t.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// Enough of a token to follow it through the logs, not enough to claim its descriptors with.
std::string Short(const std::string& token) { return token.substr(0, 8) + "..."; }

// The answer packet; best effort (a peer that stopped reading just misses it).
void Answer(int fd, bool ok, uint32_t value, std::string_view message) {
  std::string packet(8, '\0');
  packet[0] = ok ? 'O' : 'E';
  packet[1] = ok ? 'K' : 'R';
  if (!ok) {
    message = message.substr(0, kMaxErrorBytes);
    value = static_cast<uint32_t>(message.size());
  }
  StoreLe32(value, packet.data() + 4);
  packet.append(message);
  send(fd, packet.data(), packet.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

struct HandleInbox::Connection {
  Fd fd;
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::string token;  // from its first packet
  std::vector<Fd> fds;
  absl::Time opened, last_packet;
  int packets = 0;
  std::string Who() const { return absl::StrCat("pid ", pid, " uid ", uid); }
};

HandleInbox::HandleInbox(HandleInboxOptions options) : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<HandleInbox>> HandleInbox::Start(HandleInboxOptions options) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options.path.empty() || options.path.size() >= sizeof addr.sun_path) {
    return absl::InvalidArgumentError(absl::StrCat("the handle socket path \"", options.path,
                                                   "\" must have 1 to ", sizeof addr.sun_path - 1,
                                                   " bytes (a shorter --worker-socket)"));
  }
  std::memcpy(addr.sun_path, options.path.data(), options.path.size());
  std::unique_ptr<HandleInbox> inbox(new HandleInbox(std::move(options)));
  const std::string& path = inbox->options_.path;
  inbox->listener_ = Fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!inbox->listener_.valid()) return Errno("socket(AF_UNIX, SOCK_SEQPACKET)");
  unlink(path.c_str());  // a stale socket from a dead daemon
  if (bind(inbox->listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return Errno(absl::StrCat("bind ", path));
  }
  if (inbox->options_.mode != 0 && chmod(path.c_str(), inbox->options_.mode) != 0) {
    const absl::Status s = Errno(absl::StrCat("chmod ", path));
    unlink(path.c_str());
    return s;
  }
  struct stat st;
  if (stat(path.c_str(), &st) == 0) inbox->inode_ = st.st_ino;
  if (listen(inbox->listener_.get(), 128) != 0) {
    const absl::Status s = Errno(absl::StrCat("listen ", path));
    unlink(path.c_str());
    return s;
  }
  inbox->wake_ = Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!inbox->wake_.valid()) {
    const absl::Status s = Errno("eventfd");
    unlink(path.c_str());
    return s;
  }
  inbox->loop_ = std::thread([p = inbox.get()] { p->Loop(); });
  return inbox;
}

HandleInbox::~HandleInbox() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  const uint64_t one = 1;
  if (wake_.valid() && write(wake_.get(), &one, sizeof one) < 0) {
    // The counter cannot overflow from one write; nothing else can fail here.
  }
  if (loop_.joinable()) loop_.join();
  struct stat st;
  if (stat(options_.path.c_str(), &st) == 0 && st.st_ino == inode_) unlink(options_.path.c_str());
}

HandleInbox::Counts HandleInbox::counts() {
  absl::MutexLock lock(&mu_);
  return {static_cast<int>(pending_.size()), held_fds_, connections_open_};
}

absl::StatusOr<HandleDelivery> HandleInbox::Take(const std::string& token) {
  absl::MutexLock lock(&mu_);
  Expire(Now());
  auto it = pending_.find(token);
  if (it == pending_.end()) {
    if (expired_.contains(token)) {
      return absl::NotFoundError(absl::StrCat(
          "the handles delivered under token \"", token, "\" expired unclaimed after ",
          absl::FormatDuration(options_.ttl), " (register within ",
          absl::FormatDuration(options_.ttl), " of sending them over ", options_.path, ")"));
    }
    return absl::NotFoundError(absl::StrCat("no handles were delivered under token \"", token,
                                            "\" (send them over ", options_.path, " first)"));
  }
  HandleDelivery d = std::move(it->second);
  pending_.erase(it);
  held_fds_ -= static_cast<int64_t>(d.fds.size());
  return d;
}

void HandleInbox::Expire(absl::Time now) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (now - it->second.arrived < options_.ttl) {
      ++it;
      continue;
    }
    Logger("worker")->warn(
        "handles: {} descriptors under token {} from pid {} uid {} expired unclaimed after {}",
        it->second.fds.size(), Short(it->first), it->second.pid, it->second.uid,
        absl::FormatDuration(options_.ttl));
    held_fds_ -= static_cast<int64_t>(it->second.fds.size());
    expired_order_.push_back(it->first);
    expired_.insert(it->first);
    if (expired_order_.size() > kExpiredRemembered) {
      expired_.erase(expired_order_.front());
      expired_order_.pop_front();
    }
    it = pending_.erase(it);  // closes its descriptors
  }
}

void HandleInbox::Loop() {
  std::vector<pollfd> polled;
  while (true) {
    const absl::Time now = Now();
    // Connections past their deadlines.
    for (auto& c : connections_) {
      if (!c->fd.valid()) continue;
      if (now - c->last_packet >= options_.idle_timeout) {
        Refuse(*c, absl::StrCat("no packet for ", absl::FormatDuration(options_.idle_timeout),
                                "; closed"));
      } else if (now - c->opened >= options_.delivery_timeout) {
        Refuse(*c, absl::StrCat("the delivery took longer than ",
                                absl::FormatDuration(options_.delivery_timeout), "; closed"));
      }
    }
    std::erase_if(connections_,
                  [](const std::unique_ptr<Connection>& c) { return !c->fd.valid(); });
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) break;
      Expire(now);
      connections_open_ = static_cast<int>(connections_.size());
    }

    // Sleep until a packet, a connection, a deadline or the end; at most a second, so that
    // expiry runs even when nothing happens.
    absl::Time wake_at = now + absl::Seconds(1);
    for (const auto& c : connections_) {
      wake_at = std::min(
          {wake_at, c->last_packet + options_.idle_timeout, c->opened + options_.delivery_timeout});
    }
    polled.clear();
    polled.push_back({wake_.get(), POLLIN, 0});
    // The accept back-off runs on the real clock: a test's frozen clock must not stop accepting.
    const absl::Time real_now = absl::Now();
    const bool listening = real_now >= accept_resume_;
    int64_t ms = absl::ToInt64Milliseconds(wake_at - now) + 1;
    if (listening) {
      polled.push_back({listener_.get(), POLLIN, 0});
    } else {
      ms = std::min(ms, absl::ToInt64Milliseconds(accept_resume_ - real_now) + 1);
    }
    const size_t first_connection = polled.size();
    for (const auto& c : connections_) polled.push_back({c->fd.get(), POLLIN, 0});
    ms = std::clamp<int64_t>(ms, 1, 1000);
    const int ready = poll(polled.data(), polled.size(), static_cast<int>(ms));
    if (ready < 0 && errno != EINTR) {
      Logger("worker")->error("handles: poll failed: {}", std::strerror(errno));
      absl::SleepFor(kAcceptBackoff);
      continue;
    }
    if (ready <= 0) continue;
    if (polled[0].revents != 0) {
      uint64_t drained;
      while (read(wake_.get(), &drained, sizeof drained) > 0) {
      }
    }
    const absl::Time after = Now();
    // Packets first (the connections polled are connections_[0 .. n) in order), then new ones.
    for (size_t i = first_connection; i < polled.size(); ++i) {
      if (polled[i].revents == 0) continue;
      Connection& c = *connections_[i - first_connection];
      if (c.fd.valid()) ReadPacket(c, after);
    }
    std::erase_if(connections_,
                  [](const std::unique_ptr<Connection>& c) { return !c->fd.valid(); });
    if (listening && polled[1].revents != 0) AcceptSome(after);
    // counts() sees the connections as they are now, not as of the loop's top: a count read
    // between an accept and the next pass would miss the connection just accepted.
    absl::MutexLock lock(&mu_);
    connections_open_ = static_cast<int>(connections_.size());
  }
  // Shutting down: whatever is still arriving or unclaimed is closed.
  connections_.clear();
  absl::MutexLock lock(&mu_);
  pending_.clear();
  held_fds_ = 0;
  connections_open_ = 0;
}

void HandleInbox::AcceptSome(absl::Time now) {
  for (int i = 0; i < 16; ++i) {
    Fd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd.valid()) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED)
        return;
      // EMFILE, ENFILE, ENOBUFS, ENOMEM: the connection stays in the backlog and the listener
      // stays readable, so back off instead of spinning; the inbox keeps serving the rest.
      const int e = errno;
      const absl::Time real_now = absl::Now();
      accept_resume_ = real_now + kAcceptBackoff;
      if (real_now - accept_error_logged_ >= absl::Seconds(5)) {
        Logger("worker")->warn(
            "handles: accept on {} failed: {}{}; retrying every {}", options_.path,
            std::strerror(e),
            accept_errors_unlogged_ > 0
                ? absl::StrCat(" (and ", accept_errors_unlogged_, " times since the last report)")
                : "",
            absl::FormatDuration(kAcceptBackoff));
        accept_error_logged_ = real_now;
        accept_errors_unlogged_ = 0;
      } else {
        ++accept_errors_unlogged_;
      }
      return;
    }
    auto c = std::make_unique<Connection>();
    c->fd = std::move(fd);
    c->opened = c->last_packet = now;
    ucred cred{};
    socklen_t len = sizeof cred;
    const bool known = getsockopt(c->fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
    if (known) {
      c->pid = cred.pid;
      c->uid = cred.uid;
      c->gid = cred.gid;
    }
    // Who it is, before anything it sent is kept: Refuse closes whatever already arrived.
    if (options_.admit_uid) {
      if (!known) {
        Refuse(*c, absl::StrCat("the connection's credentials (SO_PEERCRED) could not be read: ",
                                std::strerror(errno)));
        continue;
      }
      if (!options_.admit_uid(c->uid)) {
        Refuse(*c, absl::StrCat("uid ", c->uid,
                                " may not hand descriptors to this daemon (only the uids that may "
                                "register workers: --worker-uids)"));
        continue;
      }
    }
    if (static_cast<int>(connections_.size()) >= options_.max_connections) {
      Refuse(*c, absl::StrCat("busy: ", options_.max_connections,
                              " deliveries are arriving at once; retry shortly"));
      continue;
    }
    connections_.push_back(std::move(c));
  }
}

void HandleInbox::Refuse(Connection& c, const std::string& why) {
  Logger("worker")->warn(
      "handles: refused a delivery{} from {} after {} packets and {} descriptors: {}",
      c.token.empty() ? "" : " under token " + Short(c.token), c.Who(), c.packets, c.fds.size(),
      why);
  Answer(c.fd.get(), false, 0, why);
  // Read away what the worker already sent: closing a unix socket with unread packets makes the
  // worker's next read fail with ECONNRESET before it reaches this answer. (Workers should read
  // once more after ECONNRESET anyway: a packet sent after this still races the close.)
  for (int i = 0; i < 2 * kMaxHandlesPerPacket; ++i) {
    char data[kHandlePacketBytes];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxHandlesPerPacket)];
    iovec iov{data, sizeof data};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    if (recvmsg(c.fd.get(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT) <= 0) break;
    for (cmsghdr* h = CMSG_FIRSTHDR(&msg); h != nullptr; h = CMSG_NXTHDR(&msg, h)) {
      if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
      for (size_t k = 0; k < (h->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++k) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(h) + k * sizeof(int), sizeof fd);
        close(fd);
      }
    }
  }
  {
    absl::MutexLock lock(&mu_);
    held_fds_ -= static_cast<int64_t>(c.fds.size());
  }
  c.fds.clear();  // closed
  c.fd.Close();
}

struct HandleInbox::Packet {
  char data[kHandlePacketBytes + 1];  // one byte more: a longer packet is refused, not cut
  ssize_t bytes = 0;                  // recvmsg's result
  int error = 0;                      // its errno, where bytes < 0
  int flags = 0;                      // its msg_flags
  std::vector<Fd> fds;
};

struct HandleInbox::PacketHeader {
  std::string token;
  uint32_t count = 0;  // descriptors announced
  uint32_t flags = 0;
};

bool HandleInbox::ReadPacket(Connection& c, absl::Time now) {
  Packet p = Receive(c.fd.get());
  if (p.bytes < 0 && (p.error == EAGAIN || p.error == EWOULDBLOCK || p.error == EINTR)) return true;
  // Every way out below closes the packet's descriptors (p.fds), after the refusal.
  const auto refuse = [&](const absl::Status& why) {
    Refuse(c, std::string(why.message()));
    return false;
  };
  if (p.bytes < 0) {
    Refuse(c, absl::StrCat("receive failed: ", std::strerror(p.error)));
    return false;
  }
  // The worker closed the connection (or sent an empty packet) before the last packet.
  if (p.bytes == 0) {
    Refuse(c, "connection closed (or an empty packet) before the last packet");
    return false;
  }
  ++c.packets;
  c.last_packet = now;
  absl::StatusOr<PacketHeader> header = CheckPacket(p, c);
  if (!header.ok()) return refuse(header.status());
  if (absl::Status s = AdoptToken(c, header->token); !s.ok()) return refuse(s);
  if (absl::Status s = HoldDescriptors(header->token, p.fds.size()); !s.ok()) return refuse(s);
  for (Fd& fd : p.fds) c.fds.push_back(std::move(fd));
  if ((header->flags & kHandleLastPacket) == 0) return true;
  if (absl::Status s = Deliver(c, header->token, now); !s.ok()) return refuse(s);
  return false;
}

HandleInbox::Packet HandleInbox::Receive(int fd) {
  Packet p;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxHandlesPerPacket)];
  iovec iov{p.data, sizeof p.data};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  p.bytes = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (p.bytes < 0) {
    p.error = errno;
    return p;
  }
  p.flags = msg.msg_flags;
  for (cmsghdr* h = CMSG_FIRSTHDR(&msg); h != nullptr; h = CMSG_NXTHDR(&msg, h)) {
    if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
    const size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(h) + i * sizeof(int), sizeof fd);
      p.fds.emplace_back(fd);
    }
  }
  return p;
}

absl::StatusOr<HandleInbox::PacketHeader> HandleInbox::CheckPacket(const Packet& p,
                                                                   const Connection& c) const {
  if (p.flags & MSG_CTRUNC) {
    return absl::InvalidArgumentError(absl::StrCat(
        "packet ", c.packets, ": its descriptors were cut off (more than ", kMaxHandlesPerPacket,
        " in one packet, or the daemon is out of descriptors: raise its RLIMIT_NOFILE)"));
  }
  if ((p.flags & MSG_TRUNC) || p.bytes != static_cast<ssize_t>(kHandlePacketBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("packet ", c.packets, " has ", (p.flags & MSG_TRUNC) ? "more than " : "",
                     p.bytes, " bytes; a handle packet has ", kHandlePacketBytes));
  }
  if (std::memcmp(p.data, kHandleMagic, sizeof kHandleMagic) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("packet ", c.packets,
                     ": bad magic (not a refit handle packet, which starts with \"RFH1\")"));
  }
  PacketHeader header;
  header.token.assign(p.data + 4, kHandleTokenChars);
  header.count = LoadLe32(p.data + 4 + kHandleTokenChars);
  header.flags = LoadLe32(p.data + 8 + kHandleTokenChars);
  if (!IsToken(header.token)) {
    return absl::InvalidArgumentError(absl::StrCat("packet ", c.packets, ": the token must be ",
                                                   kHandleTokenChars, " lowercase hex digits"));
  }
  if (!c.token.empty() && header.token != c.token) {
    return absl::InvalidArgumentError(absl::StrCat(
        "packet ", c.packets, " names another token than the connection's first packet"));
  }
  if (header.count > static_cast<uint32_t>(kMaxHandlesPerPacket)) {
    return absl::InvalidArgumentError(absl::StrCat("packet ", c.packets, " announces ",
                                                   header.count, " descriptors; at most ",
                                                   kMaxHandlesPerPacket, " travel in one packet"));
  }
  if (header.count != p.fds.size()) {
    return absl::InvalidArgumentError(absl::StrCat("packet ", c.packets, " announces ",
                                                   header.count, " descriptors but ", p.fds.size(),
                                                   " arrived"));
  }
  if ((header.flags & ~kHandleLastPacket) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("packet ", c.packets, " has unknown flags 0x", absl::Hex(header.flags)));
  }
  if (static_cast<int64_t>(c.fds.size() + p.fds.size()) > options_.max_fds) {
    return absl::ResourceExhaustedError(
        absl::StrCat("more than ", options_.max_fds, " descriptors in one delivery"));
  }
  return header;
}

absl::Status HandleInbox::AdoptToken(Connection& c, const std::string& token) const {
  if (!c.token.empty()) return absl::OkStatus();
  for (const auto& other : connections_) {
    if (other.get() != &c && other->fd.valid() && other->token == token) {
      return absl::AlreadyExistsError(absl::StrCat(
          "token \"", token,
          "\" is already being delivered on another connection; choose a fresh random token"));
    }
  }
  c.token = token;
  return absl::OkStatus();
}

absl::Status HandleInbox::HoldDescriptors(const std::string& token, size_t n) {
  absl::MutexLock lock(&mu_);
  if (pending_.contains(token)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "duplicate token \"", token,
        "\": a delivery under it is waiting to be claimed; choose a fresh random token"));
  }
  if (held_fds_ + static_cast<int64_t>(n) > options_.max_fds) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon already holds ", held_fds_, " descriptors of deliveries (at most ",
        options_.max_fds, "); register the workers that sent them, or retry after they expire"));
  }
  held_fds_ += static_cast<int64_t>(n);
  return absl::OkStatus();
}

absl::Status HandleInbox::Deliver(Connection& c, const std::string& token, absl::Time now) {
  size_t total = 0;
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int>(pending_.size()) >= options_.max_pending) {
      return absl::ResourceExhaustedError(
          absl::StrCat(options_.max_pending,
                       " deliveries are already waiting to be claimed by "
                       "registrations; register first, or retry after they expire"));
    }
    if (const int of_uid =
            static_cast<int>(std::count_if(pending_.begin(), pending_.end(),
                                           [&](const auto& p) { return p.second.uid == c.uid; }));
        of_uid >= options_.max_pending_per_uid) {
      return absl::ResourceExhaustedError(absl::StrCat(
          of_uid, " deliveries of uid ", c.uid, " are already waiting to be claimed (at most ",
          options_.max_pending_per_uid, " per uid); register first, or retry after they expire"));
    }
    HandleDelivery& d = pending_[token];
    d.fds = std::move(c.fds);
    d.pid = c.pid;
    d.uid = c.uid;
    d.gid = c.gid;
    d.arrived = now;
    total = d.fds.size();  // `d` is Take's once the lock is released
    c.fds.clear();
  }
  Logger("worker")->info("handles: {} descriptors in {} packets under token {} from {}", total,
                         c.packets, Short(token), c.Who());
  Answer(c.fd.get(), true, static_cast<uint32_t>(total), "");
  c.fd.Close();
  return absl::OkStatus();
}

}  // namespace refit
