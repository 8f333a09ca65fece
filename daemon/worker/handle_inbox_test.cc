// The handle socket on the CPU, with memfd descriptors: deliveries in several packets arrive in
// order (each descriptor carries a distinct byte pattern), every malformed packet is refused with
// a message, deadlines and bounds hold, expiry closes, the acceptor survives EMFILE, and no
// descriptor leaks.
#include "daemon/worker/handle_inbox.h"

#include <dirent.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace refit {
namespace {

int OpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  REQUIRE(d != nullptr);
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n - 1;  // the directory's own
}

std::string SocketPath() {
  static std::atomic<int> n{0};
  return absl::StrCat("/tmp/refit-inbox-test-", getpid(), "-", n++, ".sock.handles");
}

std::string Token(int i) {
  std::string t = absl::StrCat(absl::Hex(0xabc00000 + i, absl::kZeroPad8));
  t.resize(32, '0');
  return t;
}

// A memfd holding `value` as its first 4 bytes.
Fd Memfd(uint32_t value) {
  Fd fd(memfd_create("refit-inbox-test", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(pwrite(fd.get(), &value, sizeof value, 0) == sizeof value);
  return fd;
}

uint32_t ValueOf(const Fd& fd) {
  uint32_t v = 0;
  REQUIRE(pread(fd.get(), &v, sizeof v, 0) == sizeof v);
  return v;
}

Fd Connect(const std::string& path) {
  Fd fd(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  REQUIRE(fd.valid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  REQUIRE(connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  timeval tv{5, 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

std::string Header(const std::string& token, uint32_t count, uint32_t flags,
                   const char* magic = "RFH1") {
  std::string p(magic, 4);
  p += token;
  for (uint32_t v : {count, flags}) {
    for (int i = 0; i < 4; ++i) p.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  return p;
}

// Sends one packet: `data` with `fds` attached. False when the daemon has closed the connection.
bool Send(const Fd& socket, const std::string& data, const std::vector<int>& fds) {
  iovec iov{const_cast<char*>(data.data()), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* h = CMSG_FIRSTHDR(&msg);
    h->cmsg_level = SOL_SOCKET;
    h->cmsg_type = SCM_RIGHTS;
    h->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(h), fds.data(), sizeof(int) * fds.size());
  }
  return sendmsg(socket.get(), &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(data.size());
}

struct Answer {
  bool ok = false;
  uint32_t count = 0;
  std::string message;
};

Answer Read(const Fd& socket) {
  char buf[2048];
  ssize_t n = recv(socket.get(), buf, sizeof buf, 0);
  if (n < 0 && errno == ECONNRESET)
    n = recv(socket.get(), buf, sizeof buf, 0);  // the answer is behind it
  REQUIRE(n >= 8);
  Answer a;
  a.ok = std::memcmp(buf, "OK\0\0", 4) == 0;
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(buf[4 + i])} << (8 * i);
  if (a.ok) {
    a.count = v;
  } else {
    REQUIRE(std::memcmp(buf, "ER\0\0", 4) == 0);
    REQUIRE(static_cast<ssize_t>(8 + v) == n);
    a.message.assign(buf + 8, v);
  }
  return a;
}

// Delivers `fds` under `token` in packets of at most `per_packet`.
Answer Deliver(const std::string& path, const std::string& token, const std::vector<Fd>& fds,
               size_t per_packet = 250) {
  Fd s = Connect(path);
  size_t sent = 0;
  do {
    const size_t k = std::min(per_packet, fds.size() - sent);
    std::vector<int> raw;
    for (size_t i = 0; i < k; ++i) raw.push_back(fds[sent + i].get());
    sent += k;
    if (!Send(s, Header(token, static_cast<uint32_t>(k), sent == fds.size() ? 1 : 0), raw)) break;
  } while (sent < fds.size());
  return Read(s);
}

bool Contains(const std::string& s, const std::string& part) {
  INFO(s);
  return s.find(part) != std::string::npos;
}

std::unique_ptr<HandleInbox> Start(HandleInboxOptions o = {}) {
  o.path = SocketPath();
  auto inbox = HandleInbox::Start(o);
  INFO(inbox.status().message());
  REQUIRE(inbox.ok());
  return *std::move(inbox);
}

void WaitUntil(const std::function<bool()>& done) {
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (!done() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  CHECK(done());
}

TEST_CASE("a delivery in several packets arrives whole and in order, once") {
  const int before = OpenFds();
  {
    auto inbox = Start();
    std::vector<Fd> fds;
    for (uint32_t i = 0; i < 600; ++i) fds.push_back(Memfd(1000 + i));
    const Answer a = Deliver(inbox->path(), Token(1), fds);  // 250 + 250 + 100
    INFO(a.message);
    REQUIRE(a.ok);
    CHECK(a.count == 600);
    fds.clear();  // the inbox holds its own copies
    CHECK(inbox->counts().deliveries == 1);
    CHECK(inbox->counts().fds == 600);
    auto d = inbox->Take(Token(1));
    REQUIRE(d.ok());
    REQUIRE(d->fds.size() == 600);
    for (uint32_t i = 0; i < 600; ++i) CHECK(ValueOf(d->fds[i]) == 1000 + i);
    CHECK(d->pid == getpid());
    CHECK(d->uid == getuid());
    CHECK(inbox->counts().fds == 0);
    auto again = inbox->Take(Token(1));
    REQUIRE_FALSE(again.ok());
    CHECK(again.status().code() == absl::StatusCode::kNotFound);
    CHECK(Contains(std::string(again.status().message()), "no handles were delivered under token"));
    CHECK(Contains(std::string(again.status().message()), inbox->path()));

    // One packet with no descriptors at all is a (trivial) delivery; so is one of a single packet.
    CHECK(Deliver(inbox->path(), Token(2), {}).count == 0);
    std::vector<Fd> one;
    one.push_back(Memfd(7));
    CHECK(Deliver(inbox->path(), Token(3), one, 1).count == 1);
    auto d3 = inbox->Take(Token(3));
    REQUIRE(d3.ok());
    CHECK(ValueOf(d3->fds[0]) == 7);
  }
  CHECK(OpenFds() == before);
}

TEST_CASE("malformed packets are refused with a message, and what arrived is closed") {
  const int before = OpenFds();
  {
    auto inbox = Start();
    std::vector<Fd> fds;
    for (uint32_t i = 0; i < 3; ++i) fds.push_back(Memfd(i));
    const std::vector<int> raw = {fds[0].get(), fds[1].get(), fds[2].get()};
    auto refused = [&](const std::string& packet, const std::vector<int>& attached) {
      Fd s = Connect(inbox->path());
      Send(s, packet, attached);
      const Answer a = Read(s);
      CHECK_FALSE(a.ok);
      return a.message;
    };
    CHECK(Contains(refused(Header(Token(1), 3, 1, "XXXX"), raw), "bad magic"));
    CHECK(Contains(refused(Header(Token(1), 3, 1).substr(0, 20), raw),
                   "has 20 bytes; a handle packet has 44"));
    CHECK(Contains(refused(Header(Token(1), 3, 1) + "extra", raw), "more than 45 bytes"));
    CHECK(Contains(refused(Header(Token(1), 2, 1), raw), "announces 2 descriptors but 3 arrived"));
    CHECK(Contains(refused(Header(Token(1), 300, 1), raw), "at most 250"));
    CHECK(Contains(refused(Header(std::string(32, 'A'), 3, 1), raw), "lowercase hex"));
    CHECK(Contains(refused(Header(Token(1), 3, 5), raw), "unknown flags 0x5"));
    {
      Fd s = Connect(inbox->path());
      REQUIRE(Send(s, Header(Token(1), 1, 0), {raw[0]}));
      Send(s, Header(Token(2), 1, 1), {raw[1]});
      const Answer a = Read(s);
      CHECK(Contains(a.message, "another token"));
    }
    // More descriptors than a packet's control buffer holds: cut off by the kernel, refused.
    {
      std::vector<Fd> many;
      std::vector<int> many_raw;
      for (int i = 0; i < 253; ++i) {
        many.push_back(Memfd(i));
        many_raw.push_back(many.back().get());
      }
      CHECK(Contains(refused(Header(Token(1), 253, 1), many_raw), "cut off"));
    }
    // A connection closed before its last packet.
    {
      Fd s = Connect(inbox->path());
      REQUIRE(Send(s, Header(Token(4), 3, 0), raw));
      WaitUntil([&] { return inbox->counts().fds == 3; });
    }
    WaitUntil([&] { return inbox->counts().fds == 0 && inbox->counts().connections == 0; });
    CHECK(inbox->counts().deliveries == 0);
    // The inbox still serves.
    CHECK(Deliver(inbox->path(), Token(5), fds).ok);
  }
  CHECK(OpenFds() == before);
}

TEST_CASE("a duplicate token is refused, the first delivery stays") {
  auto inbox = Start();
  std::vector<Fd> a, b;
  a.push_back(Memfd(1));
  b.push_back(Memfd(2));
  REQUIRE(Deliver(inbox->path(), Token(1), a).ok);
  const Answer dup = Deliver(inbox->path(), Token(1), b);
  CHECK_FALSE(dup.ok);
  CHECK(Contains(dup.message, "duplicate token"));
  auto d = inbox->Take(Token(1));
  REQUIRE(d.ok());
  CHECK(ValueOf(d->fds[0]) == 1);
}

TEST_CASE("unclaimed deliveries expire and are closed; Take says they expired") {
  const int before = OpenFds();
  {
    std::atomic<int64_t> now_s{1000};
    HandleInboxOptions o;
    o.ttl = absl::Seconds(60);
    o.clock = [&] { return absl::FromUnixSeconds(now_s); };
    auto inbox = Start(o);
    std::vector<Fd> fds;
    fds.push_back(Memfd(1));
    REQUIRE(Deliver(inbox->path(), Token(1), fds).ok);
    REQUIRE(Deliver(inbox->path(), Token(2), fds).ok);
    now_s += 59;
    auto kept = inbox->Take(Token(2));
    CHECK(kept.ok());
    now_s += 2;
    auto gone = inbox->Take(Token(1));
    REQUIRE_FALSE(gone.ok());
    CHECK(gone.status().code() == absl::StatusCode::kNotFound);
    CHECK(Contains(std::string(gone.status().message()), "expired unclaimed after 1m"));
    CHECK(inbox->counts().fds == 0);
    CHECK(inbox->counts().deliveries == 0);
  }
  CHECK(OpenFds() == before);
}

TEST_CASE("the loop itself expires deliveries nobody asks for") {
  HandleInboxOptions o;
  o.ttl = absl::Milliseconds(200);
  auto inbox = Start(o);
  std::vector<Fd> fds;
  fds.push_back(Memfd(1));
  REQUIRE(Deliver(inbox->path(), Token(1), fds).ok);
  WaitUntil([&] { return inbox->counts().deliveries == 0 && inbox->counts().fds == 0; });
}

TEST_CASE("bounds: pending deliveries, descriptors per delivery and in all, connections") {
  const int before = OpenFds();
  {
    HandleInboxOptions o;
    o.max_pending = 2;
    o.max_fds = 10;
    o.max_connections = 1;
    auto inbox = Start(o);
    std::vector<Fd> six, eleven, one;
    for (int i = 0; i < 6; ++i) six.push_back(Memfd(i));
    for (int i = 0; i < 11; ++i) eleven.push_back(Memfd(i));
    one.push_back(Memfd(0));
    const Answer big = Deliver(inbox->path(), Token(1), eleven, 4);
    CHECK(Contains(big.message, "more than 10 descriptors in one delivery"));
    REQUIRE(Deliver(inbox->path(), Token(2), six).ok);
    const Answer over = Deliver(inbox->path(), Token(3), six);
    CHECK(Contains(over.message, "already holds 6 descriptors"));
    REQUIRE(Deliver(inbox->path(), Token(4), one).ok);
    const Answer third = Deliver(inbox->path(), Token(5), one);
    CHECK(Contains(third.message, "2 deliveries are already waiting"));
    {
      Fd idle = Connect(inbox->path());
      WaitUntil([&] { return inbox->counts().connections == 1; });
      const Answer busy = Deliver(inbox->path(), Token(6), one);
      CHECK(Contains(busy.message, "busy"));
    }
    CHECK(inbox->Take(Token(2)).ok());
    CHECK(inbox->Take(Token(4)).ok());
    WaitUntil([&] { return inbox->counts().connections == 0; });
    // Once the idle connection is gone, a delivery is taken again. Its close may still be on its
    // way through the inbox's loop (seen under CI load): "busy" until then, nothing else.
    bool taken = false;
    for (const absl::Time until = absl::Now() + absl::Seconds(5); !taken && absl::Now() < until;) {
      const Answer again = Deliver(inbox->path(), Token(7), six);
      taken = again.ok;
      if (!taken) {
        CHECK(Contains(again.message, "busy"));
        absl::SleepFor(absl::Milliseconds(20));
      }
    }
    CHECK(taken);
  }
  CHECK(OpenFds() == before);
}

TEST_CASE("a silent connection is closed after the idle timeout, with what it had sent") {
  HandleInboxOptions o;
  o.idle_timeout = absl::Milliseconds(200);
  auto inbox = Start(o);
  std::vector<Fd> fds;
  fds.push_back(Memfd(1));
  {
    Fd s = Connect(inbox->path());
    const absl::Time t0 = absl::Now();
    const Answer a = Read(s);
    CHECK(Contains(a.message, "no packet for 200ms"));
    CHECK(absl::Now() - t0 < absl::Seconds(2));
  }
  {
    Fd s = Connect(inbox->path());
    REQUIRE(Send(s, Header(Token(1), 1, 0), {fds[0].get()}));
    const Answer a = Read(s);
    CHECK(Contains(a.message, "no packet for"));
  }
  WaitUntil([&] { return inbox->counts().fds == 0 && inbox->counts().connections == 0; });
}

TEST_CASE("the acceptor survives EMFILE and serves again once descriptors are free") {
  auto inbox = Start();
  std::vector<Fd> fds;
  fds.push_back(Memfd(42));
  Fd client(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));  // made before the limit bites
  REQUIRE(client.valid());
  rlimit saved;
  REQUIRE(getrlimit(RLIMIT_NOFILE, &saved) == 0);
  std::vector<Fd> fillers;
  {
    rlimit low = saved;
    low.rlim_cur = static_cast<rlim_t>(OpenFds() + 8);
    REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
    while (true) {  // take every descriptor number left
      Fd f(dup(client.get()));
      if (!f.valid()) break;
      fillers.push_back(std::move(f));
    }
    REQUIRE(errno == EMFILE);
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, inbox->path().data(), inbox->path().size());
  REQUIRE(connect(client.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) ==
          0);                               // in the backlog
  absl::SleepFor(absl::Milliseconds(350));  // accept fails, backs off, fails again
  CHECK(inbox->counts().connections == 0);
  fillers.clear();
  REQUIRE(setrlimit(RLIMIT_NOFILE, &saved) == 0);
  REQUIRE(Send(client, Header(Token(1), 1, 1), {fds[0].get()}));
  timeval tv{5, 0};
  setsockopt(client.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const Answer a = Read(client);
  INFO(a.message);
  CHECK(a.ok);
  auto d = inbox->Take(Token(1));
  REQUIRE(d.ok());
  CHECK(ValueOf(d->fds[0]) == 42);
}

TEST_CASE("the socket path is checked and a stale socket is replaced") {
  HandleInboxOptions o;
  o.path = std::string(200, 'x');
  CHECK(HandleInbox::Start(o).status().code() == absl::StatusCode::kInvalidArgument);
  o.path = SocketPath();
  o.mode = 0600;
  auto first = HandleInbox::Start(o);
  REQUIRE(first.ok());
  auto second = HandleInbox::Start(o);  // as a restarted daemon does
  REQUIRE(second.ok());
  struct stat st;
  REQUIRE(stat(o.path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  first->reset();  // must not remove the socket the second one bound
  CHECK(stat(o.path.c_str(), &st) == 0);
  std::vector<Fd> fds;
  fds.push_back(Memfd(5));
  CHECK(Deliver(o.path, Token(1), fds).ok);
  second->reset();
  CHECK(stat(o.path.c_str(), &st) != 0);
}

TEST_CASE(
    "a connection of a uid not admitted is answered at once, naming its uid, and nothing is kept") {
  const int before = OpenFds();
  {
    HandleInboxOptions o;
    std::vector<uid_t> asked;
    std::mutex asked_mu;
    o.admit_uid = [&](uid_t uid) {
      std::lock_guard<std::mutex> lock(asked_mu);
      asked.push_back(uid);
      return uid != getuid();  // refuses this process: the test speaks as a stranger
    };
    auto inbox = Start(o);
    std::vector<Fd> two;
    two.push_back(Memfd(1));
    two.push_back(Memfd(2));
    const Answer refused = Deliver(inbox->path(), Token(1), two);
    CHECK_FALSE(refused.ok);
    CHECK(Contains(refused.message, absl::StrCat("uid ", getuid(), " may not hand descriptors")));
    // An empty delivery (the queue-filling attack) likewise.
    const Answer empty = Deliver(inbox->path(), Token(2), {});
    CHECK(Contains(empty.message, absl::StrCat("uid ", getuid())));
    WaitUntil([&] { return inbox->counts().connections == 0; });
    const HandleInbox::Counts n = inbox->counts();
    CHECK(n.deliveries == 0);
    CHECK(n.fds == 0);
    CHECK_FALSE(inbox->Take(Token(1)).ok());
    CHECK_FALSE(inbox->Take(Token(2)).ok());
    std::lock_guard<std::mutex> lock(asked_mu);
    CHECK(asked.size() == 2);
    CHECK(std::all_of(asked.begin(), asked.end(), [](uid_t u) { return u == getuid(); }));
  }
  CHECK(OpenFds() == before);
}

TEST_CASE("an admitted uid delivers; one uid's pending deliveries are bounded") {
  const int before = OpenFds();
  {
    HandleInboxOptions o;
    o.max_pending = 10;
    o.max_pending_per_uid = 2;
    o.admit_uid = [](uid_t uid) { return uid == getuid(); };
    auto inbox = Start(o);
    std::vector<Fd> one;
    one.push_back(Memfd(7));
    REQUIRE(Deliver(inbox->path(), Token(1), one).ok);
    REQUIRE(Deliver(inbox->path(), Token(2), {}).ok);
    const Answer third = Deliver(inbox->path(), Token(3), one);
    CHECK_FALSE(third.ok);
    CHECK(Contains(third.message,
                   absl::StrCat("2 deliveries of uid ", getuid(), " are already waiting")));
    CHECK(inbox->counts().deliveries == 2);
    auto taken = inbox->Take(Token(1));
    REQUIRE(taken.ok());
    CHECK(taken->uid == getuid());
    REQUIRE(taken->fds.size() == 1);
    CHECK(ValueOf(taken->fds[0]) == 7);
    CHECK(Deliver(inbox->path(), Token(3), one).ok);  // room again
  }
  CHECK(OpenFds() == before);
}

}  // namespace
}  // namespace refit
