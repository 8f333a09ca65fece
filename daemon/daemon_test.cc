// One daemon in process, spoken to over gRPC as workers and operators do: bad input of every kind
// gets the gRPC code a gRPC user expects and a message that names what is wrong, and the daemon
// keeps serving. Then a real round between in-process workers, and a stale version.
#include "daemon/daemon.h"

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "client/worker_client.h"
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
    workers = v1::RefitWorker::NewStub(channel);
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

grpc::Status Register(Cluster& c, const v1::RegisterWorkerRequest& r) {
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
    r.mutable_worker()->mutable_buffers(0)->mutable_pieces(0)->mutable_tensor_box()->set_origin(0, 6);
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT, "lies outside the tensor"));
  }
  SECTION("memory handles do not match the buffers") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.clear_memory();
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT, "1 buffers but 0 memory handles"));
  }
  SECTION("memory that does not exist") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_memory(0)->mutable_shm()->set_size(1 << 20);
    CHECK(Says(Register(c, r), grpc::StatusCode::NOT_FOUND, "/refit-test-none"));
  }
  SECTION("an oversized message") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_worker()->set_name(std::string(300 << 10, 'x'));
    CHECK(Register(c, r).error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  SECTION("a GPU this daemon does not serve") {
    auto r = Request("t0", v1::TRAINER, 0, 8);
    r.mutable_worker()->set_gpu(5);
    CHECK(Says(Register(c, r), grpc::StatusCode::INVALID_ARGUMENT, "GPU 5, which node 0's daemon does not serve"));
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

TEST_CASE("rounds: unknown group, not ready, a real round, stale and repeated versions, double registration") {
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
    CHECK(Says(c.control->StartRefit(&ctx, r, &started), grpc::StatusCode::FAILED_PRECONDITION, "not newer"));
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

}  // namespace
}  // namespace refit
