// Armed rounds on a GPU (daemon/dataplane/cuda/cuda_armed.cc): a round copied within the node is
// launched while its workers prepare (RoundPreparing, on the backend's own thread) and let go by
// its TRANSFER. What a user relies on: a round armed and then called off (Cancel, as the node's
// abort does) writes nothing into the engines' memory, nor one called off before its arming began;
// one let go copies every byte; one armed for a round that never transferred is called off by the
// next round's TRANSFER, which copies; workers slower to prepare than the bound find their round
// still armed; memory released while armed waits for nothing; a backend destroyed while armed does
// not hang. Buffers are the backend's own device memory (AllocateScratch), destinations poisoned
// before every round and checked byte for byte after. Fails where no GPU is present (tagged "gpu":
// CI leaves it out).
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <memory>
#include <vector>

#include "daemon/dataplane/cuda/cuda_backend.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "tests/gpu/needs_gpu.h"

namespace refit {
namespace {

constexpr int64_t kRows = 512, kCols = 1024;  // bf16: rows of 1 KB in each destination shard
constexpr unsigned char kPoisonByte = 0xA5;

int Gpus() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

struct Setup {
  std::unique_ptr<CudaBackend> backend;
  std::vector<std::unique_ptr<MappedBuffer>> src, dst;
  Layout source, destination;
  std::shared_ptr<const Plan> plan;
  std::vector<std::byte> values;  // the whole tensor, row-major

  Setup() {
    auto b = CudaBackend::Start({0}, 64 << 20, false, true, ArmRounds::kAlways);
    INFO(b.status().message());
    REQUIRE(b.ok());
    backend = *std::move(b);
    // Trainer: two row halves; engine: two column halves (TP row-parallel), all on GPU 0.
    testing::AddSplitTensor(source, "w", Dims{kRows, kCols}, DType::kBF16, 0, {0, kRows / 2, kRows},
                            {{0, 0}, {0, 0}}, "fsdp");
    testing::AddSplitTensor(destination, "w", Dims{kRows, kCols}, DType::kBF16, 1,
                            {0, kCols / 2, kCols}, {{0, 0}, {0, 0}}, "tp");
    REQUIRE(ValidateLayout(source, "trainer").ok());
    REQUIRE(ValidateLayout(destination, "inference").ok());
    auto p = MakePlan(source, destination, PlanOptions{});
    INFO(p.status().message());
    REQUIRE(p.ok());
    plan = std::make_shared<const Plan>(*std::move(p));
    values.resize(kRows * kCols * 2);
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
    for (auto [layout, out] : {std::pair{&source, &src}, std::pair{&destination, &dst}}) {
      for (const Buffer& buffer : layout->buffers) {
        auto m = backend->AllocateScratch(layout->workers[buffer.worker], buffer.NumBytes());
        REQUIRE(m.ok());
        out->push_back(*std::move(m));
      }
    }
    // Source shard k: rows [k * kRows / 2, ...), contiguous in the tensor.
    const size_t half = values.size() / 2;
    for (int k = 0; k < 2; ++k) {
      REQUIRE(cudaMemcpy(src[k]->bytes().data(), values.data() + k * half, half,
                         cudaMemcpyHostToDevice) == cudaSuccess);
    }
  }

  TransferJob Job(int64_t round, const std::string& group = "policy") const {
    TransferJob job;
    job.group = group;
    job.round_id = round;
    job.plan = plan;
    for (const auto& m : src) job.src.push_back(m->bytes());
    for (const auto& m : dst) job.dst.push_back(m->bytes());
    job.deadline = absl::Now() + absl::Seconds(20);
    return job;
  }

  // PREPARE as the node sends it to the backend; true once the round is armed (2 s at most).
  bool Prepare(int64_t round, const std::string& group = "policy") {
    backend->RoundPreparing(Job(round, group));
    const absl::Time until = absl::Now() + absl::Seconds(2);
    while (!backend->Armed(group, round)) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Microseconds(200));
    }
    return true;
  }

