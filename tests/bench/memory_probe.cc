// The machine's state beside a CPU benchmark: how fast it computes, how fast it writes memory it
// already holds, and what the first touch of fresh memory costs. On a VM whose balloon reports
// free pages to the host, the last varies by 10-20x with how recently the pages were in use,
// while the first two hold still. Also how fast the memory just written reads at random
// addresses, independent 8-byte reads scattered over it: what address translation and the
// memory's latency cost this process. Run it beside plan_benchmark, alternated (docs/BENCHMARKS.md,
// "Planning Kimi-K2 on this VM").
//
//   memory_probe [--rounds N] [--fresh-mib M]     one JSON line per round
#include <sys/mman.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/cli_flags.h"

namespace refit {
namespace {

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

int Main(int argc, char** argv) {
  int64_t rounds = 5, fresh_mib = 1024, held_mib = 256;
  CliFlags flags("memory_probe", "[--rounds N] [--fresh-mib M] [--held-mib M]");
  flags.Int("rounds", &rounds, "rounds, one JSON line each");
  flags.Int("fresh-mib", &fresh_mib, "fresh memory mapped, written and unmapped per round");
  flags.Int("held-mib", &held_mib, "memory held all along and written once per round");
  if (!flags.Parse(argc, argv).empty()) flags.Fail("no positional arguments");
  if (rounds < 1 || fresh_mib < 1 || held_mib < 1) flags.Fail("every value must be positive");
  const size_t fresh = static_cast<size_t>(fresh_mib) << 20;
  std::vector<unsigned char> held(static_cast<size_t>(held_mib) << 20, 1);
  for (int64_t r = 0; r < rounds; ++r) {
    auto start = std::chrono::steady_clock::now();
    // Dependent multiply-adds: the core alone, no memory.
    uint64_t x = static_cast<uint64_t>(r);
    for (int i = 0; i < 100'000'000; ++i) x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const double compute = Seconds(start);
    start = std::chrono::steady_clock::now();
    memset(held.data(), static_cast<int>(r), held.size());
    const double held_write = Seconds(start);
    void* p = mmap(nullptr, fresh, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) flags.Fail("cannot map " + std::to_string(fresh_mib) + " MiB");
    (void)madvise(p, fresh, MADV_HUGEPAGE);  // as the planner advises its arrays
    start = std::chrono::steady_clock::now();
    memset(p, 1, fresh);
    const double fresh_write = Seconds(start);
    // Independent loads at pseudo-random 8-byte slots: misses, not the core, set the pace.
    const auto* words = static_cast<const uint64_t*>(p);
    const uint64_t slots = fresh / sizeof(uint64_t);
    constexpr int kReads = 16'000'000;
    uint64_t index = static_cast<uint64_t>(r) + 1, sum = 0;
    start = std::chrono::steady_clock::now();
    for (int i = 0; i < kReads; ++i) {
      index = index * 6364136223846793005ULL + 1442695040888963407ULL;
      sum += words[(index >> 17) % slots];
    }
    const double random_read = Seconds(start);
    munmap(p, fresh);
    printf(
        "{\"round\":%lld,\"compute_seconds\":%.4f,\"held_write_gbps\":%.2f,"
        "\"fresh_write_seconds_per_gib\":%.4f,\"random_read_ns\":%.2f,\"check\":%llu}\n",
        static_cast<long long>(r), compute, held.size() / held_write / 1e9,
        fresh_write / (static_cast<double>(fresh) / (1 << 30)), random_read / kReads * 1e9,
        static_cast<unsigned long long>((x ^ sum) & 1));
    fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) { return refit::Main(argc, argv); }
