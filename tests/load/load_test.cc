// Load: one refitd process; 1,000 workers (500 trainers, 500 inference workers) of 100 pieces
// each (100k pieces, 50k tensors) registered and planned; then 100 rounds in a row, each checked
// byte for byte. The daemon's memory, file descriptors and threads are read from /proc after a
// warm-up and after the 100 rounds: none may grow.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <dirent.h>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/worker_client.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "proto/refit.grpc.pb.h"

extern char** environ;

namespace refit {
namespace {

constexpr int kWorkersPerSide = 500;
constexpr int kPiecesPerWorker = 100;
constexpr int64_t kElements = 16;  // per tensor, fp32

struct ProcStats {
  int64_t rss_kib = 0, threads = 0, fds = 0;
  int64_t stack_rss_kib = 0;  // resident in thread stacks (mappings of exactly the stack size)
  int64_t heap_rss_kib() const { return rss_kib - stack_rss_kib; }
};

ProcStats Read(pid_t pid) {
  ProcStats s;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") status >> s.rss_kib;
    if (key == "Threads:") status >> s.threads;
  }
  // Thread stacks only ever grow in residence as threads run deeper code: not a leak. They are
  // the anonymous mappings of exactly the default stack size.
  std::ifstream smaps(absl::StrCat("/proc/", pid, "/smaps"));
  std::string line;
  int64_t size_kib = 0;
  while (std::getline(smaps, line)) {
    if (line.rfind("Size:", 0) == 0) size_kib = std::stoll(line.substr(5));
    if (line.rfind("Rss:", 0) == 0 && size_kib == 8192) s.stack_rss_kib += std::stoll(line.substr(4));
  }
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  while (d != nullptr && readdir(d) != nullptr) ++s.fds;
  if (d != nullptr) closedir(d);
  return s;
}

// Worker w of a side holds tensors; trainer w holds tensors [w*100, w*100+100); inference worker
// w holds a shifted block, so every round moves data between different workers.
Layout SideWorker(bool trainer, int w) {
  Layout l;
  const int32_t worker = l.AddWorker(absl::StrCat(trainer ? "t" : "i", w), 0, w % 8);
  const int32_t buffer = l.AddBuffer(worker, "flat", DType::kF32, Dims{kPiecesPerWorker * kElements});
  for (int k = 0; k < kPiecesPerWorker; ++k) {
    const int owner = trainer ? w : (w + 7) % kWorkersPerSide;
    const int32_t t = l.AddTensor(absl::StrCat("tensor", owner * kPiecesPerWorker + k), Dims{kElements}, DType::kF32);
    l.AddPiece(t, Box::Whole(Dims{kElements}), buffer, Box::FromDims(Dims{k * kElements}, Dims{kElements}));
  }
  return l;
}

TEST_CASE("1,000 workers, 100k pieces, 100 rounds: no growth of memory, descriptors or threads") {
  const std::string socket = absl::StrCat("/tmp/refitd-load-", getpid(), ".sock");
  const std::string addr_file = absl::StrCat("/tmp/refitd-load-", getpid(), ".addr");
  std::vector<std::string> args = {"daemon/refitd", "--node", "0", "--worker-socket", socket,
                                   "--address-file", addr_file, "--log-level", "warn",
                                   "--prepare-timeout", "60", "--commit-timeout", "60"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  unlink(addr_file.c_str());
  // Few malloc arenas: with 2,000 threads glibc's per-thread arenas otherwise make the resident
  // size wander by hundreds of MB with scheduling, which would hide or fake a leak.
  std::vector<std::string> env_strings = {"MALLOC_ARENA_MAX=2"};
  for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
  std::vector<char*> env;
  for (auto& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  REQUIRE(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), env.data()) == 0);
  struct Reaper {
    pid_t pid;
    ~Reaper() { kill(pid, SIGTERM); waitpid(pid, nullptr, 0); }
  } reaper{pid};
  std::string address;
  for (int i = 0; i < 100 && address.empty(); ++i) {
    std::ifstream(addr_file) >> address;
    if (address.empty()) usleep(100000);
  }
  REQUIRE_FALSE(address.empty());

  std::vector<Layout> layouts;
  layouts.reserve(2 * kWorkersPerSide);
  std::vector<std::unique_ptr<WorkerClient>> trainers, engines;
  for (int side = 0; side < 2; ++side) {
    for (int w = 0; w < kWorkersPerSide; ++w) {
      layouts.push_back(SideWorker(side == 0, w));
      REQUIRE(ValidateLayout(layouts.back(), "worker").ok());
      const Layout& mine = layouts.back();
      WorkerCallbacks cb;
      if (side == 0) {
        const size_t index = trainers.size();
        cb.on_prepare = [&, index](int64_t v) {
          BufferMemory m = {trainers[index]->buffer(0)};
          FillSources(layouts[index], FillSpec{static_cast<uint64_t>(v), std::vector<bool>(kPiecesPerWorker, false)}, m);
          return absl::OkStatus();
        };
      }
      auto c = WorkerClient::Connect("unix:" + socket, "load", side == 0 ? v1::TRAINER : v1::INFERENCE, mine, cb,
                                     absl::Seconds(30));
      INFO(c.status().message());
      REQUIRE(c.ok());
      (side == 0 ? trainers : engines).push_back(*std::move(c));
    }
  }
  auto control = v1::RefitControl::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  auto refit = [&](int64_t v) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::RefitRequest r;
    r.set_group("load");
    r.set_version(v);
    v1::RoundStats out;
    grpc::Status s = control->Refit(&ctx, r, &out);
    INFO(s.error_message());
    REQUIRE(s.ok());
    return out;
  };
  {
    grpc::ClientContext ctx;
    v1::GetPlanRequest r;
    r.set_group("load");
    v1::PlanSummary plan;
    REQUIRE(control->GetPlan(&ctx, r, &plan).ok());
    CHECK(plan.pieces() == 2 * kWorkersPerSide * kPiecesPerWorker);
    WARN("planned " << plan.pieces() << " pieces in " << plan.planning_seconds() << " s");
  }
  auto check = [&](int64_t v) {
    for (int w = 0; w < kWorkersPerSide; ++w) {
      REQUIRE(engines[w]->version() == v);
      BufferMemory m = {engines[w]->buffer(0)};
      const Layout& mine = layouts[kWorkersPerSide + w];
      auto checked = CheckDestinations(mine, mine, FillSpec{static_cast<uint64_t>(v), std::vector<bool>(kPiecesPerWorker, false)}, m);
      INFO(checked.status().message());
      REQUIRE(checked.ok());
    }
  };
  for (int v = 1; v <= 5; ++v) refit(v);  // warm-up
  check(5);
  const ProcStats before = Read(pid);
  double seconds = 0;
  ProcStats middle;
  std::vector<int64_t> heap = {before.heap_rss_kib()};  // every 10 rounds
  for (int v = 6; v <= 105; ++v) {
    seconds += refit(v).seconds();
    if (v % 25 == 0) check(v);
    if (v == 55) middle = Read(pid);
    if (v % 10 == 5) heap.push_back(Read(pid).heap_rss_kib());
  }
  check(105);
  const ProcStats after = Read(pid);
  WARN("daemon after warm-up: " << before.rss_kib << " KiB resident (" << before.heap_rss_kib()
       << " outside thread stacks), " << before.threads << " threads, " << before.fds
       << " fds; after 50 rounds: " << middle.rss_kib << " KiB (" << middle.heap_rss_kib()
       << "); after 100 rounds: " << after.rss_kib << " KiB (" << after.heap_rss_kib() << "), "
       << after.threads << " threads, " << after.fds << " fds; " << seconds / 100 << " s per round");
  CHECK(after.fds == before.fds);
  CHECK(after.threads <= before.threads + 2);  // gRPC's pollers may come and go
  // A leak grows with every round; the allocator grows in rare steps (a new arena, a raised mmap
  // threshold: one step of ~60 MB was seen once, then nothing). So: the median growth per 10
  // rounds, outside thread stacks, must stay under 1 MiB (100 KB per round).
  std::vector<int64_t> deltas;
  for (size_t i = 1; i < heap.size(); ++i) deltas.push_back(heap[i] - heap[i - 1]);
  std::sort(deltas.begin(), deltas.end());
  const int64_t median = (deltas[deltas.size() / 2 - 1] + deltas[deltas.size() / 2]) / 2;
  WARN("growth per 10 rounds outside thread stacks (KiB, sorted): " << absl::StrJoin(deltas, " "));
  CHECK(median <= 1024);
}

}  // namespace
}  // namespace refit
