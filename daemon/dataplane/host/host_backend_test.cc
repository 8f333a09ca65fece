#include "daemon/dataplane/host/host_backend.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/shared_memory.h"
#include "daemon/dataplane/host/data_frame.h"
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
// messages, NVLink fan-out and relays (stages > 0) between three daemons. Larger tensors make a
// transfer last long enough to be cut off midway; `engine_nodes` 1 keeps the engines on node 1.
struct Fixture {
  Layout src, dst;
  std::shared_ptr<Plan> plan;
  explicit Fixture(int tensors = 6, int64_t rows = 64, int64_t cols = 48,
                   int64_t max_message_bytes = 4096, int engine_nodes = 2) {
    for (int t = 0; t < tensors; ++t) {
      const std::string name = absl::StrCat("w", t);
      AddSplitTensor(src, name, Dims{rows, cols}, DType::kBF16, 0, EvenSplit(rows, 2),
                     {{0, 0}, {0, 1}}, "trainer");
      for (int n = 1; n <= engine_nodes; ++n) {
        for (int r = 0; r < (engine_nodes == 1 ? 1 : 2); ++r) {
          AddSplitTensor(dst, name, Dims{rows, cols}, DType::kBF16, 1, EvenSplit(cols, 2),
                         {{n, 2 * r}, {n, 2 * r + 1}}, absl::StrCat("engine", n, r, "_"));
        }
      }
    }
    REQUIRE(ValidateLayout(src, "source").ok());
    REQUIRE(ValidateLayout(dst, "destination").ok());
    PlanOptions options;
    options.max_message_bytes = max_message_bytes;  // many messages per connection
    options.max_relay_depth = 2;
    auto p = MakePlan(src, dst, options);
    REQUIRE(p.ok());
    plan = std::make_shared<Plan>(*std::move(p));
  }
  int nodes() const {
    int n = 0;
    for (const Worker& w : dst.workers) n = std::max(n, w.node + 1);
    return n;
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
  for (int32_t n = 0; n < 3; ++n)
    job.data_addresses[n] = n == node ? self.data_address() : "127.0.0.1:1";
  job.deadline = absl::Now() + timeout;
  return job;
}

// Node `node`'s part of round `round` of the fixture's plan, every node's data address known.
TransferJob RoundJob(const Fixture& f, const Memory& src, const Memory& dst,
                     const std::vector<std::unique_ptr<HostBackend>>& nodes,
                     const std::string& group, uint64_t round, int32_t node) {
  TransferJob job;
  job.group = group;
  job.round_id = static_cast<int64_t>(round);
  job.node = node;
  job.plan = f.plan;
  job.src = src.OnNode(f.src, node);
  job.dst = dst.OnNode(f.dst, node);
  for (int32_t k = 0; k < static_cast<int32_t>(nodes.size()); ++k)
    job.data_addresses[k] = nodes[k]->data_address();
  job.deadline = absl::Now() + absl::Seconds(20);
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
        results[n] = nodes[n]->Transfer(RoundJob(f, src, dst, nodes, "policy", round, n));
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

TEST_CASE(
    "two groups' rounds at once, senders' users checked: every frame lands, round after round") {
  // Each group's round sends to the same nodes on connections of its own; every connection the
  // senders cached stays open (one closed right after its frame was written would fail the
  // receiver's check of its user, and its frame would be lost).
  const Fixture policy, reward(4, 32, 40, 2048);
  std::vector<std::unique_ptr<HostBackend>> nodes;
  for (int n = 0; n < 3; ++n) {
    auto b = HostBackend::Start(
        "127.0.0.1:0", HostBackendOptions{.local_users = std::make_shared<LoopbackUsers>(false)});
    REQUIRE(b.ok());
    nodes.push_back(*std::move(b));
  }
  struct Group {
    std::string name;
    const Fixture* f;
    Memory src, dst;
  };
  Group groups[] = {{"policy", &policy, Memory(policy.src), Memory(policy.dst)},
                    {"reward", &reward, Memory(reward.src), Memory(reward.dst)}};
  for (uint64_t round = 1; round <= 20; ++round) {
    FillSpec specs[2];
    for (int g = 0; g < 2; ++g) {
      specs[g] = MakeFillSpec(groups[g].f->src, groups[g].f->dst, round + 100 * g);
      FillSources(groups[g].f->src, specs[g], groups[g].src.all);
      PoisonDestinations(groups[g].dst.all);
    }
    std::vector<absl::Status> results(6, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int g = 0; g < 2; ++g) {
      for (int n = 0; n < 3; ++n) {
        threads.emplace_back([&, g, n] {
          const Group& in = groups[g];
          results[3 * g + n] =
              nodes[n]
                  ->Transfer(RoundJob(*in.f, in.src, in.dst, nodes, in.name, round, n))
                  .status();
        });
      }
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& r : results) {
      INFO("round " << round << ": " << r.message());
      REQUIRE(r.ok());
    }
    for (int g = 0; g < 2; ++g) {
      auto checked =
          CheckDestinations(groups[g].f->src, groups[g].f->dst, specs[g], groups[g].dst.all);
      INFO(checked.status().message());
      REQUIRE(checked.ok());
    }
  }
  for (const auto& node : nodes) CHECK(node->connection_stats().user_refused == 0);
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

// One registration of `n` buffers of `bytes` each, back to back in the object handed over first.
v1::RegisterWorkerRequest ShmRequest(int n, int64_t bytes, int64_t object_bytes) {
  v1::RegisterWorkerRequest r;
  r.mutable_worker()->set_name("w0");
  for (int b = 0; b < n; ++b) {
    r.mutable_worker()->add_buffers()->set_name(absl::StrCat("b", b));
    v1::SharedMemory* m = r.add_memory()->mutable_shm();
    m->set_fd(1);
    m->set_offset(b * bytes);
    m->set_size(object_bytes);
  }
  return r;
}

std::vector<Fd> Dup(int fd) {
  std::vector<Fd> fds;
  fds.emplace_back(dup(fd));
  REQUIRE(fds.back().valid());
  return fds;
}

bool Has(const absl::Status& s, const std::string& part) {
  INFO(s.ToString());
  return std::string(s.message()).find(part) != std::string::npos;
}

TEST_CASE("shared memory by name is refused, and the named object is never opened") {
  auto a = HostBackend::Start("127.0.0.1:0");
  REQUIRE(a.ok());
  v1::BufferMemory none;
  CHECK(Has((*a)->Map(none, 8).status(), "shared memory"));
  // Another program's object, which a worker names: the daemon must neither read nor write it.
  auto victim = SharedMemory::Create(UniqueShmName("victim"), 64);
  REQUIRE(victim.ok());
  std::memset(victim->bytes().data(), 0x5a, 64);
  v1::BufferMemory named;
  named.mutable_shm()->set_name(victim->name());
  named.mutable_shm()->set_size(64);
  const absl::Status by_map = (*a)->Map(named, 8).status();
  CHECK(absl::IsInvalidArgument(by_map));
  CHECK(Has(by_map, "is refused: the daemon opens no path a worker names"));
  v1::RegisterWorkerRequest r;
  r.mutable_worker()->set_name("w0");
  r.mutable_worker()->add_buffers()->set_name("stolen");
  *r.add_memory() = named;
  const int64_t bytes[] = {64};
  const absl::Status by_register = (*a)->MapBuffers(r, bytes, {}).status();
  CHECK(absl::IsInvalidArgument(by_register));
  CHECK(Has(by_register, "buffer \"stolen\""));
  CHECK(Has(by_register, "hand the object (a sealed memfd) over the handle socket"));
  CHECK(std::all_of(victim->bytes().begin(), victim->bytes().end(),
                    [](std::byte b) { return b == std::byte{0x5a}; }));
}

TEST_CASE("a descriptor that can be sealed is sealed by the daemon; one that cannot is refused") {
  auto a = HostBackend::Start("127.0.0.1:0");
  REQUIRE(a.ok());
  const int64_t bytes[] = {4096};
  SECTION("an unsealed memfd: sealed against shrinking, so the worker's truncate fails") {
    const int fd = memfd_create("refit-seal-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, 4096) == 0);
    REQUIRE((fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK) == 0);
    auto mapped = (*a)->MapBuffers(ShmRequest(1, 4096, 4096), bytes, Dup(fd));
    INFO(mapped.status().message());
    REQUIRE(mapped.ok());
    CHECK((fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK) != 0);
    errno = 0;
    CHECK(ftruncate(fd, 0) != 0);
    CHECK(errno == EPERM);
    // The mapping is whole: touching its last page does not fault.
    std::span<std::byte> b = (*mapped)[0]->bytes();
    b[4095] = std::byte{7};
    CHECK(b[4095] == std::byte{7});
    close(fd);
  }
  SECTION("a memfd sealed (F_SEAL_SEAL) without F_SEAL_SHRINK") {
    const int fd =
        memfd_create("refit-seal-test", MFD_CLOEXEC);  // no MFD_ALLOW_SEALING: F_SEAL_SEAL
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, 4096) == 0);
    const absl::Status s = (*a)->MapBuffers(ShmRequest(1, 4096, 4096), bytes, Dup(fd)).status();
    CHECK(absl::IsInvalidArgument(s));
    CHECK(Has(s, "buffer \"b0\""));
    CHECK(Has(s, "cannot be sealed against shrinking (F_SEAL_SEAL without F_SEAL_SHRINK"));
    CHECK(Has(s, "a truncate by its owner would crash the daemon"));
    close(fd);
  }
  SECTION("a shm_open object cannot be sealed") {
    const std::string name = UniqueShmName("unsealable");
    const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    REQUIRE(fd >= 0);
    shm_unlink(name.c_str());
    REQUIRE(ftruncate(fd, 4096) == 0);
    const absl::Status s = (*a)->MapBuffers(ShmRequest(1, 4096, 4096), bytes, Dup(fd)).status();
    CHECK(absl::IsInvalidArgument(s));
    CHECK(Has(s, "buffer \"b0\""));
    CHECK(Has(s, "cannot be sealed against shrinking"));
    CHECK(Has(s, "a truncate by its owner would crash the daemon"));
    close(fd);
  }
  SECTION("an ordinary file has no seals") {
    char path[] = "/tmp/refit-seal-test-XXXXXX";
    const int fd = mkstemp(path);
    REQUIRE(fd >= 0);
    unlink(path);
    REQUIRE(ftruncate(fd, 4096) == 0);
    const absl::Status s = (*a)->MapBuffers(ShmRequest(1, 4096, 4096), bytes, Dup(fd)).status();
    CHECK(absl::IsInvalidArgument(s));
    CHECK(Has(s, "cannot be sealed against shrinking"));
    close(fd);
  }
  SECTION("a pipe is no shared memory") {
    int p[2];
    REQUIRE(pipe(p) == 0);
    const absl::Status s = (*a)->MapBuffers(ShmRequest(1, 4096, 4096), bytes, Dup(p[0])).status();
    CHECK(absl::IsInvalidArgument(s));
    CHECK(Has(s, "is not a shared-memory object or memfd"));
    close(p[0]);
    close(p[1]);
  }
}

TEST_CASE(
    "buffers of one shared-memory object share one mapping, past Linux's 65,530 per process") {
  auto a = HostBackend::Start("127.0.0.1:0");
  REQUIRE(a.ok());
  constexpr int kBuffers = 70000;  // a worker of a many-expert model: more than vm.max_map_count
  constexpr int64_t kBytes = 64;
  auto shm = SharedMemory::CreateAnonymous("maptest", kBuffers * kBytes);
  REQUIRE(shm.ok());
  const std::vector<int64_t> sizes(kBuffers, kBytes);
  auto many =
      (*a)->MapBuffers(ShmRequest(kBuffers, kBytes, kBuffers * kBytes), sizes, Dup(shm->fd()));
  INFO(many.status().message());
  REQUIRE(many.ok());
  std::vector<std::unique_ptr<MappedBuffer>>& mapped = *many;
  REQUIRE(mapped.size() == static_cast<size_t>(kBuffers));
  // Each buffer sees its own bytes of the worker's object, and only those.
  for (int b = 0; b < kBuffers; ++b) std::memset(shm->bytes().data() + b * kBytes, b % 251, kBytes);
  for (int b = 0; b < kBuffers; b += 997) {
    const auto bytes = mapped[b]->bytes();
    REQUIRE(bytes.size() == static_cast<size_t>(kBytes));
    CHECK(std::all_of(bytes.begin(), bytes.end(),
                      [&](std::byte x) { return static_cast<int>(x) == b % 251; }));
  }
  // All of them through one mapping.
  CHECK(mapped[1]->bytes().data() == mapped[0]->bytes().data() + kBytes);
}

// A sealable memfd of `bytes` (sparse: nothing of it is allocated).
int SparseMemfd(off_t bytes) {
  const int fd = memfd_create("refit-sparse-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(fd >= 0);
  REQUIRE(ftruncate(fd, bytes) == 0);
  return fd;
}

TEST_CASE(
    "a sparse memfd larger than physical memory is refused unmapped; mapped bytes are bounded") {
  const int64_t bytes[] = {128};
  SECTION("40 TiB behind a 128-byte buffer, against this machine's memory") {
    auto a = HostBackend::Start("127.0.0.1:0");
    REQUIRE(a.ok());
    const off_t huge = off_t{40} << 40;
    const int fd = SparseMemfd(huge);
    const absl::Status s = (*a)->MapBuffers(ShmRequest(1, 128, huge), bytes, Dup(fd)).status();
    CHECK(absl::IsInvalidArgument(s));
    CHECK(Has(s, "buffer \"b0\""));
    CHECK(Has(s, absl::StrCat(huge, " bytes, more than this machine's physical memory (")));
    CHECK((*a)->mapped_bytes() == 0);
    close(fd);
  }
  SECTION(
      "configured limits: an object over physical_memory_bytes; mapped bytes over "
      "max_mapped_bytes") {
    HostBackendOptions options;
    options.physical_memory_bytes = 1 << 20;
    options.max_mapped_bytes = 2 << 20;
    auto a = HostBackend::Start("127.0.0.1:0", options);
    REQUIRE(a.ok());
    const int big = SparseMemfd((1 << 20) + 4096);
    const absl::Status over =
        (*a)->MapBuffers(ShmRequest(1, 128, (1 << 20) + 4096), bytes, Dup(big)).status();
    CHECK(absl::IsInvalidArgument(over));
    CHECK(Has(over, "buffer \"b0\""));
    CHECK(Has(over, "has 1052672 bytes, more than this machine's physical memory (1048576 bytes)"));
    close(big);
    std::vector<int> objects;
    for (int i = 0; i < 3; ++i) objects.push_back(SparseMemfd(1 << 20));
    auto first = (*a)->MapBuffers(ShmRequest(1, 128, 1 << 20), bytes, Dup(objects[0]));
    REQUIRE(first.ok());
    // The same object again is the same mapping: it counts once.
    auto again = (*a)->MapBuffers(ShmRequest(1, 128, 1 << 20), bytes, Dup(objects[0]));
    REQUIRE(again.ok());
    auto second = (*a)->MapBuffers(ShmRequest(1, 128, 1 << 20), bytes, Dup(objects[1]));
    REQUIRE(second.ok());
    CHECK((*a)->mapped_bytes() == 2 << 20);
    const absl::Status full =
        (*a)->MapBuffers(ShmRequest(1, 128, 1 << 20), bytes, Dup(objects[2])).status();
    CHECK(absl::IsResourceExhausted(full));
    CHECK(Has(full, "buffer \"b0\""));
    CHECK(Has(full, "max_mapped_bytes (2097152 bytes)"));
    CHECK((*a)->mapped_bytes() == 2 << 20);
    // Unmapped when its last buffer goes: then there is room.
    first->clear();
    CHECK((*a)->mapped_bytes() == 2 << 20);  // `again` still maps it
    again->clear();
    CHECK((*a)->mapped_bytes() == 1 << 20);
    auto third = (*a)->MapBuffers(ShmRequest(1, 128, 1 << 20), bytes, Dup(objects[2]));
    INFO(third.status().message());
    REQUIRE(third.ok());
    CHECK((*a)->mapped_bytes() == 2 << 20);
    second->clear();
    third->clear();
    CHECK((*a)->mapped_bytes() == 0);
    for (int fd : objects) close(fd);
  }
}

// ---------------------------------------------------------------------------------------------
// Connections: what they hold, how they end, the bound; rounds after an abort.

int64_t CountEntries(const char* dir) {
  int64_t n = 0;
  DIR* d = opendir(dir);
  if (d == nullptr) return -1;
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n - (std::string(dir) == "/proc/self/fd");  // opendir's own descriptor
}
int64_t Threads() { return CountEntries("/proc/self/task"); }
int64_t Fds() { return CountEntries("/proc/self/fd"); }

bool Eventually(const std::function<bool()>& done, absl::Duration timeout = absl::Seconds(10)) {
  const absl::Time until = absl::Now() + timeout;
  while (!done()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

// A peer as the wire sees it.
Fd Dial(const std::string& address) {
  auto c = TcpConnect(address, absl::Now() + absl::Seconds(5));
  INFO(c.status().message());
  REQUIRE(c.ok());
  return *std::move(c);
}

// Whether the other end closed `fd` (end of stream or reset) within `timeout`.
bool ClosedWithin(const Fd& fd, absl::Duration timeout) {
  pollfd p{fd.get(), POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) <= 0) return false;
  char b;
  const ssize_t n = recv(fd.get(), &b, 1, MSG_DONTWAIT | MSG_PEEK);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

void SendBytes(const Fd& fd, const void* data, size_t n) {
  REQUIRE(SendAll(fd, {static_cast<const std::byte*>(data), n}, absl::Now() + absl::Seconds(5),
                  "backend")
              .ok());
}

// The data plane's frame header, as a peer sends it (host_backend.cc).
struct WireHeader {
  uint32_t magic = 0x31544652;
  uint32_t group_bytes = 0;
  int64_t round_id = 0;
  int64_t message = 0;
  int64_t bytes = 0;
};
static_assert(sizeof(WireHeader) == 32);

void SendFrameHeader(const Fd& fd, const std::string& group, int64_t round, int64_t message,
                     int64_t bytes) {
  WireHeader h;
  h.group_bytes = static_cast<uint32_t>(group.size());
  h.round_id = round;
  h.message = message;
  h.bytes = bytes;
  SendBytes(fd, &h, sizeof h);
  SendBytes(fd, group.data(), group.size());
}

struct Cluster {
  std::vector<std::unique_ptr<HostBackend>> nodes;
  explicit Cluster(int n, const HostBackendOptions& options = {}) {
    for (int i = 0; i < n; ++i) {
      auto b = HostBackend::Start("127.0.0.1:0", options);
      REQUIRE(b.ok());
      nodes.push_back(*std::move(b));
    }
  }
};

// One round on some nodes of a cluster, each node's Transfer on its own thread.
class Round {
 public:
  Round(Cluster& c, const Fixture& f, const Memory& src, const Memory& dst, int64_t id,
        absl::Duration timeout, std::vector<int> which = {})
      : results_(c.nodes.size(), absl::UnknownError("not run")), ended_(c.nodes.size()) {
    if (which.empty()) {
      for (size_t n = 0; n < c.nodes.size(); ++n) which.push_back(static_cast<int>(n));
    }
    start_ = absl::Now();
    for (int n : which) {
      TransferJob job;
      job.group = "policy";
      job.round_id = id;
      job.node = n;
      job.plan = f.plan;
      job.src = src.OnNode(f.src, n);
      job.dst = dst.OnNode(f.dst, n);
      for (size_t k = 0; k < c.nodes.size(); ++k)
        job.data_addresses[static_cast<int32_t>(k)] = c.nodes[k]->data_address();
      job.deadline = absl::Now() + timeout;
      threads_[n] = std::thread([this, &c, n, job] {
        results_[n] = c.nodes[n]->Transfer(job);
        ended_[n] = absl::Now();
        done_[n] = true;
      });
    }
  }
  ~Round() { Join(); }
  void Join(int n) {
    if (threads_[n].joinable()) threads_[n].join();
  }
  void Join() {
    for (auto& [n, t] : threads_) Join(n);
  }
  bool done(int n) const { return done_[n]; }
  const absl::StatusOr<TransferStats>& result(int n) const { return results_[n]; }
  absl::Duration took(int n) const { return ended_[n] - start_; }

 private:
  absl::Time start_;
  std::vector<absl::StatusOr<TransferStats>> results_;
  std::vector<absl::Time> ended_;
  std::atomic<bool> done_[8] = {};
  std::map<int, std::thread> threads_;
};

// A complete round on every node: each succeeds, the destinations hold round `id`'s bytes, and
// it takes far less than its deadline. Returns its time.
absl::Duration FullRound(Cluster& c, const Fixture& f, Memory& src, Memory& dst, int64_t id) {
  const FillSpec spec = MakeFillSpec(f.src, f.dst, static_cast<uint64_t>(id));
  FillSources(f.src, spec, src.all);
  PoisonDestinations(dst.all);
  Round r(c, f, src, dst, id, absl::Seconds(30));
  r.Join();
  absl::Duration slowest;
  for (size_t n = 0; n < c.nodes.size(); ++n) {
    INFO("round " << id << ", node " << n << ": " << r.result(n).status().message());
    REQUIRE(r.result(n).ok());
    slowest = std::max(slowest, r.took(n));
  }
  auto checked = CheckDestinations(f.src, f.dst, spec, dst.all);
  INFO(checked.status().message());
  REQUIRE(checked.ok());
  // A round that waits on something left over from an aborted one takes its deadline (30 s);
  // this one moves a few MB on loopback.
  CHECK(slowest < absl::Seconds(3));
  return slowest;
}

std::vector<std::byte> Snapshot(const BufferMemory& m) {
  std::vector<std::byte> out;
  for (const auto& span : m) out.insert(out.end(), span.begin(), span.end());
  return out;
}

TEST_CASE(
    "a receiver cancelled midway: nothing lands after its Transfer returns, and the next round "
    "runs at full speed") {
  Fixture f(12, 512, 1024, 256 << 10);  // 12 MiB to each engine node, in 256 KiB messages
  Cluster c(3);
  Memory src(f.src), dst(f.dst);
  int64_t round = 0;
  int aborted = 0;
  for (int delay_ms : {0, 1, 3, 6, 10, 20, 40}) {
    ++round;
    FillSources(f.src, MakeFillSpec(f.src, f.dst, static_cast<uint64_t>(round)), src.all);
    PoisonDestinations(dst.all);
    {
      Round r(c, f, src, dst, round, absl::Seconds(30));
      absl::SleepFor(absl::Milliseconds(delay_ms));
      c.nodes[1]->Cancel("policy", round, "worker \"engine1\" died");
      r.Join(1);
      const std::vector<std::byte> landed = Snapshot(dst.OnNode(f.dst, 1));
      absl::SleepFor(absl::Milliseconds(20));  // then the coordinator aborts the others
      c.nodes[0]->Cancel("policy", round, "node 1 failed");
      c.nodes[2]->Cancel("policy", round, "node 1 failed");
      r.Join();
      for (int n = 0; n < 3; ++n) {
        INFO("delay " << delay_ms << " ms, node " << n << ": " << r.result(n).status().message());
        CHECK((r.result(n).ok() || absl::IsAborted(r.result(n).status()) ||
               absl::IsUnavailable(r.result(n).status())));
        CHECK(r.took(n) < absl::Seconds(5));
      }
      aborted += absl::IsAborted(r.result(1).status());
      absl::SleepFor(absl::Milliseconds(30));
      CHECK(Snapshot(dst.OnNode(f.dst, 1)) == landed);  // the other nodes' late frames were dropped
    }
    ++round;
    FullRound(c, f, src, dst, round);
  }
  CHECK(aborted >= 3);
}

TEST_CASE("a sender cancelled in the middle of a frame: the next round runs at full speed") {
  Fixture f(32, 1024, 512, 1 << 20, 1);  // 32 MiB from node 0 to node 1: more than sockets buffer
  Cluster c(2);
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);  // a cached connection from node 0 to node 1
  const bool receiver_told = GENERATE(true, false);
  INFO((receiver_told ? "node 1 learns of the abort" : "node 1 never hears of the abort"));
  // Node 1 has not begun round 2 (its TRANSFER request is late): node 0 fills the socket and
  // blocks in the middle of a frame.
  {
    Round r(c, f, src, dst, 2, absl::Seconds(30), {0});
    absl::SleepFor(absl::Milliseconds(300));
    REQUIRE_FALSE(r.done(0));
    c.nodes[0]->Cancel("policy", 2, "worker \"trainer0\" died");
    r.Join();
    INFO(r.result(0).status().message());
    CHECK(absl::IsAborted(r.result(0).status()));
    CHECK(r.took(0) < absl::Milliseconds(300) + absl::Seconds(2));  // not at its deadline
  }
  if (receiver_told) c.nodes[1]->Cancel("policy", 2, "worker \"trainer0\" died");
  for (int64_t round = 3; round <= 5; ++round) FullRound(c, f, src, dst, round);
}

TEST_CASE(
    "a round aborted after its sender finished: its frames on the cached connection do not hold up "
    "the next") {
  Fixture f(6, 64, 48, 4096, 1);  // small: all of a round fits in the socket's buffers
  Cluster c(2);
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);
  const bool receiver_told = GENERATE(true, false);
  INFO((receiver_told ? "node 1 learns of the abort" : "node 1 never hears of the abort"));
  // Node 0 sends all of round 2 and is done; node 1 never begins it (its worker died first), and
  // the round is aborted: node 1's reader finds round 2's frames on the connection.
  {
    Round r(c, f, src, dst, 2, absl::Seconds(30), {0});
    r.Join();
    INFO(r.result(0).status().message());
    REQUIRE(r.result(0).ok());
  }
  c.nodes[0]->Cancel("policy", 2, "node 1 failed");
  if (receiver_told) c.nodes[1]->Cancel("policy", 2, "worker \"engine1\" died");
  // Node 0 restarts at once: without the frames of round 2 dropped, node 1 would wait for
  // round 3's messages behind them.
  for (int64_t round = 3; round <= 5; ++round) FullRound(c, f, src, dst, round);
}

TEST_CASE("a late frame is read to its end and dropped; a broken one closes its connection") {
  Fixture f;
  Cluster c(3);
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);
  const Plan& plan = *f.plan;
  int64_t into_1 = -1;  // a message of node 0 to node 1
  for (size_t i = 0; i < plan.messages.size() && into_1 < 0; ++i) {
    const Message& m = plan.messages[i];
    if (plan.gpus[m.src_gpu].node == 0 && plan.gpus[m.dst_gpu].node == 1)
      into_1 = static_cast<int64_t>(i);
  }
  REQUIRE(into_1 >= 0);
  const int64_t bytes = plan.messages[into_1].bytes;
  const std::vector<std::byte> before = Snapshot(dst.all);
  const int64_t readers = c.nodes[1]->connection_stats().reader_threads;  // node 0's connection
  Fd peer = Dial(c.nodes[1]->data_address());
  const std::vector<std::byte> garbage(static_cast<size_t>(bytes), std::byte{0x5a});
  SendFrameHeader(peer, "policy", 1, into_1, bytes);  // round 1 is over on node 1
  SendBytes(peer, garbage.data(), garbage.size());
  REQUIRE(Eventually([&] { return c.nodes[1]->connection_stats().stale_frames == 1; }));
  CHECK_FALSE(ClosedWithin(peer, absl::Milliseconds(50)));  // still in step: it may carry more
  CHECK(Snapshot(dst.all) == before);
  SendFrameHeader(peer, "policy", 1, into_1, bytes);
  SendBytes(peer, garbage.data(), garbage.size() / 2);  // half a late frame, then a stall: held
  CHECK_FALSE(ClosedWithin(peer, absl::Milliseconds(50)));
  peer.Close();  // ... then gone mid-frame
  REQUIRE(Eventually([&] { return c.nodes[1]->connection_stats().reader_threads == readers; }));

  Fd bad = Dial(c.nodes[1]->data_address());
  const char junk[32] = "not a frame header";
  SendBytes(bad, junk, sizeof junk);
  CHECK(ClosedWithin(bad, absl::Seconds(5)));

  // Half of a frame of a running round, then the connection gone: the connection is dropped,
  // not the round (its sender sends the message again, or reports why it cannot: the round's
  // true reason, which this symptom must not race).
  const TransferJob lonely = LonelyJob(f, dst, *c.nodes[1], 1, 2, absl::Seconds(30));
  absl::StatusOr<TransferStats> r = absl::UnknownError("not run");
  std::atomic<bool> ended = false;
  std::thread t([&] {
    r = c.nodes[1]->Transfer(lonely);
    ended = true;
  });
  Fd half = Dial(c.nodes[1]->data_address());
  SendFrameHeader(half, "policy", 2, into_1, bytes);
  SendBytes(half, garbage.data(), garbage.size() / 2);
  half.Close();
  REQUIRE(Eventually([&] { return c.nodes[1]->connection_stats().reader_threads == readers; }));
  absl::SleepFor(absl::Milliseconds(50));
  CHECK_FALSE(ended);
  c.nodes[1]->Cancel("policy", 2, "worker \"trainer0\" on node 0 left");
  t.join();
  INFO(r.status().message());
  CHECK(absl::IsAborted(r.status()));
  CHECK(std::string(r.status().message()) == "worker \"trainer0\" on node 0 left");
  FullRound(c, f, src, dst, 3);
}

TEST_CASE("a restarted peer: the cached connection to it is not reused") {
  Fixture f(6, 64, 48, 4096, 1);
  Cluster c(2);
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);
  REQUIRE(c.nodes[0]->connection_stats().cached_outgoing == 1);
  const std::string address = c.nodes[1]->data_address();
  c.nodes[1].reset();  // closes its end of the cached connection
  auto again = HostBackend::Start(address);
  INFO(again.status().message());
  REQUIRE(again.ok());
  c.nodes[1] = *std::move(again);
  // A frame written into the dead connection would vanish without an error, and the round would
  // wait for it until its deadline.
  FullRound(c, f, src, dst, 2);
}

TEST_CASE("1,000 data connections opened and closed: every descriptor and thread is released") {
  HostBackendOptions options;
  options.frame_wait = absl::Milliseconds(100);
  auto a = HostBackend::Start("127.0.0.1:0", options);
  REQUIRE(a.ok());
  HostBackend& b = **a;
  const int64_t threads = Threads(), fds = Fds();
  int64_t peak_threads = 0;
  constexpr int kBatch = 50;
  for (int batch = 0; batch < 1000 / kBatch; ++batch) {
    std::vector<Fd> peers;
    for (int i = 0; i < kBatch; ++i) {
      peers.push_back(Dial(b.data_address()));
      switch (i % 4) {
        case 0:
          break;  // says nothing
        case 1:
          SendBytes(peers.back(), "garbage, not a frame header....", 32);
          break;
        case 2:
          SendBytes(peers.back(), "half", 4);
          break;  // half of a header
        case 3:
          SendFrameHeader(peers.back(), "policy", 99, 0, 8);
          break;  // a round that never begins
      }
    }
    REQUIRE(Eventually([&] { return b.connection_stats().accepted == (batch + 1) * kBatch; }));
    peak_threads = std::max(peak_threads, Threads());
    peers.clear();
    // Each batch's threads end (a frame of a round that never begins waits frame_wait).
    REQUIRE(Eventually([&] { return b.connection_stats().reader_threads == 0; }));
  }
  REQUIRE(Eventually([&] { return b.connection_stats().reader_threads == 0; }));
  const HostConnectionStats s = b.connection_stats();
  CHECK(s.accepted == 1000);
  CHECK(s.open_incoming == 0);
  CHECK(s.refused == 0);
  REQUIRE(Eventually([&] { return Threads() == threads; }));
  CHECK(Fds() == fds);
  CHECK(peak_threads <= threads + kBatch);
  WARN("1,000 connections: threads " << threads << " before, at most " << peak_threads
                                     << " during, " << Threads() << " after; fds " << fds
                                     << " before, " << Fds() << " after");
}

TEST_CASE(
    "beyond max_incoming, the connection idle the longest makes room; one inside a frame never "
    "does") {
  HostBackendOptions options;
  options.max_incoming = 8;
  options.first_byte_timeout = absl::Seconds(60);  // none of them ends by its deadline here
  auto a = HostBackend::Start("127.0.0.1:0", options);
  REQUIRE(a.ok());
  HostBackend& b = **a;
  std::vector<Fd> held;
  for (int i = 0; i < 8; ++i) {
    held.push_back(Dial(b.data_address()));
    // One at a time, so that their ages are their order.
    REQUIRE(Eventually([&] { return b.connection_stats().open_incoming == i + 1; }));
  }
  std::vector<Fd> extra;
  for (int i = 0; i < 4; ++i) extra.push_back(Dial(b.data_address()));
  for (int i = 0; i < 4; ++i) CHECK(ClosedWithin(held[i], absl::Seconds(5)));  // the four oldest
  REQUIRE(Eventually([&] { return b.connection_stats().reader_threads == 8; }));
  for (int i = 4; i < 8; ++i) CHECK_FALSE(ClosedWithin(held[i], absl::Milliseconds(1)));
  for (const Fd& e : extra) CHECK_FALSE(ClosedWithin(e, absl::Milliseconds(1)));
  HostConnectionStats s = b.connection_stats();
  CHECK(s.evicted == 4);
  CHECK(s.refused == 0);
  CHECK(s.open_incoming == 8);

  // Inside a frame (of a round that has not begun here: its reader waits frame_wait for it), no
  // connection is evicted: the new one is refused.
  held.clear();
  extra.clear();
  REQUIRE(Eventually([&] { return b.connection_stats().reader_threads == 0; }));
  std::vector<Fd> busy;
  for (int i = 0; i < 8; ++i) {
    busy.push_back(Dial(b.data_address()));
    SendFrameHeader(busy.back(), "policy", 99, 0, 8);
  }
  REQUIRE(Eventually([&] { return b.connection_stats().in_frame == 8; }));
  Fd late = Dial(b.data_address());
  CHECK(ClosedWithin(late, absl::Seconds(5)));
  for (const Fd& fd : busy) CHECK_FALSE(ClosedWithin(fd, absl::Milliseconds(1)));
  s = b.connection_stats();
  CHECK(s.refused == 1);
  CHECK(s.evicted == 4);
  CHECK(s.in_frame == 8);
}

TEST_CASE(
    "idle connections cannot lock a sender out: max_incoming of them, and a round still runs") {
  Fixture f(6, 64, 48, 4096, 1);
  HostBackendOptions options;
  options.max_incoming = 8;
  options.first_byte_timeout = absl::Seconds(60);
  Cluster c(2, options);
  std::vector<Fd> squatters;
  for (int i = 0; i < 8; ++i) squatters.push_back(Dial(c.nodes[1]->data_address()));
  REQUIRE(Eventually([&] { return c.nodes[1]->connection_stats().open_incoming == 8; }));
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);
  CHECK(c.nodes[1]->connection_stats().evicted == 1);
  CHECK(c.nodes[1]->connection_stats().refused == 0);
  FullRound(c, f, src, dst, 2);  // on the pooled connection, which the squatters did not push out
}