  void Poison() {
    for (const auto& m : dst)
      REQUIRE(cudaMemset(m->bytes().data(), kPoisonByte, m->bytes().size()) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  }

  // Every destination byte: the tensor's column half, or poison everywhere.
  bool Holds(bool copied) const {
    const size_t row_bytes = kCols * 2, half_row = row_bytes / 2;
    for (int k = 0; k < 2; ++k) {
      std::vector<std::byte> got(dst[k]->bytes().size());
      if (cudaMemcpy(got.data(), dst[k]->bytes().data(), got.size(), cudaMemcpyDeviceToHost) !=
          cudaSuccess)
        return false;
      for (int64_t r = 0; r < kRows; ++r) {
        for (size_t c = 0; c < half_row; ++c) {
          const std::byte want = copied ? values[r * row_bytes + k * half_row + c]
                                        : static_cast<std::byte>(kPoisonByte);
          if (got[r * half_row + c] != want) return false;
        }
      }
    }
    return true;
  }
};

TEST_CASE("an armed round copies when let go and writes nothing when called off") {
  if (Gpus() == 0) FAIL(kNeedsGpu);
  Setup s;
  // Round 1 builds the schedule (nothing to arm before it), then copies as usual.
  s.Poison();
  s.backend->RoundPreparing(s.Job(1));
  s.backend->WorkersPrepared("policy", 1);
  REQUIRE(s.backend->Transfer(s.Job(1)).ok());
  CHECK(s.Holds(true));
  CHECK_FALSE(s.backend->Armed("policy", 1));

  // Round 2: armed, then aborted: the GPU runs what was launched, and it writes nothing.
  s.Poison();
  REQUIRE(s.Prepare(2));
  s.backend->Cancel("policy", 2, "aborted by the test");
  CHECK_FALSE(s.backend->Armed("policy", 2));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(s.Holds(false));

  // Round 50: aborted as soon as its PREPARE came (before or while it is armed): never armed
  // afterwards, nothing written.
  s.Poison();
  s.backend->RoundPreparing(s.Job(50));
  s.backend->Cancel("policy", 50, "aborted by the test");
  for (int i = 0; i < 100; ++i) {
    REQUIRE_FALSE(s.backend->Armed("policy", 50));
    absl::SleepFor(absl::Milliseconds(2));
  }
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(s.Holds(false));

  // Round 3: armed, then let go by its TRANSFER.
  s.Poison();
  REQUIRE(s.Prepare(3));
  auto stats = s.backend->Transfer(s.Job(3));
  INFO(stats.status().message());
  REQUIRE(stats.ok());
  CHECK(s.Holds(true));
  CHECK(stats->bytes_local + stats->bytes_received == kRows * kCols * 2);

  // Round 4 armed but never transferred (its coordinator gave up without an abort reaching here);
  // round 5's TRANSFER calls it off and copies.
  s.Poison();
  REQUIRE(s.Prepare(4));
  REQUIRE(s.backend->Transfer(s.Job(5)).ok());
  CHECK_FALSE(s.backend->Armed("policy", 4));
  CHECK(s.Holds(true));

  // Armed twice without a transfer between: the first is called off, the second let go.
  s.Poison();
  REQUIRE(s.Prepare(6));
  REQUIRE(s.Prepare(7));
  CHECK_FALSE(s.backend->Armed("policy", 6));
  REQUIRE(s.backend->Transfer(s.Job(7)).ok());
  CHECK(s.Holds(true));

  // Many rounds in a row, each let go: every one copies.
  for (int64_t round = 8; round < 40; ++round) {
    s.Poison();
    REQUIRE(s.Prepare(round));
    REQUIRE(s.backend->Transfer(s.Job(round)).ok());
    INFO("round " << round);
    REQUIRE(s.Holds(true));
  }

  // Workers that take longer to prepare than the bound after their answer (PyTorch workers take
  // ~150 ms): still armed when they answer, then let go.
  s.Poison();
  REQUIRE(s.Prepare(42));
  absl::SleepFor(absl::Milliseconds(250));
  CHECK(s.backend->Armed("policy", 42));
  s.backend->WorkersPrepared("policy", 42);
  CHECK(s.backend->Armed("policy", 42));
  REQUIRE(s.backend->Transfer(s.Job(42)).ok());
  CHECK(s.Holds(true));

  // Memory released while a round is armed (a worker left, a plan's scratch freed): called off
  // first, so the release waits for nothing held back on the GPU.
  s.Poison();
  REQUIRE(s.Prepare(43));
  {
    auto extra = s.backend->AllocateScratch(s.source.workers[0], 1 << 20);
    REQUIRE(extra.ok());
    const absl::Time t0 = absl::Now();
    extra->reset();
    CHECK(absl::Now() - t0 < absl::Milliseconds(90));
  }
  CHECK_FALSE(s.backend->Armed("policy", 43));
  REQUIRE(s.backend->Transfer(s.Job(43)).ok());
  CHECK(s.Holds(true));

  // Not let go within the backend's bound after its workers answered (100 ms; say its
  // coordinator stalled): called off by the backend itself, and the TRANSFER that comes late
  // launches the round.
  s.Poison();
  REQUIRE(s.Prepare(41));
  s.backend->WorkersPrepared("policy", 41);
  absl::SleepFor(absl::Milliseconds(300));
  CHECK_FALSE(s.backend->Armed("policy", 41));
  REQUIRE(s.backend->Transfer(s.Job(41)).ok());
  CHECK(s.Holds(true));

  // Armed when the backend goes: its destruction calls the work off instead of waiting forever.
  s.Poison();
  REQUIRE(s.Prepare(40));
  s.src.clear();
  s.dst.clear();
  s.backend.reset();
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
}

// Two groups on one GPU: one armed, the other rebuilding its schedule (a new plan: its old items
// are freed, and a free may wait for the whole GPU) and copying. Nothing waits for the armed wait:
// the rebuild calls it off, and the armed group's own TRANSFER then launches its round itself.
TEST_CASE("a group armed on a GPU holds up no other group's rebuild and copy") {
  if (Gpus() == 0) FAIL(kNeedsGpu);
  Setup s;
  for (const char* group : {"policy", "reward"}) {
    s.Poison();
    REQUIRE(s.backend->Transfer(s.Job(1, group)).ok());
    CHECK(s.Holds(true));
  }
  s.Poison();
  REQUIRE(s.Prepare(2, "policy"));
  TransferJob other = s.Job(2, "reward");
  other.plan = std::make_shared<const Plan>(*s.plan);  // another plan object: rebuilt
  const absl::Time t0 = absl::Now();
  REQUIRE(s.backend->Transfer(other).ok());
  CHECK(absl::Now() - t0 < absl::Milliseconds(90));  // not held until the armed round's bound
  CHECK(s.Holds(true));
  s.Poison();
  REQUIRE(s.backend->Transfer(s.Job(2, "policy")).ok());
  CHECK(s.Holds(true));
}

}  // namespace
}  // namespace refit
