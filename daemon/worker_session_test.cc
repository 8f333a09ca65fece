// Worker sessions on gRPC's callback API: many live sessions cost no thread each (an in-process
// daemon, threads counted in /proc/self/task), and sessions end cleanly: `lost` once per worker
// that vanished (cancelled, half-closed, the daemon stopping), never for one that unregistered;
// events pushed by the registry arrive in order, answers are recorded.
#include "daemon/worker/worker_session.h"

#include <dirent.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/worker/worker_client.h"
#include "common/shared_memory.h"
#include "daemon/daemon.h"
#include "daemon/dataplane/host/host_backend.h"
#include "daemon/testing/test_registrations.h"
#include "daemon/worker/worker_registry.h"

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

// A trainer holding all of "w" [8, 4] f32, its buffer in the memfd `shm`, handed over to the
// handle socket at `handles` under a fresh token.
v1::RegisterWorkerRequest Trainer(const std::string& name, const SharedMemory& shm,
                                  const std::string& handles) {
  v1::RegisterWorkerRequest r = testing::Registration(name, v1::TRAINER, 0, 8, 0);
  v1::SharedMemory* m = r.add_memory()->mutable_shm();
  m->set_fd(1);
  m->set_size(static_cast<int64_t>(shm.bytes().size()));
  const int fds[] = {shm.fd()};
  auto token = DeliverHandles(handles, fds, absl::Now() + absl::Seconds(10));
  INFO(token.status().message());
  REQUIRE(token.ok());
  r.set_fd_token(*token);
  return r;
}

struct Session {
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream;
};

std::unique_ptr<Session> Open(v1::RefitWorker::Stub& stub, const std::string& id,
                              const std::string& key) {
  auto s = std::make_unique<Session>();
  s->stream = stub.Session(&s->ctx);
  v1::WorkerMessage hello;
  hello.set_hello(id);
  hello.set_session_key(key);
  REQUIRE(s->stream->Write(hello));
  return s;
}