TEST_CASE(
    "a connection that sends nothing ends at first_byte_timeout; one idle between frames at "
    "idle_timeout") {
  HostBackendOptions options;
  options.first_byte_timeout = absl::Milliseconds(500);
  options.idle_timeout = absl::Seconds(1);
  auto a = HostBackend::Start("127.0.0.1:0", options);
  REQUIRE(a.ok());
  HostBackend& b = **a;
  Fd silent = Dial(b.data_address());
  CHECK_FALSE(ClosedWithin(silent, absl::Milliseconds(100)));
  CHECK(ClosedWithin(silent, absl::Seconds(10)));
  CHECK(b.connection_stats().first_byte_timeouts == 1);
  CHECK(b.connection_stats().idle_closed == 0);

  // A connection that carried a frame (a late one: round 7 is over here) idles up to idle_timeout.
  b.Cancel("policy", 7, "over");
  const std::vector<std::byte> payload(64, std::byte{0x5a});
  Fd pooled = Dial(b.data_address());
  SendFrameHeader(pooled, "policy", 7, 0, 64);
  SendBytes(pooled, payload.data(), payload.size());
  REQUIRE(Eventually([&] { return b.connection_stats().stale_frames == 1; }));
  CHECK_FALSE(ClosedWithin(pooled, absl::Milliseconds(300)));
  CHECK(ClosedWithin(pooled, absl::Seconds(10)));  // the end of the receiver's stream...
  CHECK(b.connection_stats().idle_closed == 1);
  // ... while a frame its sender began before it saw the end is still read.
  SendFrameHeader(pooled, "policy", 7, 0, 64);
  SendBytes(pooled, payload.data(), payload.size());
  REQUIRE(Eventually([&] { return b.connection_stats().stale_frames == 2; }));
  REQUIRE(Eventually([&] { return b.connection_stats().reader_threads == 0; }));
  CHECK(b.connection_stats().first_byte_timeouts == 1);
}

