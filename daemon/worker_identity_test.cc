// Workers are local and identified; memory by descriptor only, on an
// in-process daemon spoken to over its unix socket as workers do:
// - a name belongs to its registration: a second Register under it is ALREADY_EXISTS; Unregister
//   and the session's hello need its session key (PERMISSION_DENIED, and the worker stays); once
//   its session died the name is free again and the worker registers anew (a new key);
// - --worker-uids: a registering process whose uid is not listed is PERMISSION_DENIED;
// - shared memory by name is refused and the object named is left alone; an unsealed memfd is
//   sealed by the daemon (the worker's truncate fails, a round still runs); a shm_open object is
//   refused.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/worker/worker_client.h"
#include "common/shared_memory.h"
#include "daemon/daemon.h"
#include "daemon/testing/test_registrations.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"

namespace refit {
namespace {

using Stream = grpc::ClientReaderWriter<v1::WorkerMessage, v1::RoundEvent>;
using testing::AddSplitTensor;
using testing::EvenSplit;

struct Node {
  std::unique_ptr<Daemon> daemon;
  std::string socket;  // "unix:..."
  std::unique_ptr<v1::RefitWorker::Stub> workers;
  std::unique_ptr<v1::RefitControl::Stub> control;

  explicit Node(std::vector<uint32_t> worker_uids = {}, const std::string& tag = "",
                absl::Duration attach_timeout = absl::Seconds(10)) {
    DaemonConfig c;
    c.node = 0;
    c.worker_socket = absl::StrCat("/tmp/refitd-identity-", getpid(), tag, ".sock");
    c.log_level = "warn";
    c.prepare_timeout = absl::Seconds(3);
    c.commit_timeout = absl::Seconds(3);
    c.worker_uids = std::move(worker_uids);
    c.worker_attach_timeout = attach_timeout;
    auto d = Daemon::Start(c);
    INFO(d.status().message());
    REQUIRE(d.ok());
    daemon = *std::move(d);
    socket = "unix:" + c.worker_socket;
    workers =
        v1::RefitWorker::NewStub(grpc::CreateChannel(socket, grpc::InsecureChannelCredentials()));
    control = v1::RefitControl::NewStub(
        grpc::CreateChannel(daemon->address(), grpc::InsecureChannelCredentials()));
  }

