// One daemon in process, spoken to over gRPC as workers and operators do: bad input of every kind
// gets the gRPC code a gRPC user expects and a message that names what is wrong, and the daemon
// keeps serving. Then a real round between in-process workers, and a stale version; memory
// handed over as descriptors; a worker that refuses PREPARE.
#include "daemon/daemon.h"

#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/worker/worker_client.h"
#include "common/watch_protocol.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {
using testing::AddSplitTensor;
using testing::EvenSplit;

struct Cluster {
  std::unique_ptr<Daemon> daemon;
  std::unique_ptr<v1::RefitWorker::Stub> workers;
  std::unique_ptr<v1::RefitControl::Stub> control;
  std::string socket;

  Cluster() {
    DaemonConfig c;
    c.node = 0;
    c.worker_socket = absl::StrCat("/tmp/refitd-test-", getpid(), ".sock");
    c.max_rpc_bytes = 256 << 10;
    c.prepare_timeout = absl::Seconds(3);
    c.commit_timeout = absl::Seconds(3);
    c.log_level = "warn";
    c.gpus = {0, 1, 2, 3};
    auto d = Daemon::Start(c);
    REQUIRE(d.ok());
    daemon = *std::move(d);
    socket = "unix:" + c.worker_socket;
    auto channel = grpc::CreateChannel(daemon->address(), grpc::InsecureChannelCredentials());
    // Workers on the unix socket, where they belong (and are uid-checked).
    workers =
        v1::RefitWorker::NewStub(grpc::CreateChannel(socket, grpc::InsecureChannelCredentials()));
    control = v1::RefitControl::NewStub(channel);
  }
};

// A one-worker registration for tensor "w" [8, 4]: rows [r0, r1) in a buffer of its own.
v1::RegisterWorkerRequest Request(const std::string& name, v1::Role role, int64_t r0, int64_t r1) {
  Layout l;
  AddSplitTensor(l, "w", Dims{8, 4}, DType::kF32, 0, {r0, r1}, {{0, 0}}, name);
  l.workers[0].name = name;
  const v1::Layout proto = LayoutToProto(l);
  v1::RegisterWorkerRequest r;
  r.set_group("policy");
  r.set_role(role);
  *r.mutable_tensors() = proto.tensors();
  *r.mutable_worker() = proto.workers(0);
  r.add_memory()->mutable_shm()->set_name("/refit-test-none");
  return r;
}

// As a worker registers: with a handle delivery (of no descriptor, unless `r` names one already),
// which identifies its process.
grpc::Status Register(Cluster& c, v1::RegisterWorkerRequest r) {
  if (r.fd_token().empty()) {
    auto token = DeliverHandles(HandleSocketPath(c.socket), {}, absl::Now() + absl::Seconds(5));
    REQUIRE(token.ok());
    r.set_fd_token(*token);
  }
  grpc::ClientContext ctx;
  v1::RegisterWorkerResponse out;
  return c.workers->Register(&ctx, r, &out);
}

bool Says(const grpc::Status& s, grpc::StatusCode code, const std::string& part) {
  INFO(s.error_code() << ": " << s.error_message());
  return s.error_code() == code && s.error_message().find(part) != std::string::npos;
}