// Node 1 closes node 0's pooled connection after `idle_timeout`; node 0's next round must not
// write into it (the frame would vanish without an error, and the round wait for it).
void TwoRoundsApartByMoreThanIdleTimeout(Cluster& c) {
  Fixture f(6, 64, 48, 4096, 1);
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);
  REQUIRE(c.nodes[0]->connection_stats().cached_outgoing == 1);
  REQUIRE(Eventually([&] {
    const HostConnectionStats s = c.nodes[1]->connection_stats();
    return s.idle_closed == 1 && s.open_incoming == 0;
  }));
  CHECK(c.nodes[0]->connection_stats().cached_outgoing == 1);  // node 0 has not noticed yet
  FullRound(c, f, src, dst, 2);                                // byte for byte, at full speed
  CHECK(c.nodes[1]->connection_stats().accepted == 2);
}

TEST_CASE("a pooled connection its receiver closed for idleness: the next round dials afresh") {
  HostBackendOptions options;
  options.idle_timeout = absl::Milliseconds(300);
  Cluster c(2, options);
  TwoRoundsApartByMoreThanIdleTimeout(c);
}

TEST_CASE("the acceptor survives EMFILE: it logs, backs off and accepts again") {
  HostBackendOptions options;
  options.accept_backoff = absl::Milliseconds(50);
  auto a = HostBackend::Start("127.0.0.1:0", options);
  REQUIRE(a.ok());
  HostBackend& b = **a;
  rlimit saved;
  REQUIRE(getrlimit(RLIMIT_NOFILE, &saved) == 0);
  std::vector<int> fillers;
  struct Restore {
    rlimit limit;
    std::vector<int>& fillers;
    ~Restore() {
      for (int f : fillers) close(f);
      fillers.clear();
      setrlimit(RLIMIT_NOFILE, &limit);
    }
  } restore{saved, fillers};
  // This process (the backend's too) runs out of descriptors: all but one taken, and that one
  // becomes a peer's socket, which the kernel connects (the listener's backlog) but the backend
  // cannot accept.
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(Fds() + 32);
  REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
  while (true) {
    const int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) break;
    fillers.push_back(fd);
  }
  REQUIRE(errno == EMFILE);
  close(fillers.back());
  fillers.pop_back();
  auto peer = TcpConnect(b.data_address(), absl::Now() + absl::Seconds(5));
  REQUIRE(peer.ok());
  CHECK(
      Eventually([&] { return b.connection_stats().accept_errors >= 3; }));  // retried, backing off
  CHECK(b.connection_stats().accepted == 0);
  for (int f : fillers) close(f);
  fillers.clear();
  REQUIRE(setrlimit(RLIMIT_NOFILE, &saved) == 0);
  REQUIRE(Eventually([&] { return b.connection_stats().accepted == 1; }, absl::Seconds(5)));
  const int64_t errors = b.connection_stats().accept_errors;
  CHECK(errors < 200);  // backed off: 50 ms apart, not a busy loop
  // It serves the connection it could not accept, and new ones.
  const char junk[32] = "not a frame header";
  SendBytes(*peer, junk, sizeof junk);
  CHECK(ClosedWithin(*peer, absl::Seconds(5)));
  Fd next = Dial(b.data_address());
  CHECK(Eventually([&] { return b.connection_stats().accepted == 2; }));
  CHECK(b.connection_stats().accept_errors == errors);
}