  std::string Deliver(std::vector<int> fds) {
    auto token = DeliverHandles(HandleSocketPath(socket), fds, absl::Now() + absl::Seconds(10));
    INFO(token.status().message());
    REQUIRE(token.ok());
    return *token;
  }
  grpc::Status Register(v1::RegisterWorkerRequest r, v1::RegisterWorkerResponse* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return workers->Register(&ctx, r, out);
  }
  grpc::Status Unregister(const std::string& id, const std::string& key) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::UnregisterWorkerRequest r;
    r.set_worker_id(id);
    r.set_session_key(key);
    v1::UnregisterWorkerResponse out;
    return workers->Unregister(&ctx, r, &out);
  }
  std::vector<std::string> Listed() {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse out;
    REQUIRE(control->ListWorkers(&ctx, v1::ListWorkersRequest(), &out).ok());
    std::vector<std::string> ids;
    for (const auto& w : out.workers()) ids.push_back(w.worker_id());
    return ids;
  }
};

// A trainer holding all of "w" [8, 4] f32 in descriptor 1 of `token`'s delivery, of `bytes`.
v1::RegisterWorkerRequest Trainer(const std::string& name, const std::string& token,
                                  int64_t bytes = 128) {
  v1::RegisterWorkerRequest r = testing::Registration(name, v1::TRAINER, 0, 8, 0);
  v1::SharedMemory* m = r.add_memory()->mutable_shm();
  m->set_fd(1);
  m->set_size(bytes);
  r.set_fd_token(token);
  return r;
}

struct Session {
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream;
};

std::unique_ptr<Session> Open(Node& n, const std::string& id, const std::string& key) {
  auto s = std::make_unique<Session>();
  s->stream = n.workers->Session(&s->ctx);
  v1::WorkerMessage hello;
  hello.set_hello(id);
  hello.set_session_key(key);
  REQUIRE(s->stream->Write(hello));
  return s;
}

// What a session with `key` for `id` ends with, bounded (one that was taken would wait for events).
grpc::Status SessionEnd(Node& n, const std::string& id, const std::string& key) {
  auto s = std::make_unique<Session>();
  s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  s->stream = n.workers->Session(&s->ctx);
  v1::WorkerMessage hello;
  hello.set_hello(id);
  hello.set_session_key(key);
  s->stream->Write(hello);
  v1::RoundEvent e;
  while (s->stream->Read(&e)) {
  }
  return s->stream->Finish();
}

template <typename F>
bool Eventually(F f, absl::Duration within = absl::Seconds(10)) {
  const absl::Time until = absl::Now() + within;
  while (!f()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

bool Says(const grpc::Status& s, grpc::StatusCode code, const std::string& part) {
  INFO(s.error_code() << ": " << s.error_message());
  return s.error_code() == code && s.error_message().find(part) != std::string::npos;
}

bool Contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

TEST_CASE(
    "a name belongs to its registration: its key, its session; free again once the session died") {
  Node n;
  auto shm = SharedMemory::CreateAnonymous("identity", 128);
  REQUIRE(shm.ok());
  v1::RegisterWorkerResponse first;
  REQUIRE(n.Register(Trainer("t0", n.Deliver({shm->fd()})), &first).ok());
  REQUIRE(first.worker_id() == "policy/t0");
  REQUIRE(first.session_key().size() == 32);
  std::unique_ptr<Session> live = Open(n, first.worker_id(), first.session_key());
  // `live`'s hello first: a probe below that attached before it would hold the registration,
  // then end it when its deadline passed (a session's end drops its worker). Under CI load the
  // hello took longer than the probe's first try.
  absl::SleepFor(absl::Seconds(2));
  // Attached: a second session of its own is refused too (checked before it could be taken).
  REQUIRE(Eventually([&] {
    return SessionEnd(n, first.worker_id(), first.session_key()).error_code() ==
           grpc::StatusCode::ALREADY_EXISTS;
  }));

  SECTION("another process registering its name: ALREADY_EXISTS") {
    auto other = SharedMemory::CreateAnonymous("impostor", 128);
    REQUIRE(other.ok());
    v1::RegisterWorkerResponse out;
    CHECK(Says(n.Register(Trainer("t0", n.Deliver({other->fd()})), &out),
               grpc::StatusCode::ALREADY_EXISTS, "\"policy/t0\" is already registered"));
    CHECK(out.session_key().empty());
  }
  SECTION("Unregister without its key, or with a wrong one: PERMISSION_DENIED, and it stays") {
    CHECK(Says(n.Unregister(first.worker_id(), ""), grpc::StatusCode::PERMISSION_DENIED,
               "no session key given"));
    std::string wrong = first.session_key();
    wrong[0] = wrong[0] == 'a' ? 'b' : 'a';
    CHECK(Says(n.Unregister(first.worker_id(), wrong), grpc::StatusCode::PERMISSION_DENIED,
               "wrong session key"));
    CHECK(Says(n.Unregister(first.worker_id(), "x"), grpc::StatusCode::PERMISSION_DENIED,
               "wrong session key"));
    absl::SleepFor(absl::Milliseconds(200));  // a drop would go through the executor
    CHECK(Contains(n.Listed(), "policy/t0"));
    // Its session is still the one attached: a hello with a wrong key is refused, not taken.
    CHECK(SessionEnd(n, first.worker_id(), wrong).error_code() ==
          grpc::StatusCode::PERMISSION_DENIED);
    CHECK(SessionEnd(n, first.worker_id(), "").error_code() == grpc::StatusCode::PERMISSION_DENIED);
    // Its own key unregisters it; its session then ends cleanly.
    CHECK(n.Unregister(first.worker_id(), first.session_key()).ok());
    CHECK(Eventually([&] { return !Contains(n.Listed(), "policy/t0"); }));
    v1::RoundEvent e;
    CHECK_FALSE(live->stream->Read(&e));
    CHECK(live->stream->Finish().ok());
  }
  SECTION("its session died (the process exited): the name is free; the worker registers anew") {
    live->ctx.TryCancel();
    live->stream->Finish();
    REQUIRE(Eventually([&] { return !Contains(n.Listed(), "policy/t0"); }));
    v1::RegisterWorkerResponse again;
    grpc::Status s = n.Register(Trainer("t0", n.Deliver({shm->fd()})), &again);
    INFO(s.error_message());
    REQUIRE(s.ok());
    CHECK(again.session_key().size() == 32);
    CHECK(again.session_key() != first.session_key());
    // The old key is worth nothing now.
    CHECK(Says(n.Unregister(again.worker_id(), first.session_key()),
               grpc::StatusCode::PERMISSION_DENIED, "wrong session key"));
    CHECK(SessionEnd(n, again.worker_id(), first.session_key()).error_code() ==
          grpc::StatusCode::PERMISSION_DENIED);
    std::unique_ptr<Session> second = Open(n, again.worker_id(), again.session_key());
    absl::SleepFor(absl::Seconds(2));  // `second`'s hello first, as `live`'s above (it flaked too)
    CHECK(Eventually([&] {
      return SessionEnd(n, again.worker_id(), again.session_key()).error_code() ==
             grpc::StatusCode::ALREADY_EXISTS;
    }));
    CHECK(n.Unregister(again.worker_id(), again.session_key()).ok());
  }
}

TEST_CASE(
    "the C++ worker keeps its key: its session attaches, it unregisters, and it re-registers after "
    "a loss") {
  Node n;
  Layout trainer;
  AddSplitTensor(trainer, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "trainer");
  REQUIRE(ValidateLayout(trainer, "source").ok());
  std::atomic<int> reconnected{0};
  WorkerCallbacks cb;
  cb.on_reconnected = [&](const std::string&) { ++reconnected; };
  auto t = WorkerClient::Connect(n.socket, "policy", v1::TRAINER, trainer, cb, ConnectOptions());
  INFO(t.status().message());
  REQUIRE(t.ok());
  REQUIRE(Eventually([&] { return (*t)->connected(); }));
  const std::string key = (*t)->session_key();
  CHECK(key.size() == 32);
  // The daemon drops it (an operator, with its key): its session ends, it registers anew, a new
  // key.
  REQUIRE(n.Unregister((*t)->worker_id(), key).ok());
  REQUIRE(Eventually([&] { return reconnected.load() == 1; }));
  CHECK((*t)->session_key() != key);
  CHECK(Contains(n.Listed(), (*t)->worker_id()));
  CHECK((*t)->Unregister().ok());
  CHECK(Eventually([&] { return !Contains(n.Listed(), (*t)->worker_id()); }));
}

TEST_CASE("--worker-uids: a process whose uid is not listed may not register") {
  const uint32_t me = static_cast<uint32_t>(geteuid());
  auto shm = SharedMemory::CreateAnonymous("uids", 128);
  REQUIRE(shm.ok());
  {
    Node n({me + 1}, "-other");
    // Its handle delivery is refused already, naming its uid: nothing of it is kept (a uid that
    // may not register cannot fill the handle socket's queue either).
    const int fd = shm->fd();
    auto token = DeliverHandles(HandleSocketPath(n.socket), std::span<const int>(&fd, 1),
                                absl::Now() + absl::Seconds(10));
    REQUIRE_FALSE(token.ok());
    INFO(token.status().message());
    CHECK(absl::StrContains(token.status().message(),
                            absl::StrCat("uid ", me, " may not hand descriptors")));
    // A registration naming some token (none was kept under it) is refused too.
    v1::RegisterWorkerResponse out;
    const grpc::Status s = n.Register(Trainer("t0", std::string(32, 'a')), &out);
    CHECK_FALSE(s.ok());
    CHECK(out.session_key().empty());
    CHECK(n.Listed().empty());
    // Without a delivery there is no uid to check: refused as well, saying what to do.
    v1::RegisterWorkerRequest bare = Trainer("t0", "");
    CHECK(Says(n.Register(bare, &out), grpc::StatusCode::INVALID_ARGUMENT,
               "named no handle delivery"));
  }
  {
    Node n({me + 1, me}, "-listed");
    v1::RegisterWorkerResponse out;
    const grpc::Status s = n.Register(Trainer("t0", n.Deliver({shm->fd()})), &out);
    INFO(s.error_message());
    CHECK(s.ok());
  }
  {
    Node n({}, "-default");  // empty: the daemon's own uid (and root)
    v1::RegisterWorkerResponse out;
    const grpc::Status s = n.Register(Trainer("t0", n.Deliver({shm->fd()})), &out);
    INFO(s.error_message());
    CHECK(s.ok());
  }
}

// Whether a process of `uid` can connect to the unix socket at `path` (a child process).
bool CanConnect(uint32_t uid, const std::string& path) {
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(uid) != 0) _exit(2);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    for (int type : {SOCK_STREAM, SOCK_SEQPACKET, SOCK_DGRAM}) {  // whichever kind the socket is
      const int fd = socket(AF_UNIX, type, 0);
      if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) _exit(0);
      if (errno == EACCES) _exit(1);
      if (errno != EPROTOTYPE) _exit(3);
    }
    _exit(3);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) != 2);
  REQUIRE(WEXITSTATUS(status) != 3);
  return WEXITSTATUS(status) == 0;
}

