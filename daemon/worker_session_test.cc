// Worker sessions on gRPC's callback API: many live sessions cost no thread each (an in-process
// daemon, threads counted in /proc/self/task), and sessions end cleanly: `lost` once per worker
// that vanished (cancelled, half-closed, the daemon stopping), never for one that unregistered;
// events pushed by the registry arrive in order, answers are recorded.
#include <dirent.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/shared_memory.h"
#include "daemon/daemon.h"
#include "daemon/host_backend.h"
#include "daemon/test_registrations.h"
#include "daemon/worker_registry.h"
#include "daemon/worker_session.h"

namespace refit {
namespace {

using Stream = grpc::ClientReaderWriter<v1::WorkerMessage, v1::RoundEvent>;

int Threads() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  REQUIRE(d != nullptr);
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

// A trainer holding all of "w" [8, 4] f32, its buffer in the named object `shm`.
v1::RegisterWorkerRequest Trainer(const std::string& name, const SharedMemory& shm, const std::string& shm_name) {
  v1::RegisterWorkerRequest r = testing::Registration(name, v1::TRAINER, 0, 8, 0);
  v1::SharedMemory* m = r.add_memory()->mutable_shm();
  m->set_name(shm_name);
  m->set_size(static_cast<int64_t>(shm.bytes().size()));
  return r;
}

struct Session {
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream;
};

std::unique_ptr<Session> Open(v1::RefitWorker::Stub& stub, const std::string& id) {
  auto s = std::make_unique<Session>();
  s->stream = stub.Session(&s->ctx);
  v1::WorkerMessage hello;
  hello.set_hello(id);
  REQUIRE(s->stream->Write(hello));
  return s;
}

// A second session for `id` is refused while the first is attached (bounded: were the second
// attached instead, it would wait for events).
grpc::Status Duplicate(v1::RefitWorker::Stub& stub, const std::string& id) {
  auto s = std::make_unique<Session>();
  s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  s->stream = stub.Session(&s->ctx);
  v1::WorkerMessage hello;
  hello.set_hello(id);
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

TEST_CASE("200 live sessions on an in-process daemon add no threads; they end when their workers vanish") {
  constexpr int kSessions = 200;
  DaemonConfig c;
  c.node = 0;
  c.worker_socket = absl::StrCat("/tmp/refitd-session-test-", getpid(), ".sock");
  c.log_level = "error";
  c.gpus = {0};
  auto started = Daemon::Start(c);
  REQUIRE(started.ok());
  std::unique_ptr<Daemon> daemon = *std::move(started);
  const std::string shm_name = UniqueShmName("session-test");
  auto shm = SharedMemory::Create(shm_name, 8 * 4 * 4);
  REQUIRE(shm.ok());
  auto channel = grpc::CreateChannel("unix:" + c.worker_socket, grpc::InsecureChannelCredentials());
  auto workers = v1::RefitWorker::NewStub(channel);
  auto control = v1::RefitControl::NewStub(
      grpc::CreateChannel(daemon->address(), grpc::InsecureChannelCredentials()));
  auto listed = [&] {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse out;
    REQUIRE(control->ListWorkers(&ctx, v1::ListWorkersRequest(), &out).ok());
    return out.workers_size();
  };
  std::vector<std::string> ids;
  for (int i = 0; i <= kSessions; ++i) {
    grpc::ClientContext ctx;
    v1::RegisterWorkerResponse out;
    const grpc::Status s = workers->Register(&ctx, Trainer(absl::StrCat("t", i), *shm, shm_name), &out);
    INFO(s.error_message());
    REQUIRE(s.ok());
    ids.push_back(out.worker_id());
  }
  // One session first: gRPC starts its own threads on first use, whatever the API.
  std::vector<std::unique_ptr<Session>> sessions;
  // (Nothing tells a client that its hello was taken: the checks for a second session wait a
  // little, or the second could be taken first.)
  sessions.push_back(Open(*workers, ids[0]));
  absl::SleepFor(absl::Milliseconds(500));
  CHECK(Duplicate(*workers, ids[0]).error_code() == grpc::StatusCode::ALREADY_EXISTS);
  const int before = Threads();
  for (int i = 1; i <= kSessions; ++i) sessions.push_back(Open(*workers, ids[i]));
  absl::SleepFor(absl::Milliseconds(1000));
  const int after = Threads();
  // Every one attached: a second session for it is refused.
  for (int i : {1, kSessions / 2, kSessions}) {
    CHECK(Duplicate(*workers, ids[i]).error_code() == grpc::StatusCode::ALREADY_EXISTS);
  }
  WARN("threads with 1 session: " << before << ", with " << kSessions + 1 << ": " << after);
  CHECK(after <= before + 2);  // the sync API took two per session: +400
  CHECK(listed() == kSessions + 1);
  // The workers vanish (their calls cancelled): every session ends, each worker is dropped.
  for (auto& s : sessions) s->ctx.TryCancel();
  for (auto& s : sessions) s->stream->Finish();
  CHECK(Eventually([&] { return listed() == 0; }));
  WARN("threads once they ended: " << Threads());
  // The daemon stops with no session left hanging.
  const absl::Time t0 = absl::Now();
  daemon.reset();
  CHECK(absl::Now() - t0 < absl::Seconds(5));
}

// The sessions alone, against a registry of their own: what `lost` sees.
class SessionOnly : public v1::RefitWorker::CallbackService {
 public:
  explicit SessionOnly(WorkerSessions* sessions) : sessions_(sessions) {}
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::RoundEvent>* Session(grpc::CallbackServerContext* c) override {
    return sessions_->Start(c);
  }

 private:
  WorkerSessions* const sessions_;
};

TEST_CASE("sessions end cleanly: lost once per vanished worker, never for one that unregistered") {
  auto backend = HostBackend::Start("127.0.0.1:0");
  REQUIRE(backend.ok());
  WorkerRegistry registry(0, {}, backend->get(), nullptr);
  absl::Mutex mu;
  std::map<std::string, int> lost;
  auto sessions = std::make_unique<WorkerSessions>(&registry, [&](const std::string& id, const std::string&) {
    {
      absl::MutexLock lock(&mu);
      ++lost[id];
    }
    registry.Drop(id);  // as the daemon's DropWorker does: it notifies no session any more
  });
  SessionOnly service(sessions.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  REQUIRE(port != 0);
  auto stub = v1::RefitWorker::NewStub(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));

  const std::string shm_name = UniqueShmName("session-test");
  auto shm = SharedMemory::Create(shm_name, 8 * 4 * 4);
  REQUIRE(shm.ok());
  std::vector<std::string> ids;
  for (const char* name : {"cancelled", "half_closed", "unregistered", "kept", "broken"}) {
    auto r = registry.Register(Trainer(name, *shm, shm_name));
    INFO(r.status().message());
    REQUIRE(r.ok());
    ids.push_back(r->worker->id);
  }
  const std::string &cancelled = ids[0], &half_closed = ids[1], &unregistered = ids[2], &kept = ids[3];

  {  // a session must start with a hello naming a registered worker
    Session bad;
    bad.stream = stub->Session(&bad.ctx);
    v1::WorkerMessage m;
    m.set_prepared(1);
    REQUIRE(bad.stream->Write(m));
    v1::RoundEvent e;
    CHECK_FALSE(bad.stream->Read(&e));
    CHECK(bad.stream->Finish().error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Duplicate(*stub, "policy/nobody").error_code() == grpc::StatusCode::NOT_FOUND);
  }

  std::map<std::string, std::unique_ptr<Session>> open;
  for (const std::string& id : ids) open[id] = Open(*stub, id);
  auto attached = [&](const std::string& id) {
    std::shared_ptr<LocalWorker> w = registry.Find(id);
    absl::MutexLock lock(&w->mu);
    return w->has_session;
  };
  for (const std::string& id : ids) REQUIRE(Eventually([&] { return attached(id); }));
  for (const std::string& id : ids) CHECK(Duplicate(*stub, id).error_code() == grpc::StatusCode::ALREADY_EXISTS);
  // The refused second sessions are done soon after their client heard so.
  CHECK(Eventually([&] { return sessions->live() == static_cast<int>(ids.size()); }));

  // Events pushed by the registry arrive in order, one write at a time; answers are recorded.
  constexpr int kEvents = 300;
  for (int i = 1; i <= kEvents; ++i) {
    v1::RoundEvent e;
    e.set_kind(v1::RoundEvent::PREPARE);
    e.set_round_id(i);
    REQUIRE(registry.Send({kept}, e, true, false).ok());
  }
  for (int i = 1; i <= kEvents; ++i) {
    v1::RoundEvent e;
    REQUIRE(open[kept]->stream->Read(&e));
    REQUIRE(e.round_id() == i);
  }
  v1::WorkerMessage prepared;
  prepared.set_prepared(kEvents);
  REQUIRE(open[kept]->stream->Write(prepared));
  CHECK(registry.AwaitWorkers("policy", {kept}, kEvents, false, absl::Seconds(5), "PREPARE", nullptr).ok());

  open[cancelled]->ctx.TryCancel();
  open[half_closed]->stream->WritesDone();
  registry.Drop(unregistered);  // what Unregister does (through DropWorker)
  for (const std::string& id : {cancelled, half_closed, unregistered}) {
    v1::RoundEvent e;
    CHECK_FALSE(open[id]->stream->Read(&e));
    const grpc::Status s = open[id]->stream->Finish();
    INFO(id << ": " << s.error_code() << " " << s.error_message());
    CHECK((id == cancelled ? s.error_code() == grpc::StatusCode::CANCELLED : s.ok()));
  }
  CHECK(Eventually([&] { return sessions->live() == 2; }));
  // A worker whose connection breaks mid-write: the client's call dies with its events queued.
  open[ids[4]]->ctx.TryCancel();
  open[ids[4]]->stream->Finish();
  for (int i = 0; i < 50; ++i) registry.SendToGroup("policy", v1::RoundEvent());
  CHECK(Eventually([&] { return sessions->live() == 1; }));

  // The daemon stopping ends the last session: the worker hears UNAVAILABLE, and it is lost.
  registry.Stop();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  CHECK(sessions->WaitIdle(absl::Seconds(5)));
  {
    v1::RoundEvent e;
    while (open[kept]->stream->Read(&e)) {
    }
    CHECK(open[kept]->stream->Finish().error_code() == grpc::StatusCode::UNAVAILABLE);
  }
  absl::MutexLock lock(&mu);
  CHECK(lost == std::map<std::string, int>{{cancelled, 1}, {half_closed, 1}, {kept, 1}, {ids[4], 1}});
  CHECK(registry.Find(unregistered) == nullptr);
}

}  // namespace
}  // namespace refit