// ---------------------------------------------------------------------------------------------
// Mutual TLS on the data connections (certificates made by tools/gen_certs.sh at test time).

std::string Sh(const std::string& arg) { return absl::StrCat("'", arg, "'"); }

// tools/gen_certs.sh from Bazel's runfiles (or the repository root, run by hand).
std::string GenCertsScript() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  if (srcdir != nullptr) {
    return absl::StrCat(srcdir, "/", workspace != nullptr ? workspace : "refit",
                        "/tools/gen_certs.sh");
  }
  return "tools/gen_certs.sh";
}

std::string TempDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  std::string pattern = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, "-XXXXXX");
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

// A cluster CA's material in a fresh directory: node-0..2, refit-operator, rogue/.
std::string MakeCerts(const std::string& name) {
  const std::string dir = TempDir(name);
  const std::string command =
      absl::StrCat("bash ", Sh(GenCertsScript()), " ", Sh(dir), " 3 >/dev/null 2>&1");
  INFO(command);
  REQUIRE(std::system(command.c_str()) == 0);
  return dir;
}

// The cluster's certificates, made once for the test binary.
const std::string& Certs() {
  static const std::string dir = MakeCerts("certs");
  return dir;
}

TlsConfig Tls(const std::string& dir, const std::string& who, const std::string& ca_dir = "") {
  TlsConfig t;
  t.cert = absl::StrCat(dir, "/", who, ".pem");
  t.key = absl::StrCat(dir, "/", who, ".key");
  t.ca = absl::StrCat(ca_dir.empty() ? dir : ca_dir, "/ca.pem");
  return t;
}