TEST_CASE("--worker-uids: the listed users can connect to the sockets, no other user can") {
  if (geteuid() != 0) {
    WARN("not root: becoming other users needs setuid");
    return;
  }
  Node n({65533}, "-acl");
  const std::string path = n.socket.substr(std::string("unix:").size());
  for (const std::string& p : {path, HandleSocketPath(n.socket)}) {
    INFO(p);
    struct stat st {};
    REQUIRE(stat(p.c_str(), &st) == 0);
    CHECK((st.st_mode & 0007) == 0);  // never world-writable
    CHECK(CanConnect(65533, p));
    CHECK_FALSE(CanConnect(65534, p));
  }
  Node plain({}, "-noacl");
  CHECK_FALSE(CanConnect(65533, plain.socket.substr(std::string("unix:").size())));
}

TEST_CASE(
    "a registration whose session never opens is dropped after --worker-attach-timeout; its name "
    "registers again") {
  const absl::Duration timeout = absl::Milliseconds(500);
  Node n({}, "-attach", timeout);
  auto shm = SharedMemory::CreateAnonymous("attach", 128);
  REQUIRE(shm.ok());
  // One that attaches at once (another group: it has nothing to do with the parked one).
  v1::RegisterWorkerRequest other = Trainer("v0", n.Deliver({shm->fd()}));
  other.set_group("value");
  v1::RegisterWorkerResponse attached;
  REQUIRE(n.Register(other, &attached).ok());
  std::unique_ptr<Session> live = Open(n, attached.worker_id(), attached.session_key());
  absl::SleepFor(absl::Milliseconds(
      300));  // its hello first: a probe attaching before it would take the session
  REQUIRE(Eventually([&] {
    return SessionEnd(n, attached.worker_id(), attached.session_key()).error_code() ==
           grpc::StatusCode::ALREADY_EXISTS;
  }));
  // One that never opens its session (crashed between Register and its hello).
  const absl::Time registered = absl::Now();
  v1::RegisterWorkerResponse parked;
  REQUIRE(n.Register(Trainer("t0", n.Deliver({shm->fd()})), &parked).ok());
  CHECK(Contains(n.Listed(), "policy/t0"));
  v1::RegisterWorkerResponse refused;
  CHECK(Says(n.Register(Trainer("t0", n.Deliver({shm->fd()})), &refused),
             grpc::StatusCode::ALREADY_EXISTS, "already registered"));
  REQUIRE(Eventually([&] { return !Contains(n.Listed(), "policy/t0"); }, absl::Seconds(5)));
  CHECK(absl::Now() - registered >= timeout);
  // Its key opens no session now.
  CHECK(SessionEnd(n, parked.worker_id(), parked.session_key()).error_code() ==
        grpc::StatusCode::NOT_FOUND);
  // The name registers again; attached, it stays, as does the other one.
  v1::RegisterWorkerResponse again;
  const grpc::Status s = n.Register(Trainer("t0", n.Deliver({shm->fd()})), &again);
  INFO(s.error_message());
  REQUIRE(s.ok());
  std::unique_ptr<Session> second = Open(n, again.worker_id(), again.session_key());
  absl::SleepFor(absl::Milliseconds(
      300));  // its hello first: a probe attaching before it would take the session
  REQUIRE(Eventually([&] {
    return SessionEnd(n, again.worker_id(), again.session_key()).error_code() ==
           grpc::StatusCode::ALREADY_EXISTS;
  }));
  absl::SleepFor(4 * timeout);
  CHECK(Contains(n.Listed(), "policy/t0"));
  CHECK(Contains(n.Listed(), "value/v0"));
  CHECK(n.Unregister(again.worker_id(), again.session_key()).ok());
  CHECK(n.Unregister(attached.worker_id(), attached.session_key()).ok());
}