TEST_CASE("bad registrations get clear errors and the daemon keeps serving") {
  Cluster c;
  SECTION("no group") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.clear_group();
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT, "\"group\" is empty"));
  }
  SECTION("a piece of an undeclared tensor") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_worker()->mutable_buffers(0)->mutable_pieces(0)->set_tensor("ghost");
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT, "\"ghost\""));
  }
  SECTION("a piece outside its tensor") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_worker()->mutable_buffers(0)->mutable_pieces(0)->mutable_tensor_box()->set_origin(0,
                                                                                                6);
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT, "lies outside the tensor"));
  }
  SECTION("memory handles do not match the buffers") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.clear_memory();
    CHECK(
        Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT, "1 buffers but 0 memory handles"));
  }
  SECTION("memory by name") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_memory(0)->mutable_shm()->set_size(1 << 20);
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT,
               "shared memory by name (\"/refit-test-none\") is refused"));
  }
  SECTION("an oversized message") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_worker()->set_name(std::string(300 << 10, 'x'));
    CHECK(Register(c, r).error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  SECTION("a GPU this daemon does not serve") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_worker()->set_gpu(5);
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT,
               "GPU 5, which node 0's daemon does not serve"));
  }
  SECTION("unknown worker") {
    grpc::ClientContext ctx;
    v1::UnregisterWorkerRequest r;
    r.set_worker_id("policy/nobody");
    v1::UnregisterWorkerResponse out;
    CHECK(Says(c.workers->Unregister(&ctx, r, &out), grpc::StatusCode::NOT_FOUND, "policy/nobody"));
  }
  // Whatever came before, the daemon still answers.
  grpc::ClientContext ctx;
  v1::StatusResponse status;
  CHECK(c.control->Status(&ctx, v1::StatusRequest(), &status).ok());
}

TEST_CASE(
    "rounds: unknown group, not ready, a real round, stale and repeated versions, double "
    "registration") {
  Cluster c;
  auto refit = [&](const std::string& group, int64_t version) {
    grpc::ClientContext ctx;
    v1::RefitRequest r;
    r.set_group(group);
    r.set_version(version);
    v1::RoundStats out;
    return c.control->Refit(&ctx, r, &out);
  };
  CHECK(Says(refit("policy", 1), grpc::StatusCode::NOT_FOUND, "no model group \"policy\""));

  Layout trainer, engine;
  AddSplitTensor(trainer, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "trainer");
  AddSplitTensor(engine, "w", Dims{8, 4}, DType::kF32, 1, EvenSplit(4, 1), {{0, 1}}, "engine");
  REQUIRE(ValidateLayout(trainer, "source").ok());
  REQUIRE(ValidateLayout(engine, "destination").ok());
  std::atomic<int64_t> prepared{0};
  WorkerCallbacks trainer_cb;
  std::unique_ptr<WorkerClient> t;
  trainer_cb.on_prepare = [&](int64_t v) {
    FillSpec spec{static_cast<uint64_t>(v), {false}};
    BufferMemory m = {t->buffer(0)};
    FillSources(trainer, spec, m);
    ++prepared;
    return absl::OkStatus();
  };
  auto tc = WorkerClient::Connect(c.socket, "policy", v1::TRAINER, trainer, trainer_cb);
  REQUIRE(tc.ok());
  t = *std::move(tc);
  // Only one side: the group exists but is not ready, and says why.
  CHECK(Says(refit("policy", 1), grpc::StatusCode::FAILED_PRECONDITION, "0 inference workers"));

  auto e = WorkerClient::Connect(c.socket, "policy", v1::INFERENCE, engine, {});
  REQUIRE(e.ok());
  auto again = WorkerClient::Connect(c.socket, "policy", v1::INFERENCE, engine, {});
  REQUIRE_FALSE(again.ok());
  CHECK(absl::IsAlreadyExists(again.status()));

  CHECK(Says(refit("policy", 0), grpc::StatusCode::INVALID_ARGUMENT, "positive"));
  for (int64_t v : {1, 2}) {
    REQUIRE(refit("policy", v).ok());
    CHECK((*e)->version() == v);
    BufferMemory m = {(*e)->buffer(0)};
    FillSpec spec{static_cast<uint64_t>(v), {false}};
    auto checked = CheckDestinations(trainer, engine, spec, m);
    INFO(checked.status().message());
    CHECK(checked.ok());
  }
  CHECK(prepared == 2);
  CHECK(Says(refit("policy", 2), grpc::StatusCode::FAILED_PRECONDITION, "not newer"));
  CHECK(Says(refit("policy", 1), grpc::StatusCode::FAILED_PRECONDITION, "committed version 2"));

  // Without waiting: checked at once, then the round runs on its own.
  {
    grpc::ClientContext ctx;
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(2);
    v1::StartRefitResponse started;
    CHECK(Says(c.control->StartRefit(&ctx, r, &started), grpc::StatusCode::FAILED_PRECONDITION,
               "not newer"));
  }
  {
    grpc::ClientContext ctx;
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(3);
    v1::StartRefitResponse started;
    REQUIRE(c.control->StartRefit(&ctx, r, &started).ok());
    CHECK(started.round_id() == 3);
  }
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while ((*e)->version() != 3 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(20));
  CHECK((*e)->version() == 3);

  grpc::ClientContext ctx;
  v1::GetPlanRequest pr;
  pr.set_group("policy");
  v1::PlanSummary plan;
  REQUIRE(c.control->GetPlan(&ctx, pr, &plan).ok());
  CHECK(plan.bytes_total() == 8 * 4 * 4);
}

