// What a node's registry keeps of a registration and what it refuses: a worker that declares a
// tensor otherwise than the workers of its group and side registered before it is refused at
// Register (not left to make every plan of its group fail), with nothing of it kept; and what a
// registration costs in memory while it registers and once it is registered, counted in bytes
// allocated (every operator new of this test binary), not timed.
#include "daemon/worker/worker_registry.h"

#include <malloc.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/base/culprit.h"
#include "daemon/testing/test_registrations.h"
#include "daemon/worker/registration_check.h"
#include "proto/layout_codec.h"

// Live bytes allocated through operator new, and their high-water mark since the last Reset.
namespace {
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

void* Counted(size_t n) {
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  const int64_t live = g_live.fetch_add(static_cast<int64_t>(malloc_usable_size(p))) +
                       static_cast<int64_t>(malloc_usable_size(p));
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return p;
}
void Uncounted(void* p) {
  if (p == nullptr) return;
  g_live.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)));
  std::free(p);
}
}  // namespace

void* operator new(size_t n) { return Counted(n); }
void* operator new[](size_t n) { return Counted(n); }
void operator delete(void* p) noexcept { Uncounted(p); }
void operator delete[](void* p) noexcept { Uncounted(p); }
void operator delete(void* p, size_t) noexcept { Uncounted(p); }
void operator delete[](void* p, size_t) noexcept { Uncounted(p); }