// A second session for `id` is refused while the first is attached (bounded: were the second
// attached instead, it would wait for events).
grpc::Status Duplicate(v1::RefitWorker::Stub& stub, const std::string& id, const std::string& key) {
  auto s = std::make_unique<Session>();
  s->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  s->stream = stub.Session(&s->ctx);
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

TEST_CASE(
    "200 live sessions on an in-process daemon add no threads; they end when their workers "
    "vanish") {
  constexpr int kSessions = 200;
  DaemonConfig c;
  c.node = 0;
  c.worker_socket = absl::StrCat("/tmp/refitd-session-test-", getpid(), ".sock");
  c.log_level = "error";
  c.gpus = {0};
  auto started = Daemon::Start(c);
  REQUIRE(started.ok());
  std::unique_ptr<Daemon> daemon = *std::move(started);
  auto shm = SharedMemory::CreateAnonymous("session-test", 8 * 4 * 4);
  REQUIRE(shm.ok());
  const std::string handles = HandleSocketPath("unix:" + c.worker_socket);
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
  std::map<std::string, std::string> keys;
  for (int i = 0; i <= kSessions; ++i) {
    grpc::ClientContext ctx;
    v1::RegisterWorkerResponse out;
    const grpc::Status s =
        workers->Register(&ctx, Trainer(absl::StrCat("t", i), *shm, handles), &out);
    INFO(s.error_message());
    REQUIRE(s.ok());
    ids.push_back(out.worker_id());
    keys[out.worker_id()] = out.session_key();
  }
  // One session first: gRPC starts its own threads on first use, whatever the API.
  std::vector<std::unique_ptr<Session>> sessions;
  // (Nothing tells a client that its hello was taken: the checks for a second session wait a
  // little, or the second could be taken first.)
  sessions.push_back(Open(*workers, ids[0], keys[ids[0]]));
  absl::SleepFor(absl::Milliseconds(500));
  CHECK(Duplicate(*workers, ids[0], keys[ids[0]]).error_code() == grpc::StatusCode::ALREADY_EXISTS);
  const int before = Threads();
  for (int i = 1; i <= kSessions; ++i) sessions.push_back(Open(*workers, ids[i], keys[ids[i]]));
  absl::SleepFor(absl::Milliseconds(1000));
  const int after = Threads();
  // Every one attached: a second session for it is refused.
  for (int i : {1, kSessions / 2, kSessions}) {
    CHECK(Duplicate(*workers, ids[i], keys[ids[i]]).error_code() ==
          grpc::StatusCode::ALREADY_EXISTS);
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
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::RoundEvent>* Session(
      grpc::CallbackServerContext* c) override {
    return sessions_->Start(c);
  }

 private:
  WorkerSessions* const sessions_;
};

TEST_CASE("sessions end cleanly: lost once per vanished worker, never for one that unregistered") {
  auto backend = HostBackend::Start("127.0.0.1:0");
  REQUIRE(backend.ok());
  HandleInboxOptions inbox_options;
  inbox_options.path = absl::StrCat("/tmp/refit-session-test-", getpid(), ".handles");
  auto inbox = HandleInbox::Start(inbox_options);
  REQUIRE(inbox.ok());
  WorkerRegistry registry(0, {}, backend->get(), inbox->get());
  absl::Mutex mu;
  std::map<std::string, int> lost;
  auto sessions =
      std::make_unique<WorkerSessions>(&registry, [&](const std::string& id, const std::string&) {
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

  auto shm = SharedMemory::CreateAnonymous("session-test", 8 * 4 * 4);
  REQUIRE(shm.ok());
  std::vector<std::string> ids;
  std::map<std::string, std::string> keys;
  for (const char* name : {"cancelled", "half_closed", "unregistered", "kept", "broken"}) {
    auto r =
        registry.Register(Trainer(name, *shm, inbox_options.path), WorkerTransport::kInProcess);
    INFO(r.status().message());
    REQUIRE(r.ok());
    ids.push_back(r->worker->id);
    keys[r->worker->id] = r->worker->session_key;
  }
  const std::string &cancelled = ids[0], &half_closed = ids[1], &unregistered = ids[2],
                    &kept = ids[3];

  {  // a session must start with a hello naming a registered worker
    Session bad;
    bad.stream = stub->Session(&bad.ctx);
    v1::WorkerMessage m;
    m.set_prepared(1);
    REQUIRE(bad.stream->Write(m));
    v1::RoundEvent e;
    CHECK_FALSE(bad.stream->Read(&e));
    CHECK(bad.stream->Finish().error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Duplicate(*stub, "policy/nobody", keys[ids[0]]).error_code() ==
          grpc::StatusCode::NOT_FOUND);
    // A hello without its registration's key, or with another's, is refused; the worker is not
    // taken (its own session attaches below).
    CHECK(Duplicate(*stub, ids[0], "").error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(Duplicate(*stub, ids[0], keys[ids[1]]).error_code() ==
          grpc::StatusCode::PERMISSION_DENIED);
  }

  std::map<std::string, std::unique_ptr<Session>> open;
  for (const std::string& id : ids) open[id] = Open(*stub, id, keys[id]);
  auto attached = [&](const std::string& id) {
    std::shared_ptr<LocalWorker> w = registry.Find(id);
    absl::MutexLock lock(&w->mu);
    return w->has_session;
  };
  for (const std::string& id : ids) REQUIRE(Eventually([&] { return attached(id); }));
  for (const std::string& id : ids) {
    CHECK(Duplicate(*stub, id, keys[id]).error_code() == grpc::StatusCode::ALREADY_EXISTS);
    CHECK(Duplicate(*stub, id, "0123456789abcdef0123456789abcdef").error_code() ==
          grpc::StatusCode::PERMISSION_DENIED);
  }
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
  CHECK(
      registry.AwaitWorkers("policy", {kept}, kEvents, false, absl::Seconds(5), "PREPARE", nullptr)
          .ok());

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
  CHECK(lost ==
        std::map<std::string, int>{{cancelled, 1}, {half_closed, 1}, {kept, 1}, {ids[4], 1}});
  CHECK(registry.Find(unregistered) == nullptr);
}

}  // namespace
}  // namespace refit
