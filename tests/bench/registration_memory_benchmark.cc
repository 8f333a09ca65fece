// Registration memory at scale: what --workers workers of --pieces pieces each, registering at
// once, cost a node and its coordinator (tests/bench/registration_memory.h), against fresh refitd
// processes each run. One JSON object on stdout: every run and the medians; "per_wire" ratios are
// of all the workers' registrations' size on the wire.
//
//   bazel build -c opt //daemon:refitd //tests/bench:registration_memory_benchmark
//   bazel-bin/tests/bench/registration_memory_benchmark --refitd bazel-bin/daemon/refitd --pieces
//   1000000 --runs 3 bazel-bin/tests/bench/registration_memory_benchmark --refitd
//   bazel-bin/daemon/refitd --pieces 250000 --workers 4
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/cli_flags.h"
#include "tests/bench/registration_memory.h"

namespace refit {
namespace {

template <typename F>
double Median(const std::vector<RegistrationMemory>& runs, F f) {
  std::vector<double> v;
  for (const auto& r : runs) v.push_back(static_cast<double>(f(r)));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::string DaemonJson(const DaemonMemory& m, int64_t wire) {
  return absl::StrFormat(
      "{\"rss_before\":%d,\"rss_registered\":%d,\"rss_unregistered\":%d,\"anon_before\":%d,"
      "\"anon_registered\":%d,\"anon_unregistered\":%d,\"hwm_registered\":%d,\"growth\":%d,"
      "\"retained\":%d,"
      "\"peak\":%d,\"growth_per_wire\":%.2f,\"peak_per_wire\":%.2f}",
      m.rss_before, m.rss_registered, m.rss_unregistered, m.anon_before, m.anon_registered,
      m.anon_unregistered, m.hwm_registered, m.growth(), m.retained(), m.peak(),
      static_cast<double>(m.growth()) / static_cast<double>(wire),
      static_cast<double>(m.peak()) / static_cast<double>(wire));
}

int Main(int argc, char** argv) {
  RegistrationMemoryOptions o;
  int64_t runs = 3;
  CliFlags flags("registration_memory_benchmark", "[--refitd PATH] [--pieces N] [--runs N]");
  flags.String("refitd", &o.refitd, "the refitd binary");
  flags.Int("pieces", &o.pieces, "pieces of each worker");
  flags.Int("workers", &o.workers, "workers registering at once");
  flags.Int("rows-per-tensor", &o.rows_per_tensor, "pieces per tensor and buffer");
  flags.Double("settle", &o.settle_seconds, "seconds to wait before each memory reading");
  flags.Int("runs", &runs, "runs (fresh daemons each); medians reported");
  flags.Parse(argc, argv);
  if (o.pieces < 1 || o.rows_per_tensor < 1 || o.workers < 1 || runs < 1) {
    flags.Fail("--pieces, --rows-per-tensor, --workers and --runs must be positive");
  }
  std::vector<RegistrationMemory> results;
  std::vector<std::string> each;
  for (int64_t i = 0; i < runs; ++i) {
    auto r = MeasureRegistration(o);
    if (!r.ok()) {
      std::fprintf(stderr, "registration_memory_benchmark: %s\n", r.status().ToString().c_str());
      return 1;
    }
    results.push_back(*r);
    const int64_t all_wire = r->wire_bytes * r->workers;
    each.push_back(absl::StrFormat("{\"register_seconds\":%.3f,\"node\":%s,\"coordinator\":%s}",
                                   r->register_seconds, DaemonJson(r->node, all_wire),
                                   DaemonJson(r->coordinator, all_wire)));
    std::fprintf(stderr,
                 "run %d: register %.3f s, node +%.1f MB (peak +%.1f MB, retained %.1f MB), "
                 "coordinator +%.1f MB "
                 "(peak +%.1f MB, retained %.1f MB), wire %.1f MB\n",
                 static_cast<int>(i), r->register_seconds, r->node.growth() / 1e6,
                 r->node.peak() / 1e6, r->node.retained() / 1e6, r->coordinator.growth() / 1e6,
                 r->coordinator.peak() / 1e6, r->coordinator.retained() / 1e6, all_wire / 1e6);
  }
  const RegistrationMemory& first = results.front();
  const double wire = static_cast<double>(first.wire_bytes * first.workers);
  auto med = [&](auto f) { return Median(results, f); };
  const std::string json = absl::StrFormat(
      "{\"pieces\":%d,\"tensors\":%d,\"buffers\":%d,\"workers\":%d,\"wire_bytes\":%d,\"runs\":%d,"
      "\"median\":{\"register_seconds\":%.3f,\"node_growth\":%.0f,\"node_retained\":%.0f,"
      "\"coordinator_growth\":%.0f,"
      "\"coordinator_retained\":%.0f,\"node_growth_per_wire\":%.2f,\"coordinator_growth_per_wire\":"
      "%.2f,"
      "\"node_peak_per_wire\":%.2f,\"coordinator_peak_per_wire\":%.2f},"
      "\"each\":[%s]}\n",
      first.pieces, first.tensors, first.buffers, first.workers, first.wire_bytes,
      static_cast<int>(runs), med([](const RegistrationMemory& r) { return r.register_seconds; }),
      med([](const RegistrationMemory& r) { return r.node.growth(); }),
      med([](const RegistrationMemory& r) { return r.node.retained(); }),
      med([](const RegistrationMemory& r) { return r.coordinator.growth(); }),
      med([](const RegistrationMemory& r) { return r.coordinator.retained(); }),
      med([](const RegistrationMemory& r) { return r.node.growth(); }) / wire,
      med([](const RegistrationMemory& r) { return r.coordinator.growth(); }) / wire,
      med([](const RegistrationMemory& r) { return r.node.peak(); }) / wire,
      med([](const RegistrationMemory& r) { return r.coordinator.peak(); }) / wire,
      absl::StrJoin(each, ","));
  std::fputs(json.c_str(), stdout);
  return 0;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) { return refit::Main(argc, argv); }
