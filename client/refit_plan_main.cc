// refit-plan: plans the refit of a destination layout from a source layout, prints its summary
// and, with --verify, executes it on host memory and checks every destination byte.
//
//   refit-plan --src trainer.json --dst engine.json [--topology T.json] [--verify] [--json]
//
// Exit codes: 0 planned (and verified); 1 verification failed; 2 invalid input.
#include <cstdio>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli_flags.h"
#include "kernels/network_schedule.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "plan/verify.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

std::string Bytes(int64_t b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1000 && u < 4) v /= 1000, ++u;
  return u == 0 ? absl::StrCat(b, " B") : absl::StrFormat("%.2f %s", v, units[u]);
}

std::string Seconds(double s) {
  if (s >= 1) return absl::StrFormat("%.3f s", s);
  if (s >= 1e-3) return absl::StrFormat("%.3f ms", s * 1e3);
  return absl::StrFormat("%.1f us", s * 1e6);
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  std::string src_path, dst_path, topology_path;
  bool verify = false, json = false, routing = true;
  int64_t max_message_bytes = int64_t{64} << 20, verify_max_bytes = int64_t{8} << 30, seed = 1;
  bool executor = false;
  int64_t staging_bytes = int64_t{256} << 20, zero_copy_min_bytes = int64_t{16} << 20;
  CliFlags flags("refit-plan", "--src S.json --dst D.json [--topology T.json] [--verify] [--json]");
  flags.String("src", &src_path, "source (trainer) layout JSON");
  flags.String("dst", &dst_path, "destination (inference) layout JSON");
  flags.String("topology", &topology_path, "topology JSON (default: 8 GPUs per node, NVLink 450 GB/s, 50 GB/s NIC per GPU)");
  flags.Bool("verify", &verify, "execute the plan on host memory and check every destination byte");
  flags.Bool("json", &json, "print one JSON object instead of the summary for people");
  flags.Bool("routing", &routing, "topology routing: network once per node, then NVLink (--norouting: off)");
  flags.Int("max-message-bytes", &max_message_bytes, "upper bound on one message (staging chunk)");
  flags.Int("verify-max-bytes", &verify_max_bytes, "refuse to verify when both layouts' buffers exceed this");
  flags.Int("seed", &seed, "seed of the verification's source values");
  flags.Bool("executor", &executor, "also lay out every node's part for the cuda executor (steps, zero-copy, staging) "
                                    "and predict its network time with the model calibrated on 2 x H200");
  flags.Int("staging-bytes", &staging_bytes, "--executor: refitd's --staging-bytes (a step is half of it)");
  flags.Int("zero-copy-min-bytes", &zero_copy_min_bytes, "--executor: refitd's --zero-copy-min-bytes");
  flags.Parse(argc, argv);
  if (src_path.empty() || dst_path.empty()) flags.Fail("--src and --dst are required");

  auto load = [&](const std::string& path, const char* side) {
    auto layout = ReadLayoutFile(path, side);
    if (!layout.ok()) flags.Fail(std::string(layout.status().message()));
    return *std::move(layout);
  };
  const Layout src = load(src_path, "source");
  const Layout dst = load(dst_path, "destination");
  PlanOptions options;
  options.routing = routing;
  options.max_message_bytes = max_message_bytes;
  if (!topology_path.empty()) {
    auto text = ReadFile(topology_path);
    if (!text.ok()) flags.Fail(std::string(text.status().message()));
    auto topology = ParseTopologyJson(*text);
    if (!topology.ok()) flags.Fail(absl::StrCat(topology_path, ": ", topology.status().message()));
    options.topology = *topology;
  }
  auto plan = MakePlan(src, dst, options);
  if (!plan.ok()) flags.Fail(std::string(plan.status().message()));

  bool verified = false;
  VerifyReport report;
  if (verify) {
    auto v = VerifyOnHost(*plan, src, dst, static_cast<uint64_t>(seed), verify_max_bytes);
    if (!v.ok()) {
      std::fprintf(stderr, "refit-plan: verification failed: %s\n", std::string(v.status().message()).c_str());
      return v.status().code() == absl::StatusCode::kResourceExhausted ? 2 : 1;
    }
    verified = true;
    report = *v;
  }
  const PlanStats& s = plan->stats;
  if (json) {
    std::printf("%s\n", SummaryToJson(s, verified).c_str());
    return 0;
  }
  std::printf("plan: %lld tensors, %lld pieces -> %lld transfers, %lld descriptors, %lld messages\n",
              (long long)s.tensors, (long long)s.pieces, (long long)s.transfers,
              (long long)s.descriptors, (long long)s.messages);
  std::printf("bytes: %s = network %s + nvlink %s + local %s (forwarded over NVLink: %s)\n",
              Bytes(s.bytes_total).c_str(), Bytes(s.bytes_network).c_str(),
              Bytes(s.bytes_nvlink).c_str(), Bytes(s.bytes_local).c_str(),
              Bytes(s.bytes_forwarded).c_str());
  if (s.bytes_before_conversion != s.bytes_total) {
    // Quantized on the way (fp8 engines): what travels against what would at the source dtype.
    std::printf("converted: %s travel of %s at the source dtypes (%.2f); gathered for blocks cut between sources %s, "
                "scratch %s\n",
                Bytes(s.bytes_total).c_str(), Bytes(s.bytes_before_conversion).c_str(),
                s.bytes_before_conversion > 0 ? static_cast<double>(s.bytes_total) / s.bytes_before_conversion : 0.0,
                Bytes(s.bytes_gathered).c_str(), Bytes(s.scratch_bytes).c_str());
  }
  std::printf("busiest NIC: %s\n", Bytes(s.max_nic_bytes).c_str());
  std::printf("time: predicted %s, lower bound %s (ratio %.3f); planned in %s\n",
              Seconds(s.predicted_seconds).c_str(), Seconds(s.lower_bound_seconds).c_str(),
              s.lower_bound_seconds > 0 ? s.predicted_seconds / s.lower_bound_seconds : 1.0,
              Seconds(s.planning_seconds).c_str());
  if (executor) {
    // As every refitd --backend cuda lays it out (addresses do not matter for the shape).
    std::set<int32_t> nodes;
    for (const PlanGpu& g : plan->gpus) nodes.insert(g.node);
    double slowest = 0;
    for (int32_t node : nodes) {
      ScheduleOptions o;
      o.node = node;
      o.staging_budget = staging_bytes;
      o.step_bytes = staging_bytes / 2;
      o.zero_copy_min_bytes = zero_copy_min_bytes;
      auto schedule = BuildNodeSchedule(
          *plan, o,
          [&](int32_t) -> absl::StatusOr<std::pair<BufferAddresses, BufferAddresses>> {
            return std::make_pair(BufferAddresses(src.buffers.size(), 0), BufferAddresses(dst.buffers.size(), 0));
          },
          [](int32_t, int64_t) -> absl::StatusOr<uint64_t> { return 0; });
      if (!schedule.ok()) flags.Fail(absl::StrCat("node ", node, ": ", schedule.status().message()));
      if (!schedule->uses_network) continue;
      int64_t steps = 0, staging = 0, items = 0;
      for (const StageSchedule& st : schedule->stages) {
        steps += st.num_steps;
        for (const auto& [gpu, list] : st.steps) {
          for (const NetworkStep& step : list) items += static_cast<int64_t>(step.pack.items.size() + step.unpack.items.size());
        }
      }
      for (const auto& [gpu, r] : schedule->region_bytes) staging = std::max(staging, schedule->StagingBytes(gpu));
      const double seconds = PredictNetworkSeconds(*schedule, ExecutorModel());
      slowest = std::max(slowest, seconds);
      std::printf("executor node %d: %lld operations in %lld steps, %lld copy items, out %s, in %s (%s zero-copy), "
                  "staging %s per GPU, predicted %s\n",
                  node, (long long)schedule->network_ops, (long long)steps, (long long)items, Bytes(schedule->bytes_sent).c_str(),
                  Bytes(schedule->bytes_received).c_str(), Bytes(schedule->bytes_zero_copy).c_str(), Bytes(staging).c_str(),
                  Seconds(seconds).c_str());
    }
    std::printf("executor: predicted %s for the network part (slowest node)\n", Seconds(slowest).c_str());
  }
  if (verified) {
    std::printf("verified: %lld destination elements and %lld padding bytes exact (%s on the host)\n",
                (long long)report.elements_checked, (long long)report.padding_bytes_checked,
                Seconds(report.seconds).c_str());
  }
  return 0;
}