TEST_CASE(
    "memory by descriptor only: by name refused (the object untouched), unsealed memfds sealed, "
    "shm_open refused") {
  Node n;
  SECTION("by name") {
    auto victim = SharedMemory::Create(UniqueShmName("victim"), 128);
    REQUIRE(victim.ok());
    std::memset(victim->bytes().data(), 0x5a, 128);
    v1::RegisterWorkerRequest r = Trainer("t0", n.Deliver({}));
    r.mutable_memory(0)->mutable_shm()->set_fd(0);
    r.mutable_memory(0)->mutable_shm()->set_name(victim->name());
    v1::RegisterWorkerResponse out;
    const grpc::Status s = n.Register(r, &out);
    CHECK(Says(s, grpc::StatusCode::INVALID_ARGUMENT, "shared memory by name"));
    CHECK(Says(s, grpc::StatusCode::INVALID_ARGUMENT, "handle socket"));
    CHECK(std::all_of(victim->bytes().begin(), victim->bytes().end(),
                      [](std::byte b) { return b == std::byte{0x5a}; }));
    CHECK(n.Listed().empty());
  }
  SECTION("a shm_open descriptor cannot be sealed: refused") {
    const std::string name = UniqueShmName("unsealable");
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    REQUIRE(fd >= 0);
    shm_unlink(name.c_str());
    REQUIRE(ftruncate(fd, 128) == 0);
    v1::RegisterWorkerResponse out;
    const grpc::Status s = n.Register(Trainer("t0", n.Deliver({fd})), &out);
    CHECK(Says(s, grpc::StatusCode::INVALID_ARGUMENT, "buffer \"w\""));
    CHECK(Says(s, grpc::StatusCode::INVALID_ARGUMENT, "cannot be sealed against shrinking"));
    CHECK(n.Listed().empty());
    close(fd);
  }
  SECTION("an unsealed memfd: the daemon seals it; the worker's truncate fails and rounds go on") {
    Layout trainer, engine;
    AddSplitTensor(trainer, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "trainer");
    AddSplitTensor(engine, "w", Dims{8, 4}, DType::kF32, 1, EvenSplit(4, 1), {{0, 1}}, "engine");
    REQUIRE(ValidateLayout(trainer, "source").ok());
    REQUIRE(ValidateLayout(engine, "destination").ok());
    const int fd = memfd_create("refit-unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, 128) == 0);
    void* data = mmap(nullptr, 128, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    REQUIRE(data != MAP_FAILED);
    ConnectOptions own;
    v1::BufferMemory m;
    m.mutable_shm()->set_fd(1);
    m.mutable_shm()->set_size(128);
    own.memory.memory = {m};
    own.memory.fds = {fd};
    WorkerCallbacks tcb;
    tcb.on_prepare = [&](int64_t v) {
      BufferMemory bm = {std::span<std::byte>(static_cast<std::byte*>(data), 128)};
      FillSources(trainer, FillSpec{static_cast<uint64_t>(v), {false}}, bm);
      return absl::OkStatus();
    };
    auto t = WorkerClient::Connect(n.socket, "policy", v1::TRAINER, trainer, tcb, own);
    INFO(t.status().message());
    REQUIRE(t.ok());
    CHECK((fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK) != 0);
    errno = 0;
    CHECK(ftruncate(fd, 0) != 0);  // were it allowed, the daemon would die of SIGBUS in the round
    CHECK(errno == EPERM);
    auto e = WorkerClient::Connect(n.socket, "policy", v1::INFERENCE, engine, {}, ConnectOptions());
    REQUIRE(e.ok());
    grpc::ClientContext ctx;
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(3);
    v1::RoundStats stats;
    const grpc::Status round = n.control->Refit(&ctx, r, &stats);
    INFO(round.error_message());
    REQUIRE(round.ok());
    BufferMemory dst = {(*e)->buffer(0)};
    CHECK(CheckDestinations(trainer, engine, FillSpec{3, {false}}, dst).ok());
    (*t).reset();
    munmap(data, 128);
    close(fd);
  }
}

}  // namespace
}  // namespace refit