TEST_CASE("an inference side that needs what no trainer holds is not ready, and says how much") {
  Cluster c;
  Layout trainer, engine;
  AddSplitTensor(trainer, "w", Dims{8, 4}, DType::kF32, 0, {0, 6}, {{0, 0}}, "trainer");
  AddSplitTensor(engine, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 1}}, "engine");
  REQUIRE(ValidateLayout(trainer, "source").ok());
  REQUIRE(ValidateLayout(engine, "destination").ok());
  auto t = WorkerClient::Connect(c.socket, "policy", v1::TRAINER, trainer, {});
  auto e = WorkerClient::Connect(c.socket, "policy", v1::INFERENCE, engine, {});
  REQUIRE(t.ok());
  REQUIRE(e.ok());
  grpc::ClientContext ctx;
  v1::StatusResponse status;
  REQUIRE(c.control->Status(&ctx, v1::StatusRequest(), &status).ok());
  REQUIRE(status.groups_size() == 1);
  CHECK_FALSE(status.groups(0).ready());
  INFO(status.groups(0).not_ready_reason());
  CHECK(status.groups(0).not_ready_reason().find("8 of 32 elements") != std::string::npos);
}

int OpenFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n - 1;
}

int Memfd(size_t bytes) {
  const int fd =
      memfd_create("refit-daemon-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);  // the daemon seals it
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, static_cast<off_t>(bytes)) == 0);
  return fd;
}