HostBackendOptions TlsOptions(const TlsConfig& tls) {
  HostBackendOptions o;
  o.tls = tls;
  return o;
}

std::unique_ptr<HostBackend> StartTls(const TlsConfig& tls,
                                      const std::string& address = "127.0.0.1:0") {
  auto b = HostBackend::Start(address, TlsOptions(tls));
  INFO(b.status().message());
  REQUIRE(b.ok());
  return *std::move(b);
}

// Each node with its own certificate of `dir`.
Cluster TlsCluster(int n, const std::string& dir = Certs()) {
  Cluster c(0);
  for (int i = 0; i < n; ++i) c.nodes.push_back(StartTls(Tls(dir, absl::StrCat("node-", i))));
  return c;
}

// A TLS client as a peer would be, to `address`, which must be node `server_node`.
absl::Status TlsDial(const std::string& address, const TlsConfig& tls, int32_t server_node) {
  auto context = TlsContext::Load(tls);
  INFO(context.status().message());
  REQUIRE(context.ok());
  DataStream stream(Dial(address), "the backend");
  return stream.ConnectTls(**context, server_node, absl::Now() + absl::Seconds(5));
}

int64_t MessageInto(const Plan& plan, int32_t from, int32_t to) {
  for (size_t i = 0; i < plan.messages.size(); ++i) {
    const Message& m = plan.messages[i];
    if (plan.gpus[m.src_gpu].node == from && plan.gpus[m.dst_gpu].node == to)
      return static_cast<int64_t>(i);
  }
  FAIL("no message from node " << from << " to node " << to);
  return -1;
}

