// The host data plane's throughput between two daemons' HostBackends in one process, over
// loopback, with and without mutual TLS: one tensor on node 0 moved to node 1 in
// --message-bytes frames, --rounds timed rounds after --warmup ones. One JSON object per round on
// stdout, then one with the median. With --tls, --certs is a directory tools/gen_certs.sh made.
//
//   bazel build -c opt //tests/bench:host_data_benchmark
//   bash tools/gen_certs.sh /tmp/refit-certs 2
//   bazel-bin/tests/bench/host_data_benchmark --bytes 268435456 [--tls --certs /tmp/refit-certs]
#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cli_flags.h"
#include "daemon/dataplane/host/host_backend.h"
#include "plan/planner.h"
#include "plan/test_layouts.h"
#include "plan/validate.h"

namespace refit {
namespace {

int Run(int argc, char** argv) {
  int64_t bytes = int64_t{256} << 20, message_bytes = int64_t{16} << 20, rounds = 7, warmup = 2;
  bool tls = false;
  std::string certs;
  CliFlags flags("host_data_benchmark",
                 "the host data plane's throughput, plain TCP or mutual TLS");
  flags.Int("bytes", &bytes, "bytes moved from node 0 to node 1 per round (a multiple of 4096)");
  flags.Int("message-bytes", &message_bytes, "the plan's max_message_bytes (one frame each)");
  flags.Int("rounds", &rounds, "timed rounds");
  flags.Int("warmup", &warmup, "untimed rounds first");
  flags.Bool("tls", &tls, "mutual TLS on the data connection");
  flags.String("certs", &certs, "with --tls: a directory made by tools/gen_certs.sh DIR 2");
  flags.Parse(argc, argv);
  if (tls && certs.empty()) flags.Fail("--tls needs --certs DIR");
  if (bytes <= 0 || bytes % 4096 != 0) flags.Fail("--bytes must be a positive multiple of 4096");

  // One bf16 tensor of `bytes`, whole on node 0 and whole on node 1: every byte crosses once.
  const int64_t cols = 2048, rows = bytes / (2 * cols);
  Layout src, dst;
  testing::AddSplitTensor(src, "w", Dims{rows, cols}, DType::kBF16, 0, testing::EvenSplit(rows, 1),
                          {{0, 0}}, "trainer");
  testing::AddSplitTensor(dst, "w", Dims{rows, cols}, DType::kBF16, 0, testing::EvenSplit(rows, 1),
                          {{1, 0}}, "engine");
  if (!ValidateLayout(src, "source").ok() || !ValidateLayout(dst, "destination").ok())
    flags.Fail("bad layouts");
  PlanOptions options;
  options.max_message_bytes = message_bytes;
  auto planned = MakePlan(src, dst, options);
  if (!planned.ok()) flags.Fail(std::string(planned.status().message()));
  auto plan = std::make_shared<Plan>(*std::move(planned));

  std::vector<std::unique_ptr<HostBackend>> nodes;
  for (int n = 0; n < 2; ++n) {
    HostBackendOptions o;
    if (tls) {
      o.tls.cert = absl::StrCat(certs, "/node-", n, ".pem");
      o.tls.key = absl::StrCat(certs, "/node-", n, ".key");
      o.tls.ca = absl::StrCat(certs, "/ca.pem");
    }
    auto b = HostBackend::Start("127.0.0.1:0", o);
    if (!b.ok()) flags.Fail(std::string(b.status().message()));
    nodes.push_back(*std::move(b));
  }
  std::vector<std::byte> from(static_cast<size_t>(src.buffers[0].NumBytes()), std::byte{1});
  std::vector<std::byte> to(static_cast<size_t>(dst.buffers[0].NumBytes()), std::byte{0});
  const BufferMemory src_memory = {std::span<std::byte>(from)},
                     dst_memory = {std::span<std::byte>(to)};

  std::vector<double> seconds;
  for (int64_t round = 1; round <= warmup + rounds; ++round) {
    std::vector<absl::StatusOr<TransferStats>> results(2, absl::UnknownError("not run"));
    const absl::Time start = absl::Now();
    std::vector<std::thread> threads;
    for (int n = 0; n < 2; ++n) {
      threads.emplace_back([&, n] {
        TransferJob job;
        job.group = "bench";
        job.round_id = round;
        job.node = n;
        job.plan = plan;
        job.src = n == 0 ? src_memory : BufferMemory(1);
        job.dst = n == 1 ? dst_memory : BufferMemory(1);
        for (int k = 0; k < 2; ++k) job.data_addresses[k] = nodes[k]->data_address();
        job.deadline = absl::Now() + absl::Seconds(120);
        results[n] = nodes[n]->Transfer(job);
      });
    }
    for (auto& t : threads) t.join();
    const double s = absl::ToDoubleSeconds(absl::Now() - start);
    for (auto& r : results) {
      if (!r.ok()) flags.Fail(std::string(r.status().message()));
    }
    if (round <= warmup) continue;
    seconds.push_back(s);
    std::printf(
        "{\"tls\": %s, \"round\": %lld, \"bytes\": %lld, \"seconds\": %.6f, \"gb_per_s\": %.3f}\n",
        tls ? "true" : "false", static_cast<long long>(round - warmup),
        static_cast<long long>(plan->stats.bytes_network), s, plan->stats.bytes_network / s / 1e9);
  }
  std::sort(seconds.begin(), seconds.end());
  const double median = seconds[seconds.size() / 2];
  std::printf(
      "{\"tls\": %s, \"summary\": true, \"bytes\": %lld, \"message_bytes\": %lld, \"rounds\": %zu, "
      "\"median_seconds\": %.6f, \"median_gb_per_s\": %.3f}\n",
      tls ? "true" : "false", static_cast<long long>(plan->stats.bytes_network),
      static_cast<long long>(message_bytes), seconds.size(), median,
      plan->stats.bytes_network / median / 1e9);
  return 0;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) { return refit::Run(argc, argv); }