TEST_CASE(
    "registration with descriptors: each wrong reference is named; descriptors are claimed once "
    "and closed") {
  Cluster c;
  const std::string handles = HandleSocketPath(c.socket);
  const int fd = Memfd(4096);
  auto deliver = [&] {
    const int fds[] = {fd};
    auto token = DeliverHandles(handles, fds, absl::Now() + absl::Seconds(5));
    INFO(token.status().message());
    REQUIRE(token.ok());
    return *token;
  };
  auto by_fd = [&](int32_t index, int64_t size) {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    v1::SharedMemory* m = r.mutable_memory(0)->mutable_shm();
    m->clear_name();
    m->set_fd(index);
    m->set_size(size);
    return r;
  };
  {
    grpc::ClientContext ctx;
    v1::StatusResponse status;
    REQUIRE(c.control->Status(&ctx, v1::StatusRequest(), &status).ok());  // connections made
    grpc::ClientContext wctx;
    v1::UnregisterWorkerRequest nobody;
    nobody.set_worker_id("policy/nobody");
    v1::UnregisterWorkerResponse out;
    REQUIRE(c.workers->Unregister(&wctx, nobody, &out).error_code() == grpc::StatusCode::NOT_FOUND);
  }
  SECTION("a token nothing was delivered under") {
    auto r = by_fd(1, 4096);
    r.set_fd_token(std::string(32, 'a'));
    const grpc::Status s = Register(c, r);
    CHECK(Says(s, grpc::StatusCode::NOT_FOUND, "no handles were delivered under token \"aaaa"));
    CHECK(Says(s, grpc::StatusCode::NOT_FOUND, "(send them over " + handles + " first)"));
  }
  SECTION("a malformed token") {
    auto r = by_fd(1, 4096);
    r.set_fd_token("../../etc");
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT,
               "fd_token must be 32 lowercase hex digits"));
  }
  SECTION("a descriptor index out of range; the delivery is gone with the failed registration") {
    auto r = by_fd(2, 4096);
    r.set_fd_token(deliver());
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT,
               "worker \"t0\": buffer \"w\": its shared memory is descriptor 2 (1-based), but only "
               "1 were handed over"));
    r.mutable_memory(0)->mutable_shm()->set_fd(1);
    CHECK(Says(Register(c, r), grpc::StatusCode::NOT_FOUND, "no handles were delivered"));
  }
  SECTION(
      "descriptors referenced without a token: no delivery, no registration on the unix socket") {
    grpc::ClientContext ctx;
    v1::RegisterWorkerResponse out;
    CHECK(Says(c.workers->Register(&ctx, by_fd(1, 4096), &out), grpc::StatusCode::INVALID_ARGUMENT,
               "named no handle delivery (fd_token)"));
  }
  SECTION("a size the object does not have") {
    auto r = by_fd(1, 8192);
    r.set_fd_token(deliver());
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT,
               "buffer \"w\": its shared memory claims 8192 bytes but descriptor 1 (its shared "
               "memory) has 4096"));
  }
  SECTION("a buffer larger than its object") {
    const int small = Memfd(64);
    const int fds[] = {small};
    auto token = DeliverHandles(handles, fds, absl::Now() + absl::Seconds(5));
    REQUIRE(token.ok());
    auto r = by_fd(1, 64);
    r.set_fd_token(*token);
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT,
               "128 bytes at offset 0 do not fit descriptor 1"));
    close(small);
  }
  SECTION("a GPU UUID on the host backend") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.set_gpu_uuid("GPU-1b2c3d4e-0000-1111-2222-333344445555");
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT,
               "given but this daemon runs --backend host"));
  }
  SECTION("VMM memory on the host backend") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_memory(0)->mutable_cuda_vmm()->set_range(0);
    v1::VmmRange* range = r.add_vmm_ranges();
    range->add_chunk_bytes(4096);
    r.set_fd_token(deliver());
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT, "needs --backend cuda"));
  }
  SECTION("a good one: registered, and the daemon keeps no descriptor of its own") {
    const int before = OpenFds();
    auto r = by_fd(1, 4096);
    r.set_fd_token(deliver());
    REQUIRE(Register(c, r).ok());
    CHECK(OpenFds() == before);  // its copy closed after mapping; the mapping keeps the memory
  }
  close(fd);
}