TEST_CASE("three host backends with mutual TLS execute one plan byte for byte, round after round") {
  Fixture f;
  Cluster c = TlsCluster(3);
  Memory src(f.src), dst(f.dst);
  for (int64_t round = 1; round <= 3; ++round) FullRound(c, f, src, dst, round);
  for (auto& n : c.nodes) CHECK(n->connection_stats().tls_refused == 0);
  CHECK(c.nodes[0]->connection_stats().cached_outgoing == 2);  // reused from round to round
}

TEST_CASE("TLS: a sender whose certificate another CA signed is refused, and nothing of it lands") {
  Fixture f(6, 64, 48, 4096, 1);
  Cluster c = TlsCluster(2);
  // Its own certificate from the rogue CA (refit-node-0 all the same); it trusts the real CA, so
  // the refusal is the receiver's.
  c.nodes[0] = StartTls(Tls(Certs() + "/rogue", "node-0", Certs()));
  Memory src(f.src), dst(f.dst);
  FillSources(f.src, MakeFillSpec(f.src, f.dst, 1), src.all);
  PoisonDestinations(dst.all);
  const std::vector<std::byte> before = Snapshot(dst.all);
  {
    Round r(c, f, src, dst, 1, absl::Seconds(2));
    r.Join();
    INFO(r.result(0).status().message());
    REQUIRE_FALSE(r.result(0).ok());  // the sender learns it at once, not at the deadline
    CHECK(r.took(0) < absl::Seconds(1));
    CHECK(std::string(r.result(0).status().message())
              .find("did not accept this node's certificate") != std::string::npos);
    INFO(r.result(1).status().message());
    CHECK(absl::IsDeadlineExceeded(r.result(1).status()));  // the receiver never took its bytes
    CHECK(std::string(r.result(1).status().message()).find("node 0") != std::string::npos);
  }
  CHECK(Snapshot(dst.all) == before);
  CHECK(c.nodes[1]->connection_stats().tls_refused >= 1);
  c.nodes[0] = StartTls(Tls(Certs(), "node-0"));
  FullRound(c, f, src, dst, 2);
}