namespace refit {
namespace {

using testing::WholeTensor;

// The most bytes live at once while `f` runs, above those live when it started.
template <typename F>
int64_t PeakWhile(F&& f) {
  const int64_t start = g_live.load();
  g_peak.store(start);
  f();
  return g_peak.load() - start;
}

// Memory that costs nothing to map, and counts how often it was asked for.
class NullBuffer : public MappedBuffer {
 public:
  std::span<std::byte> bytes() const override { return {}; }
};

class CountingBackend : public DataBackend {
 public:
  std::string name() const override { return "counting"; }
  std::string data_address() const override { return "counting:0"; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> Map(const v1::BufferMemory&, int64_t) override {
    maps.fetch_add(1);
    return std::unique_ptr<MappedBuffer>(new NullBuffer);
  }
  absl::StatusOr<int32_t> GpuIndex(const std::string&) override { return 0; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> AllocateScratch(const Worker&, int64_t) override {
    return absl::UnimplementedError("counting");
  }
  absl::StatusOr<TransferStats> Transfer(const TransferJob&) override { return TransferStats{}; }
  void Cancel(const std::string&, int64_t, const std::string&) override {}
  std::atomic<int> maps{0};
};

v1::RegisterWorkerRequest WithMemory(v1::RegisterWorkerRequest r) {
  for (int b = 0; b < r.worker().buffers_size(); ++b)
    r.add_memory()->mutable_shm()->set_name("unused");
  return r;
}

struct Node {
  CountingBackend backend;
  WorkerRegistry registry{1, {}, &backend, nullptr};
  absl::StatusOr<refit::Registration> Register(const v1::RegisterWorkerRequest& r) {
    return registry.Register(WithMemory(r), WorkerTransport::kInProcess);
  }
};

TEST_CASE(
    "a worker declaring a tensor's shape otherwise than its group's is refused, nothing of it "
    "kept") {
  Node node;
  REQUIRE(node.Register(testing::Registration("t0", v1::TRAINER, 0, 4, 1)).ok());  // "w" [8, 4] f32
  const int maps = node.backend.maps.load();

  const auto wider = node.Register(WholeTensor("t1", v1::TRAINER, "w", Dims{8, 8}, DType::kF32, 1));
  REQUIRE(wider.status().code() == absl::StatusCode::kFailedPrecondition);
  const std::string message(wider.status().message());
  INFO(message);
  CHECK(message.find("tensor \"w\"") != std::string::npos);
  CHECK(message.find("as [8, 8] fp32") != std::string::npos);  // what the refused worker declared
  CHECK(message.find("\"policy/t0\"") != std::string::npos);   // who holds the group's declaration
  CHECK(message.find("declares it as [8, 4] fp32") != std::string::npos);
  CHECK(node.registry.Find("policy/t1") == nullptr);
  CHECK(node.backend.maps.load() == maps);  // its memory was never mapped
  CHECK(node.registry.Snapshot().size() == 1);

  // The group goes on: a trainer that agrees registers, the first keeps its place.
  CHECK(node.Register(testing::Registration("t2", v1::TRAINER, 4, 8, 1)).ok());
  CHECK(node.registry.Find("policy/t0") != nullptr);
}

TEST_CASE(
    "a different dtype is refused too; the other side, another group and other tensors are not") {
  Node node;
  REQUIRE(node.Register(testing::Registration("t0", v1::TRAINER, 0, 8, 1)).ok());  // "w" [8, 4] f32
  const auto bf16 = node.Register(WholeTensor("t1", v1::TRAINER, "w", Dims{8, 4}, DType::kBF16, 1));
  REQUIRE(bf16.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(bf16.status().message()).find("as [8, 4] bf16") != std::string::npos);
  CHECK(std::string(bf16.status().message()).find("trainer \"policy/t0\"") != std::string::npos);

  // The engines' "w" is theirs to declare (an engine may hold another dtype: the planner converts).
  CHECK(node.Register(WholeTensor("e0", v1::INFERENCE, "w", Dims{8, 4}, DType::kBF16, 1)).ok());
  CHECK(
      node.Register(WholeTensor("t0", v1::TRAINER, "w", Dims{8, 8}, DType::kF32, 1, "value")).ok());
  CHECK(node.Register(WholeTensor("t3", v1::TRAINER, "other", Dims{2, 2}, DType::kF32, 1)).ok());
}

TEST_CASE("tensors agree when shape, dtype and quantization all do") {
  v1::RegisterWorkerRequest a =
      WholeTensor("e0", v1::INFERENCE, "w", Dims{256, 128}, DType::kF8E4M3, 1);
  a.mutable_tensors(0)->mutable_quantization()->set_format("block_fp8");
  v1::RegisterWorkerRequest b = a;
  CHECK(CheckSameTensors(b, IndexTensors(b), a, "policy/e0").ok());
  b.mutable_tensors(0)->mutable_quantization()->add_block(64);
  const absl::Status s = CheckSameTensors(b, IndexTensors(b), a, "policy/e0");
  REQUIRE(s.code() == absl::StatusCode::kFailedPrecondition);
  INFO(s.message());
  CHECK(std::string(s.message()).find("quantized block_fp8 [64]") != std::string::npos);
  CHECK(std::string(s.message()).find("inference worker \"policy/e0\"") != std::string::npos);
  b.mutable_tensors(0)->clear_quantization();
  CHECK(!CheckSameTensors(b, IndexTensors(b), a, "policy/e0").ok());
}

TEST_CASE(
    "a worker registering again under its own name is told the name is held, whatever its shapes") {
  Node node;
  REQUIRE(node.Register(testing::Registration("t0", v1::TRAINER, 0, 8, 1)).ok());
  const auto again =
      node.Register(WholeTensor("t0", v1::TRAINER, "w", Dims{16, 4}, DType::kF32, 1));
  CHECK(again.status().code() == absl::StatusCode::kAlreadyExists);
}

TEST_CASE("once the workers that declared a tensor are gone, another shape may register") {
  Node node;
  REQUIRE(node.Register(testing::Registration("t0", v1::TRAINER, 0, 8, 1)).ok());
  REQUIRE(!node.Register(WholeTensor("t1", v1::TRAINER, "w", Dims{16, 4}, DType::kF32, 1)).ok());
  REQUIRE(node.registry.Drop("policy/t0") != nullptr);
  CHECK(node.Register(WholeTensor("t1", v1::TRAINER, "w", Dims{16, 4}, DType::kF32, 1)).ok());
}

// A trainer like the registration benchmark's (tests/bench/registration_memory.h), smaller:
// `tensors` fp32 tensors [rows, 4], each in a flat buffer of its own, one piece per row with both
// boxes.
v1::RegisterWorkerRequest RowsTrainer(const std::string& name, int64_t tensors, int64_t rows) {
  Layout l;
  const int32_t worker = l.AddWorker(name, 0, 0);
  for (int64_t t = 0; t < tensors; ++t) {
    const int32_t tensor =
        l.AddTensor(absl::StrCat("model.layers.", t, ".weight"), Dims{rows, 4}, DType::kF32);
    const int32_t buffer =
        l.AddBuffer(worker, absl::StrCat("flat.", t), DType::kF32, Dims{rows * 4});
    for (int64_t r = 0; r < rows; ++r) {
      l.AddPiece(tensor, Box::FromDims(Dims{r, 0}, Dims{1, 4}), buffer,
                 Box::FromDims(Dims{r * 4}, Dims{4}));
    }
  }
  const v1::Layout proto = LayoutToProto(l);
  v1::RegisterWorkerRequest r;
  r.set_group("regmem");
  r.set_role(v1::TRAINER);
  *r.mutable_tensors() = proto.tensors();
  *r.mutable_worker() = proto.workers(0);
  return WithMemory(std::move(r));
}

TEST_CASE(
    "what the registry keeps is the registration, decoded the same, without its pieces as "
    "messages") {
  Node node;
  v1::RegisterWorkerRequest r = RowsTrainer("t0", 3, 5);
  r.mutable_worker()->set_gpu(2);
  r.mutable_worker()->set_node(7);  // the daemon's own index wins
  r.set_fd_token("");
  auto registered = node.registry.Register(r, WorkerTransport::kInProcess);
  REQUIRE(registered.ok());
  const LocalWorker& w = *registered->worker;

  v1::RegisterWorkerRequest expected = r;
  expected.mutable_worker()->set_node(1);
  expected.clear_memory();
  CHECK(w.Full().SerializeAsString() == expected.SerializeAsString());
  for (const v1::Buffer& b : w.request.worker().buffers()) CHECK(b.pieces().empty());
  CHECK(w.request.memory_size() == 3);  // the handles stay with the node's copy
  CHECK(w.request.worker().node() == 1);
  CHECK(w.request.worker().buffers(2).name() == "flat.2");

  // Sent encoded (as the worker libraries send it), it is kept the same.
  v1::RegisterWorkerRequest encoded = r;
  encoded.set_worker_encoded(r.worker().SerializeAsString());
  encoded.clear_worker();
  Node other;
  auto again = other.registry.Register(encoded, WorkerTransport::kInProcess);
  REQUIRE(again.ok());
  CHECK(again->worker->wire == w.wire);
  CHECK(again->worker->request.SerializeAsString() == w.request.SerializeAsString());
  CHECK(again->pieces == registered->pieces);

  // A sync sends it as it is kept, its worker as `worker_encoded`: the coordinator reads the same
  // registration, and its worker as one string.
  v1::SyncWorkersRequest sync;
  for (v1::RegisterWorkerRequest& each : node.registry.Snapshot())
    *sync.add_workers() = std::move(each);
  v1::SyncWorkersRequest received;
  REQUIRE(received.ParseFromString(sync.SerializeAsString()));
  REQUIRE(received.workers_size() == 1);
  CHECK_FALSE(received.workers(0).has_worker());
  CHECK(!received.workers(0).worker_encoded().empty());
  v1::RegisterWorkerRequest merged = received.workers(0);
  REQUIRE(merged.mutable_worker()->ParseFromString(merged.worker_encoded()));
  merged.clear_worker_encoded();
  CHECK(merged.SerializeAsString() == expected.SerializeAsString());
  // The coordinator's own node keeps the same, decoded but for the worker.
  CHECK(w.WithWorkerEncoded().SerializeAsString() == received.workers(0).SerializeAsString());
}

TEST_CASE("registering costs a few times the registration's size, not a copy of it as messages") {
  // 20 tensors of 1,000 rows: 20,000 pieces, about 0.9 MB encoded.
  const v1::RegisterWorkerRequest r = RowsTrainer("t0", 20, 1000);
  const auto wire = static_cast<int64_t>(r.ByteSizeLong());
  // The measure itself: one copy as messages (what the registry kept, twice over, before) is far
  // above the bound below.
  const int64_t copy = PeakWhile([&] { v1::RegisterWorkerRequest kept = r; });
  INFO("wire " << wire << " bytes; one copy as messages " << copy);
  REQUIRE(copy > 8 * wire);

  Node node;
  const int64_t before = g_live.load();
  const int64_t registering =
      PeakWhile([&] { REQUIRE(node.registry.Register(r, WorkerTransport::kInProcess).ok()); });
  const int64_t kept = g_live.load() - before;
  INFO("registering: peak " << registering << " bytes above the request; kept " << kept);
  CHECK(registering <= 3 * wire);
  CHECK(kept <= 3 * wire / 2);

  std::vector<v1::RegisterWorkerRequest> snapshot;
  const int64_t syncing = PeakWhile([&] { snapshot = node.registry.Snapshot(); });
  INFO("a snapshot: " << syncing << " bytes");
  CHECK(syncing <= 3 * wire / 2);
  snapshot.clear();

  // Nothing stays once it is gone.
  REQUIRE(node.registry.Drop("regmem/t0") != nullptr);
  CHECK(g_live.load() - before < wire / 100);
}

TEST_CASE("a worker sent encoded costs the daemon about its size, and registering it a few times") {
  v1::RegisterWorkerRequest r = RowsTrainer("t0", 20, 1000);
  const auto wire = static_cast<int64_t>(r.ByteSizeLong());
  // What gRPC decodes the request into: one string for the worker, not a message per piece.
  const std::string sent = [&] {
    v1::RegisterWorkerRequest e = r;
    e.set_worker_encoded(e.worker().SerializeAsString());
    e.clear_worker();
    return e.SerializeAsString();
  }();
  v1::RegisterWorkerRequest received;
  const int64_t decoding = PeakWhile([&] { REQUIRE(received.ParseFromString(sent)); });
  INFO("wire " << wire << " bytes; the request as gRPC decodes it " << decoding);
  CHECK(decoding <= 6 * wire / 5);

  Node node;
  const int64_t before = g_live.load();
  const int64_t registering = PeakWhile(
      [&] { REQUIRE(node.registry.Register(received, WorkerTransport::kInProcess).ok()); });
  const int64_t kept = g_live.load() - before;
  INFO("registering: peak " << registering << " bytes above the request; kept " << kept);
  // The request, what registering adds at its peak: within 4x the wire size in all.
  CHECK(decoding + registering <= 4 * wire);
  CHECK(kept <= 3 * wire / 2);
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// A COMMIT is decided: every worker that does not confirm it is named (its replica then holds no
// version), not only the first that left; those still here are awaited all the same.
TEST_CASE("a COMMIT's failure names every worker that left, before it was sent and while awaited") {
  Node node;
  for (const char* name : {"e0", "e1", "e2", "e3"}) {
    REQUIRE(node.Register(testing::Registration(name, v1::INFERENCE, 0, 8, 1)).ok());
  }
  REQUIRE(node.registry.Drop("policy/e0") != nullptr);  // left before the COMMIT was sent
  const std::vector<std::string> ids = {"policy/e0", "policy/e1", "policy/e2", "policy/e3"};
  v1::RoundEvent commit;
  commit.set_kind(v1::RoundEvent::COMMIT);
  commit.set_round_id(7);
  const absl::Status sent = node.registry.Send(ids, commit, false, true);
  CHECK(sent.code() == absl::StatusCode::kAborted);
  CHECK(std::string(sent.message()) == "worker \"policy/e0\" left node 1 before the commit");

  // While the rest are awaited: e1 confirms, e2 leaves, then e3 leaves too (the delays only make
  // the departures likely to come during the wait; the outcome is the same either way).
  std::thread others([&] {
    absl::SleepFor(absl::Milliseconds(20));
    v1::WorkerMessage resumed;
    resumed.set_resumed(7);
    node.registry.Record(*node.registry.Find("policy/e1"), resumed);
    REQUIRE(node.registry.Drop("policy/e2") != nullptr);
    absl::SleepFor(absl::Milliseconds(20));
    REQUIRE(node.registry.Drop("policy/e3") != nullptr);
  });
  const absl::Status confirmed =
      node.registry.AwaitWorkers("policy", {"policy/e1", "policy/e2", "policy/e3"}, 7, true,
                                 absl::Seconds(10), "COMMIT", nullptr);
  others.join();
  CHECK(confirmed.code() == absl::StatusCode::kAborted);
  CHECK(std::string(confirmed.message()) ==
        "workers \"policy/e2\", \"policy/e3\" on node 1 left during COMMIT");
  const auto culprit = CulpritOf(confirmed);
  REQUIRE(culprit.has_value());
  CHECK(culprit->worker_id() == "policy/e2");

  // Several gone at once are all named.
  const absl::Status both =
      node.registry.Send({"policy/e0", "policy/e2", "policy/e3"}, commit, false, true);
  CHECK(std::string(both.message()) ==
        "workers \"policy/e0\", \"policy/e2\", \"policy/e3\" left node 1 before the commit");
}

TEST_CASE("a PREPARE is never queued behind its own round's ABORT") {
  Node node;
  REQUIRE(node.Register(testing::Registration("e0", v1::INFERENCE, 0, 8, 1)).ok());
  LocalWorker& w = *node.registry.Find("policy/e0");
  std::atomic<int64_t> aborted{-1};
  v1::RoundEvent abort, prepare;
  abort.set_kind(v1::RoundEvent::ABORT);
  abort.set_round_id(16);
  prepare.set_kind(v1::RoundEvent::PREPARE);
  prepare.set_round_id(16);

  // The node's ABORT of round 16 marks the round, then queues its event; the PREPARE of the same
  // round, sent on another thread after that, must not follow it.
  aborted.store(16);
  REQUIRE(node.registry.Send({"policy/e0"}, abort, false, false).ok());
  REQUIRE(node.registry.Send({"policy/e0"}, prepare, true, false, &aborted).ok());
  auto first = node.registry.NextForSession(w);
  REQUIRE(first.event.has_value());
  CHECK(first.event->kind() == v1::RoundEvent::ABORT);
  CHECK_FALSE(node.registry.NextForSession(w).event.has_value());

  // The next round (the mark names another) is queued, and so is round 16 once the mark is
  // cleared (round ids start again after a coordinator restart).
  prepare.set_round_id(17);
  REQUIRE(node.registry.Send({"policy/e0"}, prepare, true, false, &aborted).ok());
  aborted.store(-1);
  prepare.set_round_id(16);
  REQUIRE(node.registry.Send({"policy/e0"}, prepare, true, false, &aborted).ok());
  for (int64_t round : {17, 16}) {
    auto next = node.registry.NextForSession(w);
    REQUIRE(next.event.has_value());
    CHECK(next.event->kind() == v1::RoundEvent::PREPARE);
    CHECK(next.event->round_id() == round);
  }
}

}  // namespace
}  // namespace refit