TEST_CASE(
    "a worker that refuses PREPARE aborts the round at once, with its reason; the next round "
    "commits") {
  Cluster c;
  Layout trainer, engine;
  AddSplitTensor(trainer, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "trainer");
  AddSplitTensor(engine, "w", Dims{8, 4}, DType::kF32, 1, EvenSplit(4, 1), {{0, 1}}, "engine");
  REQUIRE(ValidateLayout(trainer, "source").ok());
  REQUIRE(ValidateLayout(engine, "destination").ok());
  std::atomic<bool> refuse{true};
  std::unique_ptr<WorkerClient> t;
  WorkerCallbacks trainer_cb;
  trainer_cb.on_prepare = [&](int64_t v) -> absl::Status {
    if (refuse) return absl::FailedPreconditionError("NaN in the loss at step 41");
    FillSpec spec{static_cast<uint64_t>(v), {false}};
    BufferMemory m = {t->buffer(0)};
    FillSources(trainer, spec, m);
    return absl::OkStatus();
  };
  auto tc = WorkerClient::Connect(c.socket, "policy", v1::TRAINER, trainer, trainer_cb);
  REQUIRE(tc.ok());
  t = *std::move(tc);
  std::atomic<int> aborts{0};
  WorkerCallbacks engine_cb;
  engine_cb.on_abort = [&](int64_t, const std::string&) { ++aborts; };
  auto e = WorkerClient::Connect(c.socket, "policy", v1::INFERENCE, engine, engine_cb);
  REQUIRE(e.ok());
  CHECK(t->connected());

  // Every round's stats, as an operator watching sees them.
  grpc::ClientContext watch_ctx;
  auto watch = c.control->WatchRounds(&watch_ctx, v1::WatchRoundsRequest());
  watch->WaitForInitialMetadata();  // the daemon says the stream is open before any round
  const auto& metadata = watch_ctx.GetServerInitialMetadata();
  const auto open = metadata.find(kWatchOpenKey);
  REQUIRE(open != metadata.end());
  CHECK(open->second == kWatchOpenValue);
  auto refit = [&](int64_t version) {
    grpc::ClientContext ctx;
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(version);
    v1::RoundStats out;
    return c.control->Refit(&ctx, r, &out);
  };
  const absl::Time t0 = absl::Now();
  const grpc::Status refused = refit(1);
  const absl::Duration took = absl::Now() - t0;
  CHECK(Says(refused, grpc::StatusCode::ABORTED,
             "worker \"policy/trainer0\" on node 0 refused PREPARE of round 1: NaN in the loss at "
             "step 41"));
  CHECK(took < absl::Seconds(1));
  v1::RoundStats stats;
  while (watch->Read(&stats) && stats.state() != v1::RoundStats::ABORTED) {
  }
  CHECK(stats.state() == v1::RoundStats::ABORTED);
  CHECK(stats.round_id() == 1);
  CHECK(stats.reason() ==
        "worker \"policy/trainer0\" on node 0 refused PREPARE of round 1: NaN in the loss at step "
        "41");
  CHECK((*e)->version() == 0);
  const absl::Time until = absl::Now() + absl::Seconds(2);
  while (aborts == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
  CHECK(aborts == 1);  // the engine learned its buffers hold no new version

  refuse = false;
  REQUIRE(refit(2).ok());
  CHECK((*e)->version() == 2);
  BufferMemory m = {(*e)->buffer(0)};
  auto checked = CheckDestinations(trainer, engine, FillSpec{2, {false}}, m);
  INFO(checked.status().message());
  CHECK(checked.ok());
  watch_ctx.TryCancel();
}

TEST_CASE("host memory by descriptor carries a round; by name it is refused") {
  Cluster c;
  Layout trainer, engine;
  AddSplitTensor(trainer, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "trainer");
  AddSplitTensor(engine, "w", Dims{8, 4}, DType::kF32, 1, EvenSplit(4, 1), {{0, 1}}, "engine");
  REQUIRE(ValidateLayout(trainer, "source").ok());
  REQUIRE(ValidateLayout(engine, "destination").ok());
  std::unique_ptr<WorkerClient> t;
  WorkerCallbacks trainer_cb;
  trainer_cb.on_prepare = [&](int64_t v) {
    BufferMemory m = {t->buffer(0)};
    FillSources(trainer, FillSpec{static_cast<uint64_t>(v), {false}}, m);
    return absl::OkStatus();
  };
  auto tc =
      WorkerClient::Connect(c.socket, "policy", v1::TRAINER, trainer, trainer_cb, ConnectOptions());
  REQUIRE(tc.ok());
  t = *std::move(tc);
  auto e = WorkerClient::Connect(c.socket, "policy", v1::INFERENCE, engine, {}, ConnectOptions());
  REQUIRE(e.ok());
  grpc::ClientContext ctx;
  v1::RefitRequest r;
  r.set_group("policy");
  r.set_version(1);
  v1::RoundStats out;
  REQUIRE(c.control->Refit(&ctx, r, &out).ok());
  BufferMemory m = {(*e)->buffer(0)};
  CHECK(CheckDestinations(trainer, engine, FillSpec{1, {false}}, m).ok());
}

TEST_CASE(
    "a refusal on another node aborts the round at once, while a worker elsewhere still prepares") {
  Cluster c;  // node 0, the coordinator
  DaemonConfig n1;
  n1.node = 1;
  n1.coordinator = c.daemon->address();
  n1.worker_socket = absl::StrCat("/tmp/refitd-test-", getpid(), "-1.sock");
  n1.log_level = "warn";
  n1.prepare_timeout = absl::Seconds(3);
  auto node1 = Daemon::Start(n1);
  INFO(node1.status().message());
  REQUIRE(node1.ok());
  Layout trainer, engine;
  AddSplitTensor(trainer, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "trainer");
  AddSplitTensor(engine, "w", Dims{8, 4}, DType::kF32, 1, EvenSplit(4, 1), {{1, 0}}, "engine");
  REQUIRE(ValidateLayout(trainer, "source").ok());
  REQUIRE(ValidateLayout(engine, "destination").ok());
  WorkerCallbacks slow;
  slow.on_prepare = [](int64_t) {
    absl::SleepFor(absl::Milliseconds(2500));  // well past the refusal
    return absl::OkStatus();
  };
  WorkerCallbacks refusing;
  refusing.on_prepare = [](int64_t) {
    return absl::UnavailableError("the engine is sleeping (weights offloaded)");
  };
  auto t = WorkerClient::Connect(c.socket, "policy", v1::TRAINER, trainer, slow);
  REQUIRE(t.ok());
  auto e =
      WorkerClient::Connect("unix:" + n1.worker_socket, "policy", v1::INFERENCE, engine, refusing);
  INFO(e.status().message());
  REQUIRE(e.ok());
  grpc::ClientContext ctx;
  v1::RefitRequest r;
  r.set_group("policy");
  r.set_version(1);
  v1::RoundStats out;
  const absl::Time t0 = absl::Now();
  const grpc::Status s = c.control->Refit(&ctx, r, &out);
  CHECK(absl::Now() - t0 < absl::Seconds(1));
  CHECK(Says(
      s, grpc::StatusCode::ABORTED,
      "worker \"policy/engine0\" on node 1 refused PREPARE of round 1: the engine is sleeping"));
}

// One engine rank: rows [r0, r1) of "w", rank `rank` of replica `replica` of `size` ranks.
Layout EngineRank(const std::string& name, const std::string& replica, int32_t rank, int32_t size,
                  int64_t r0, int64_t r1) {
  Layout l;
  AddSplitTensor(l, "w", Dims{8, 4}, DType::kF32, 0, {r0, r1}, {{0, 0}}, name);
  l.workers[0].name = name;
  l.workers[0].replica = replica;
  l.workers[0].replica_rank = rank;
  l.workers[0].replica_size = size;
  return l;
}

v1::StatusResponse StatusOf(Cluster& c) {
  grpc::ClientContext ctx;
  v1::StatusResponse out;
  REQUIRE(c.control->Status(&ctx, v1::StatusRequest(), &out).ok());
  return out;
}

const v1::ReplicaStatus* ReplicaIn(const v1::StatusResponse& s, const std::string& group,
                                   const std::string& name) {
  for (const auto& g : s.groups()) {
    if (g.name() != group) continue;
    for (const auto& r : g.replicas()) {
      if (r.name() == name) return &r;
    }
  }
  return nullptr;
}

// docs/ROUNDS.md, "Replicas and commit".
TEST_CASE(
    "an engine lost during COMMIT: the round is committed, nobody is sent ABORT, its replica no "
    "longer counts") {
  Cluster c;
  Layout trainer;
  AddSplitTensor(trainer, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "trainer");
  struct Engine {
    std::unique_ptr<WorkerClient> client;
    std::atomic<int> commits{0}, aborts{0};
  };
  Engine a, b, cc, d;  // replica dp0: a, b; replica dp1: cc, d
  std::atomic<bool> d_in_commit{false}, d_gone{false};
  auto callbacks = [](Engine& e) {
    WorkerCallbacks cb;
    cb.on_commit = [&e](int64_t) { ++e.commits; };
    cb.on_abort = [&e](int64_t, const std::string&) { ++e.aborts; };
    return cb;
  };
  std::atomic<int> trainer_aborts{0};
  WorkerCallbacks tcb;
  tcb.on_abort = [&](int64_t, const std::string&) { ++trainer_aborts; };
  auto t = WorkerClient::Connect(c.socket, "policy", v1::TRAINER, trainer, tcb);
  REQUIRE(t.ok());
  auto connect = [&](Engine& e, const Layout& l, WorkerCallbacks cb) {
    ConnectOptions o;
    o.reconnect = false;  // a worker lost stays lost
    auto client = WorkerClient::Connect(c.socket, "policy", v1::INFERENCE, l, std::move(cb), o);
    INFO(client.status().message());
    REQUIRE(client.ok());
    e.client = *std::move(client);
  };
  connect(a, EngineRank("a", "dp0", 0, 2, 0, 4), callbacks(a));
  connect(b, EngineRank("b", "dp0", 1, 2, 4, 8), callbacks(b));
  connect(cc, EngineRank("c", "dp1", 0, 2, 0, 4), callbacks(cc));
  WorkerCallbacks dcb = callbacks(d);
  dcb.on_commit = [&](int64_t) {
    ++d.commits;
    d_in_commit = true;
    const absl::Time until = absl::Now() + absl::Seconds(2);
    while (!d_gone && absl::Now() < until)
      absl::SleepFor(absl::Milliseconds(5));  // lost before it confirms
  };
  connect(d, EngineRank("d", "dp1", 1, 2, 4, 8), dcb);

  auto refit = [&](int64_t version, v1::RoundStats* out) {
    grpc::ClientContext ctx;
    v1::RefitRequest r;
    r.set_group("policy");
    r.set_version(version);
    return c.control->Refit(&ctx, r, out);
  };
  v1::RoundStats stats;
  grpc::Status round;
  std::thread driver([&] { round = refit(1, &stats); });
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (!d_in_commit && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
  REQUIRE(d_in_commit);
  {
    grpc::ClientContext ctx;
    v1::UnregisterWorkerRequest r;
    r.set_worker_id("policy/d");
    r.set_session_key(d.client->session_key());  // as d's own process would
    v1::UnregisterWorkerResponse out;
    REQUIRE(c.workers->Unregister(&ctx, r, &out).ok());  // d is gone, inside its COMMIT
  }
  d_gone = true;
  driver.join();
  INFO(round.error_message());
  REQUIRE(round.ok());
  CHECK(stats.state() == v1::RoundStats::COMMITTED);
  CHECK(stats.commit_note().find("\"policy/d\"") != std::string::npos);
  CHECK(std::vector<std::string>(stats.replicas().begin(), stats.replicas().end()) ==
        std::vector<std::string>{"dp0", "dp1"});
  // Every live worker learnt version 1; none was told ABORT.
  absl::SleepFor(absl::Milliseconds(200));
  for (Engine* e : {&a, &b, &cc}) {
    CHECK(e->commits == 1);
    CHECK(e->aborts == 0);
    CHECK(e->client->version() == 1);
  }
  CHECK(trainer_aborts == 0);

  // dp1 lost its rank 1: Status names it; dp0 holds version 1.
  v1::StatusResponse s = StatusOf(c);
  REQUIRE(ReplicaIn(s, "policy", "dp1") != nullptr);
  CHECK_FALSE(ReplicaIn(s, "policy", "dp1")->complete());
  CHECK(std::vector<int32_t>(ReplicaIn(s, "policy", "dp1")->missing_ranks().begin(),
                             ReplicaIn(s, "policy", "dp1")->missing_ranks().end()) ==
        std::vector<int32_t>{1});
  CHECK(ReplicaIn(s, "policy", "dp1")->problem().find("missing rank 1") != std::string::npos);
  CHECK(ReplicaIn(s, "policy", "dp0")->version() == 1);
  CHECK(s.groups(0).ready());
  CHECK(s.groups(0).complete_replicas() == 1);

  // The next round refits dp0 only: c, half of dp1, is never told COMMIT.
  v1::RoundStats second;
  REQUIRE(refit(2, &second).ok());
  CHECK(std::vector<std::string>(second.replicas().begin(), second.replicas().end()) ==
        std::vector<std::string>{"dp0"});
  CHECK(std::vector<std::string>(second.incomplete_replicas().begin(),
                                 second.incomplete_replicas().end()) ==
        std::vector<std::string>{"dp1"});
  absl::SleepFor(absl::Milliseconds(200));
  CHECK(a.client->version() == 2);
  CHECK(cc.commits == 1);
  CHECK(cc.client->version() == 1);

  // d comes back: dp1 is complete again, but says it missed versions until a round refits it.
  Engine d2;
  connect(d2, EngineRank("d", "dp1", 1, 2, 4, 8), callbacks(d2));
  s = StatusOf(c);
  REQUIRE(ReplicaIn(s, "policy", "dp1") != nullptr);
  CHECK(ReplicaIn(s, "policy", "dp1")->complete());
  CHECK(ReplicaIn(s, "policy", "dp1")->version() == 0);
  CHECK(ReplicaIn(s, "policy", "dp1")->problem().find("missed versions") != std::string::npos);
  REQUIRE(refit(3, &second).ok());
  s = StatusOf(c);
  CHECK(ReplicaIn(s, "policy", "dp1")->version() == 3);
  CHECK(ReplicaIn(s, "policy", "dp1")->problem().empty());
  absl::SleepFor(absl::Milliseconds(200));
  CHECK(cc.client->version() == 3);
  CHECK(d2.client->version() == 3);
}

TEST_CASE(
    "a worker name held on another node is refused at registration; a group without workers is "
    "forgotten") {
  Cluster c;  // node 0, the coordinator
  DaemonConfig n1;
  n1.node = 1;
  n1.coordinator = c.daemon->address();
  n1.worker_socket = absl::StrCat("/tmp/refitd-test-", getpid(), "-1.sock");
  n1.log_level = "warn";
  auto node1 = Daemon::Start(n1);
  INFO(node1.status().message());
  REQUIRE(node1.ok());
  Layout one;
  AddSplitTensor(one, "w", Dims{8, 4}, DType::kF32, 0, {0, 8}, {{0, 0}}, "x");
  one.workers[0].name = "x";
  ConnectOptions o;
  o.reconnect = false;
  auto held = WorkerClient::Connect("unix:" + n1.worker_socket, "policy", v1::TRAINER, one, {}, o);
  REQUIRE(held.ok());
  // On the coordinator's node: refused, naming node 1.
  auto dup = WorkerClient::Connect(c.socket, "policy", v1::TRAINER, one, {}, o);
  REQUIRE_FALSE(dup.ok());
  CHECK(absl::IsAlreadyExists(dup.status()));
  CHECK(std::string(dup.status().message())
            .find("worker \"policy/x\" is already registered on node 1") != std::string::npos);
  // And the other way: held on the coordinator's node, refused on node 1 (learnt from SyncWorkers).
  one.workers[0].name = "y";
  auto y = WorkerClient::Connect(c.socket, "policy", v1::INFERENCE, one, {}, o);
  REQUIRE(y.ok());
  auto dup_y =
      WorkerClient::Connect("unix:" + n1.worker_socket, "policy", v1::INFERENCE, one, {}, o);
  REQUIRE_FALSE(dup_y.ok());
  CHECK(absl::IsAlreadyExists(dup_y.status()));
  CHECK(std::string(dup_y.status().message())
            .find("worker \"policy/y\" is already registered on node 0") != std::string::npos);
  // The group works with the holders: one of each, ready.
  v1::StatusResponse s = StatusOf(c);
  REQUIRE(s.groups_size() == 1);
  CHECK(s.groups(0).ready());
  CHECK(s.groups(0).trainers() == 1);
  CHECK(s.groups(0).inference_workers() == 1);
  // Every worker leaves: the group is forgotten (Status neither lists nor plans it).
  REQUIRE((*held)->Unregister().ok());
  REQUIRE((*y)->Unregister().ok());
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (StatusOf(c).groups_size() != 0 && absl::Now() < until)
    absl::SleepFor(absl::Milliseconds(20));
  CHECK(StatusOf(c).groups_size() == 0);
  grpc::ClientContext ctx;
  v1::RefitRequest r;
  r.set_group("policy");
  r.set_version(1);
  v1::RoundStats out;
  CHECK(Says(c.control->Refit(&ctx, r, &out), grpc::StatusCode::NOT_FOUND,
             "no model group \"policy\""));
}

}  // namespace
}  // namespace refit