TEST_CASE("TLS: a plaintext peer is dropped without harm; the next round runs") {
  Fixture f(6, 64, 48, 4096, 1);
  HostBackendOptions options = TlsOptions(Tls(Certs(), "node-1"));
  options.frame_wait = absl::Milliseconds(500);
  Cluster c = TlsCluster(1);
  auto receiver = HostBackend::Start("127.0.0.1:0", options);
  REQUIRE(receiver.ok());
  c.nodes.push_back(*std::move(receiver));
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);
  const int64_t into_1 = MessageInto(*f.plan, 0, 1);
  const int64_t bytes = f.plan->messages[into_1].bytes;
  // A frame of round 2 in the clear while round 2 runs on node 1: refused before a byte of it is
  // read.
  const TransferJob lonely = LonelyJob(f, dst, *c.nodes[1], 1, 2, absl::Seconds(1));
  const std::vector<std::byte> before = Snapshot(dst.all);
  absl::StatusOr<TransferStats> r = absl::UnknownError("not run");
  std::thread t([&] { r = c.nodes[1]->Transfer(lonely); });
  Fd plain = Dial(c.nodes[1]->data_address());
  WireHeader h;
  h.group_bytes = 6;
  h.round_id = 2;
  h.message = into_1;
  h.bytes = bytes;
  std::vector<std::byte> frame(sizeof h + 6 + static_cast<size_t>(bytes), std::byte{0x5a});
  std::memcpy(frame.data(), &h, sizeof h);
  std::memcpy(frame.data() + sizeof h, "policy", 6);
  // The receiver may close the connection at the first bytes, before the rest is written.
  (void)SendAll(plain, frame, absl::Now() + absl::Seconds(5), "node 1");
  CHECK(ClosedWithin(plain, absl::Seconds(5)));
  Fd silent = Dial(c.nodes[1]->data_address());  // says nothing: dropped at frame_wait
  CHECK(ClosedWithin(silent, absl::Seconds(5)));
  t.join();
  CHECK(absl::IsDeadlineExceeded(r.status()));
  CHECK(Snapshot(dst.all) == before);
  CHECK(c.nodes[1]->connection_stats().tls_refused == 2);
  REQUIRE(
      Eventually([&] { return c.nodes[1]->connection_stats().open_incoming == 1; }));  // node 0's
  FullRound(c, f, src, dst, 3);
}

TEST_CASE("TLS: a client certificate that is not a node's is refused (refit-operator)") {
  auto b = StartTls(Tls(Certs(), "node-1"));
  const absl::Status s = TlsDial(b->data_address(), Tls(Certs(), "refit-operator"), 1);
  INFO(s.message());
  CHECK_FALSE(s.ok());
  REQUIRE(Eventually([&] { return b->connection_stats().tls_refused == 1; }));
  // A node's is accepted; and a rogue CA's node certificate is not.
  CHECK(TlsDial(b->data_address(), Tls(Certs(), "node-0"), 1).ok());
  CHECK_FALSE(TlsDial(b->data_address(), Tls(Certs() + "/rogue", "node-0", Certs()), 1).ok());
  REQUIRE(Eventually([&] { return b->connection_stats().tls_refused == 2; }));
}

TEST_CASE("TLS: the sender refuses a destination whose certificate is another node's") {
  Fixture f(6, 64, 48, 4096, 1);
  Cluster c = TlsCluster(2);
  c.nodes[1] = StartTls(Tls(Certs(), "node-2"));  // listening where node 1 should be
  Memory src(f.src), dst(f.dst);
  PoisonDestinations(dst.all);
  const std::vector<std::byte> before = Snapshot(dst.all);
  Round r(c, f, src, dst, 1, absl::Seconds(2));
  r.Join();
  INFO(r.result(0).status().message());
  CHECK(absl::IsPermissionDenied(r.result(0).status()));
  CHECK(std::string(r.result(0).status().message()).find("not refit-node-1") != std::string::npos);
  CHECK(r.took(0) < absl::Seconds(1));
  CHECK(Snapshot(dst.all) == before);
  // Directly too: node 1's own certificate is wanted.
  CHECK(absl::IsPermissionDenied(TlsDial(c.nodes[1]->data_address(), Tls(Certs(), "node-0"), 1)));
  CHECK(TlsDial(c.nodes[1]->data_address(), Tls(Certs(), "node-0"), 2).ok());
}

TEST_CASE("TLS: a node cannot send another node's messages") {
  Fixture f(6, 64, 48, 4096, 1);
  Cluster c = TlsCluster(2);
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);
  const int64_t into_1 = MessageInto(*f.plan, 0, 1);
  PoisonDestinations(dst.all);
  const std::vector<std::byte> before = Snapshot(dst.all);
  const TransferJob lonely = LonelyJob(f, dst, *c.nodes[1], 1, 2, absl::Seconds(30));
  absl::StatusOr<TransferStats> r = absl::UnknownError("not run");
  std::thread t([&] { r = c.nodes[1]->Transfer(lonely); });
  // Node 2, a member of the cluster with a valid certificate, writes node 0's message of round 2.
  auto context = TlsContext::Load(Tls(Certs(), "node-2"));
  REQUIRE(context.ok());
  DataStream forger(Dial(c.nodes[1]->data_address()), "node 1");
  REQUIRE(forger.ConnectTls(**context, 1, absl::Now() + absl::Seconds(5)).ok());
  FrameHeader h;
  h.group_bytes = 6;
  h.round_id = 2;
  h.message = into_1;
  h.bytes = f.plan->messages[into_1].bytes;
  const auto wire = EncodeFrameHeader(h);
  const std::vector<std::byte> garbage(static_cast<size_t>(h.bytes), std::byte{0x5a});
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  REQUIRE(forger.SendAll(wire, deadline).ok());
  REQUIRE(forger.SendAll({reinterpret_cast<const std::byte*>("policy"), 6}, deadline).ok());
  (void)forger.SendAll(garbage,
                       deadline);  // may fail: the receiver closes the connection at the header
  REQUIRE(Eventually([&] { return c.nodes[1]->connection_stats().forged_frames == 1; }));
  CHECK(ClosedWithin(forger.fd(), absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(50));
  CHECK(Snapshot(dst.all) == before);
  c.nodes[1]->Cancel("policy", 2, "the test is over");
  t.join();
  CHECK(absl::IsAborted(r.status()));  // the forgery itself fails no round
  FullRound(c, f, src, dst, 3);
  CHECK(c.nodes[1]->connection_stats().forged_frames == 1);
}

// A node's TLS data connection to `address` (node `server_node`), as `who` (a certificate of
// Certs()).
struct TlsPeer {
  std::unique_ptr<TlsContext> context;
  DataStream stream;
  TlsPeer(const std::string& address, const std::string& who, int32_t server_node) {
    auto loaded = TlsContext::Load(Tls(Certs(), who));
    REQUIRE(loaded.ok());
    context = *std::move(loaded);
    stream = DataStream(Dial(address), "the backend");
    REQUIRE(stream.ConnectTls(*context, server_node, absl::Now() + absl::Seconds(5)).ok());
  }
  // A frame header and `bytes` of payload (the receiver may close the connection before it is all
  // written).
  void SendFrame(int64_t round, int64_t message, int64_t bytes) {
    FrameHeader h;
    h.group_bytes = 6;
    h.round_id = round;
    h.message = message;
    h.bytes = bytes;
    const auto wire = EncodeFrameHeader(h);
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    REQUIRE(stream.SendAll(wire, deadline).ok());
    REQUIRE(stream.SendAll({reinterpret_cast<const std::byte*>("policy"), 6}, deadline).ok());
    const std::vector<std::byte> payload(static_cast<size_t>(bytes), std::byte{0x5a});
    (void)stream.SendAll(payload, deadline);
  }
};

