#include "daemon/host_backend.h"

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/shared_memory.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"
#include "plan/verify.h"

namespace refit {
namespace {
using testing::AddSplitTensor;
using testing::EvenSplit;

struct Memory {
  std::vector<std::vector<std::byte>> storage;
  BufferMemory all;
  explicit Memory(const Layout& l) {
    for (const Buffer& b : l.buffers) storage.emplace_back(static_cast<size_t>(b.NumBytes()));
    for (auto& s : storage) all.emplace_back(s.data(), s.size());
  }
  // Only the buffers of workers on `node`: a backend must not touch the others.
  BufferMemory OnNode(const Layout& l, int32_t node) const {
    BufferMemory m(all.size());
    for (size_t b = 0; b < l.buffers.size(); ++b) {
      if (l.workers[l.buffers[b].worker].node == node) m[b] = all[b];
    }
    return m;
  }
};

// Trainer TP2 on node 0; engines on nodes 1 and 2, two replicas each on 2 GPUs: needs network
// messages, NVLink fan-out and relays (stages > 0) between three daemons.
struct Fixture {
  Layout src, dst;
  std::shared_ptr<Plan> plan;
  Fixture() {
    for (int t = 0; t < 6; ++t) {
      const std::string name = absl::StrCat("w", t);
      AddSplitTensor(src, name, Dims{64, 48}, DType::kBF16, 0, EvenSplit(64, 2), {{0, 0}, {0, 1}}, "trainer");
      for (int n = 1; n <= 2; ++n) {
        for (int r = 0; r < 2; ++r) {
          AddSplitTensor(dst, name, Dims{64, 48}, DType::kBF16, 1, EvenSplit(48, 2),
                         {{n, 2 * r}, {n, 2 * r + 1}}, absl::StrCat("engine", n, r, "_"));
        }
      }
    }
    REQUIRE(ValidateLayout(src, "source").ok());
    REQUIRE(ValidateLayout(dst, "destination").ok());
    PlanOptions options;
    options.max_message_bytes = 4096;  // many messages per connection
    options.max_relay_depth = 2;
    auto p = MakePlan(src, dst, options);
    REQUIRE(p.ok());
    plan = std::make_shared<Plan>(*std::move(p));
  }
};

// A job for `node` of the fixture's plan alone: the other two nodes' addresses lead nowhere.
TransferJob LonelyJob(const Fixture& f, const Memory& dst, const HostBackend& self, int32_t node,
                      int64_t round, absl::Duration timeout) {
  TransferJob job;
  job.group = "policy";
  job.round_id = round;
  job.node = node;
  job.plan = f.plan;
  job.src = BufferMemory(f.src.buffers.size());
  job.dst = dst.OnNode(f.dst, node);
  for (int32_t n = 0; n < 3; ++n) job.data_addresses[n] = n == node ? self.data_address() : "127.0.0.1:1";
  job.deadline = absl::Now() + timeout;
  return job;
}

TEST_CASE("three daemons' host backends execute one plan byte for byte, round after round") {
  Fixture f;
  std::vector<std::unique_ptr<HostBackend>> nodes;
  for (int n = 0; n < 3; ++n) {
    auto b = HostBackend::Start("127.0.0.1:0");
    REQUIRE(b.ok());
    nodes.push_back(*std::move(b));
  }
  Memory src(f.src), dst(f.dst);
  for (uint64_t round = 1; round <= 3; ++round) {
    const FillSpec spec = MakeFillSpec(f.src, f.dst, round);
    FillSources(f.src, spec, src.all);
    PoisonDestinations(dst.all);
    std::vector<absl::StatusOr<TransferStats>> results(3, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int n = 0; n < 3; ++n) {
      threads.emplace_back([&, n] {
        TransferJob job;
        job.group = "policy";
        job.round_id = static_cast<int64_t>(round);
        job.node = n;
        job.plan = f.plan;
        job.src = src.OnNode(f.src, n);
        job.dst = dst.OnNode(f.dst, n);
        for (int k = 0; k < 3; ++k) job.data_addresses[k] = nodes[k]->data_address();
        job.deadline = absl::Now() + absl::Seconds(20);
        results[n] = nodes[n]->Transfer(job);
      });
    }
    for (auto& t : threads) t.join();
    int64_t sent = 0, received = 0;
    for (auto& r : results) {
      INFO(r.status().message());
      REQUIRE(r.ok());
      sent += r->bytes_sent;
      received += r->bytes_received;
    }
    CHECK(sent == f.plan->stats.bytes_network);
    CHECK(received == f.plan->stats.bytes_network);
    auto checked = CheckDestinations(f.src, f.dst, spec, dst.all);
    INFO(checked.status().message());
    REQUIRE(checked.ok());
  }
}

TEST_CASE("a daemon that never sends: the receiver's transfer ends at its deadline naming it") {
  Fixture f;
  auto a = HostBackend::Start("127.0.0.1:0");
  REQUIRE(a.ok());
  Memory dst(f.dst);
  const TransferJob job = LonelyJob(f, dst, **a, 1, 7, absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  auto r = (*a)->Transfer(job);
  REQUIRE_FALSE(r.ok());
  CHECK(absl::Now() - start < absl::Seconds(5));
  INFO(r.status().message());
  CHECK((absl::IsDeadlineExceeded(r.status()) || absl::IsUnavailable(r.status())));
  CHECK(std::string(r.status().message()).find("node ") != std::string::npos);
}

TEST_CASE("Cancel ends a waiting transfer with the reason") {
  Fixture f;
  auto a = HostBackend::Start("127.0.0.1:0");
  REQUIRE(a.ok());
  Memory dst(f.dst);
  const TransferJob job = LonelyJob(f, dst, **a, 2, 9, absl::Seconds(30));
  absl::StatusOr<TransferStats> r = absl::UnknownError("not run");
  std::thread t([&] { r = (*a)->Transfer(job); });
  absl::SleepFor(absl::Milliseconds(100));
  (*a)->Cancel("policy", 9, "worker \"engine\" died");
  t.join();
  REQUIRE(absl::IsAborted(r.status()));
  CHECK(std::string(r.status().message()) == "worker \"engine\" died");
}

TEST_CASE("Map refuses what is not shared memory, or does not fit") {
  auto a = HostBackend::Start("127.0.0.1:0");
  REQUIRE(a.ok());
  v1::BufferMemory none;
  CHECK(std::string((*a)->Map(none, 8).status().message()).find("shared memory") != std::string::npos);
  v1::BufferMemory missing;
  missing.mutable_shm()->set_name("/refit-test-does-not-exist");
  missing.mutable_shm()->set_size(64);
  CHECK(absl::IsNotFound((*a)->Map(missing, 8).status()));
  missing.mutable_shm()->set_offset(60);
  CHECK(absl::IsInvalidArgument((*a)->Map(missing, 8).status()));
}

TEST_CASE("buffers of one shared-memory object share one mapping, past Linux's 65,530 per process") {
  auto a = HostBackend::Start("127.0.0.1:0");
  REQUIRE(a.ok());
  constexpr int kBuffers = 70000;  // a worker of a many-expert model: more than vm.max_map_count
  constexpr int64_t kBytes = 64;
  auto shm = SharedMemory::Create(UniqueShmName("maptest"), kBuffers * kBytes);
  REQUIRE(shm.ok());
  std::vector<std::unique_ptr<MappedBuffer>> mapped;
  for (int b = 0; b < kBuffers; ++b) {
    v1::BufferMemory m;
    m.mutable_shm()->set_name(shm->name());
    m.mutable_shm()->set_offset(b * kBytes);
    m.mutable_shm()->set_size(kBuffers * kBytes);
    auto one = (*a)->Map(m, kBytes);
    INFO("buffer " << b << ": " << one.status().message());
    REQUIRE(one.ok());
    mapped.push_back(*std::move(one));
  }
  // Each buffer sees its own bytes of the worker's object, and only those.
  for (int b = 0; b < kBuffers; ++b) std::memset(shm->bytes().data() + b * kBytes, b % 251, kBytes);
  for (int b = 0; b < kBuffers; b += 997) {
    const auto bytes = mapped[b]->bytes();
    REQUIRE(bytes.size() == static_cast<size_t>(kBytes));
    CHECK(std::all_of(bytes.begin(), bytes.end(), [&](std::byte x) { return static_cast<int>(x) == b % 251; }));
  }
  // All of them through one mapping.
  CHECK(mapped[1]->bytes().data() == mapped[0]->bytes().data() + kBytes);
}

}  // namespace
}  // namespace refit