TEST_CASE("TLS: bad frames from a node that does not send them fail no round, running or next") {
  Fixture f(6, 64, 48, 4096, 1);
  Cluster c = TlsCluster(2);
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);
  const int64_t into_1 = MessageInto(*f.plan, 0, 1);
  const int64_t messages = static_cast<int64_t>(f.plan->messages.size());
  // Round 2 runs on node 1 (node 0 has not begun it). Node 2, in no plan but with a node's
  // certificate, sends frames of round 2 that a check of the plan refuses: message 0 of 1 byte,
  // one past the last message, a real message of the wrong size; and message 0 of round 3,
  // which waits for round 3 to begin.
  const FillSpec spec = MakeFillSpec(f.src, f.dst, 2);
  FillSources(f.src, spec, src.all);
  PoisonDestinations(dst.all);
  Round receiving(c, f, src, dst, 2, absl::Seconds(30), {1});
  absl::SleepFor(absl::Milliseconds(100));
  std::vector<std::unique_ptr<TlsPeer>> forgers;
  for (const auto& [message, bytes] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 1}, {messages, 1}, {into_1, f.plan->messages[into_1].bytes + 1}}) {
    forgers.push_back(std::make_unique<TlsPeer>(c.nodes[1]->data_address(), "node-2", 1));
    forgers.back()->SendFrame(2, message, bytes);
  }
  REQUIRE(Eventually([&] { return c.nodes[1]->connection_stats().forged_frames == 3; }));
  for (const auto& p : forgers) CHECK(ClosedWithin(p->stream.fd(), absl::Seconds(5)));
  TlsPeer next(c.nodes[1]->data_address(), "node-2", 1);
  next.SendFrame(3, 0, 1);
  absl::SleepFor(absl::Milliseconds(50));
  CHECK_FALSE(receiving.done(1));  // still running: nothing failed it
  {
    Round sending(c, f, src, dst, 2, absl::Seconds(30), {0});
    sending.Join();
    INFO(sending.result(0).status().message());
    REQUIRE(sending.result(0).ok());
  }
  receiving.Join();
  INFO(receiving.result(1).status().message());
  REQUIRE(receiving.result(1).ok());
  auto checked = CheckDestinations(f.src, f.dst, spec, dst.all);
  INFO(checked.status().message());
  REQUIRE(checked.ok());
  // Round 3 begins: the frame that waited for it is dropped (as forged, with its connection; or,
  // if round 3 was over before its reader looked, as a late one), and the round commits.
  const int64_t stale = c.nodes[1]->connection_stats().stale_frames;
  FullRound(c, f, src, dst, 3);
  REQUIRE(Eventually([&] {
    const HostConnectionStats s = c.nodes[1]->connection_stats();
    return s.forged_frames + s.stale_frames == 4 + stale;
  }));
  FullRound(c, f, src, dst, 4);
}

TEST_CASE(
    "TLS: connections that never handshake hold no slot for long and cannot crowd out a node's") {
  Fixture f(6, 64, 48, 4096, 1);
  Cluster c = TlsCluster(1);
  HostBackendOptions options = TlsOptions(Tls(Certs(), "node-1"));
  options.max_incoming = 16;  // half of them for handshakes
  options.handshake_timeout = absl::Seconds(1);
  auto receiver = HostBackend::Start("127.0.0.1:0", options);
  REQUIRE(receiver.ok());
  c.nodes.push_back(*std::move(receiver));
  HostBackend& b = *c.nodes[1];
  // Plain TCP connections that say nothing, more than the slots: then node 0's first connection.
  std::vector<Fd> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(Dial(b.data_address()));
  REQUIRE(Eventually([&] {
    const HostConnectionStats s = b.connection_stats();
    return s.accepted + s.refused == 40;
  }));
  CHECK(b.connection_stats().handshaking <= 8);
  // Beyond the slots the oldest handshakes are cut off; beyond max_incoming the oldest are evicted.
  CHECK(b.connection_stats().handshakes_cut + b.connection_stats().evicted +
            b.connection_stats().refused >=
        32);
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);  // within 3 s, on a fresh connection
  // Those left are closed at handshake_timeout; node 0's connection stays.
  for (const Fd& fd : idle) CHECK(ClosedWithin(fd, absl::Seconds(5)));
  REQUIRE(Eventually([&] { return b.connection_stats().open_incoming == 1; }));
  CHECK(b.connection_stats().handshaking == 0);
  FullRound(c, f, src, dst, 2);
}

TEST_CASE(
    "TLS: a pooled connection its receiver closed for idleness: the next round dials afresh") {
  Cluster c(0);
  for (int i = 0; i < 2; ++i) {
    HostBackendOptions options = TlsOptions(Tls(Certs(), absl::StrCat("node-", i)));
    options.idle_timeout = absl::Milliseconds(300);
    auto b = HostBackend::Start("127.0.0.1:0", options);
    REQUIRE(b.ok());
    c.nodes.push_back(*std::move(b));
  }
  TwoRoundsApartByMoreThanIdleTimeout(c);
}

void CopyFile(const std::string& from, const std::string& to) {
  const std::string command = absl::StrCat("cp ", Sh(from), " ", Sh(to));
  REQUIRE(std::system(command.c_str()) == 0);
}

// Node n's files in a directory of their own, as a mounted Secret would be.
TlsConfig InstallNode(const std::string& certs, int n, const std::string& into) {
  const TlsConfig t = Tls(into, "node");
  CopyFile(absl::StrCat(certs, "/node-", n, ".pem"), t.cert);
  CopyFile(absl::StrCat(certs, "/node-", n, ".key"), t.key);
  CopyFile(absl::StrCat(certs, "/ca.pem"), t.ca);
  return t;
}

TEST_CASE(
    "TLS: rotated certificate files are picked up by new connections; a bad file keeps the old "
    "ones") {
  Fixture f(6, 64, 48, 4096, 1);
  const std::string next = MakeCerts("rotated");  // another CA: old and new cannot talk
  std::vector<std::string> dirs = {TempDir("node0"), TempDir("node1")};
  std::vector<TlsConfig> tls;
  for (int n = 0; n < 2; ++n) {
    tls.push_back(InstallNode(Certs(), n, dirs[n]));
    tls.back().reload = absl::Milliseconds(20);
  }
  Cluster c(0);
  for (int n = 0; n < 2; ++n) c.nodes.push_back(StartTls(tls[n]));
  Memory src(f.src), dst(f.dst);
  FullRound(c, f, src, dst, 1);

  for (int n = 0; n < 2; ++n) InstallNode(next, n, dirs[n]);
  absl::SleepFor(absl::Milliseconds(50));
  // Node 1 now answers with the new certificate and trusts only the new CA.
  CHECK_FALSE(TlsDial(c.nodes[1]->data_address(), Tls(Certs(), "node-0"), 1).ok());
  CHECK(TlsDial(c.nodes[1]->data_address(), Tls(next, "node-0"), 1).ok());
  CHECK(c.nodes[1]->connection_stats().tls_reloads == 1);
  // Node 1 restarted with the new files: node 0's cached connection is gone, its new one must
  // present node 0's new certificate.
  const std::string address = c.nodes[1]->data_address();
  c.nodes[1].reset();
  c.nodes[1] = StartTls(tls[1], address);
  FullRound(c, f, src, dst, 2);
  CHECK(c.nodes[0]->connection_stats().tls_reloads == 1);

  // A broken certificate file: logged, and the context that works stays.
  {
    std::FILE* out = std::fopen(tls[0].cert.c_str(), "w");
    REQUIRE(out != nullptr);
    std::fputs("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n", out);
    std::fclose(out);
  }
  absl::SleepFor(absl::Milliseconds(50));
  c.nodes[1].reset();
  c.nodes[1] = StartTls(tls[1], address);
  FullRound(c, f, src, dst, 3);
  CHECK(c.nodes[0]->connection_stats().tls_reloads == 1);
  // Mended: loaded again.
  CopyFile(absl::StrCat(next, "/node-0.pem"), tls[0].cert);
  absl::SleepFor(absl::Milliseconds(50));
  c.nodes[1].reset();
  c.nodes[1] = StartTls(tls[1], address);
  FullRound(c, f, src, dst, 4);
  CHECK(c.nodes[0]->connection_stats().tls_reloads == 2);
}

TEST_CASE("TLS: a backend whose certificate files do not load does not start") {
  TlsConfig t = Tls(Certs(), "node-0");
  t.key = Certs() + "/node-1.key";  // not the certificate's key
  auto b = HostBackend::Start("127.0.0.1:0", TlsOptions(t));
  REQUIRE_FALSE(b.ok());
  CHECK(std::string(b.status().message()).find("node-1.key") != std::string::npos);
}
}  // namespace
}  // namespace refit
