// refit-plan: plans the refit of a destination layout from a source layout, prints its summary
// and, with --verify, executes it on host memory and checks every destination byte.
//
//   refit-plan --src trainer.json --dst engine.json [--topology T.json] [--verify] [--json]
//
// Exit codes: 0 planned (and verified); 1 verification failed; 2 invalid input.
#include <cstdio>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cli_flags.h"
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

// The flags as given.
struct PlanFlags {
  std::string src_path, dst_path, topology_path;
  bool verify = false, json = false, routing = true, executor = false;
  int64_t max_message_bytes = int64_t{64} << 20, verify_max_bytes = int64_t{8} << 30, seed = 1;
  int64_t staging_bytes = int64_t{256} << 20, zero_copy_min_bytes = int64_t{16} << 20;
};

void RegisterFlags(CliFlags& flags, PlanFlags& f) {
  flags.String("src", &f.src_path, "source (trainer) layout JSON");
  flags.String("dst", &f.dst_path, "destination (inference) layout JSON");
  flags.String("topology", &f.topology_path,
               "topology JSON (default: 8 GPUs per node, NVLink 450 GB/s, 50 GB/s NIC per GPU)");
  flags.Bool("verify", &f.verify,
             "execute the plan on host memory and check every destination byte");
  flags.Bool("json", &f.json, "print one JSON object instead of the summary for people");
  flags.Bool("routing", &f.routing,
             "topology routing: network once per node, then NVLink (--norouting: off)");
  flags.Int("max-message-bytes", &f.max_message_bytes,
            "upper bound on one message (staging chunk)");
  flags.Int("verify-max-bytes", &f.verify_max_bytes,
            "refuse to verify when both layouts' buffers exceed this");
  flags.Int("seed", &f.seed, "seed of the verification's source values");
  flags.Bool("executor", &f.executor,
             "also lay out every node's part for the cuda executor (steps, zero-copy, staging) "
             "and predict its network time with the model calibrated on 2 x H200");
  flags.Int("staging-bytes", &f.staging_bytes,
            "--executor: refitd's --staging-bytes (a step is half of it)");
  flags.Int("zero-copy-min-bytes", &f.zero_copy_min_bytes,
            "--executor: refitd's --zero-copy-min-bytes");
}

absl::StatusOr<PlanOptions> MakePlanOptions(const PlanFlags& f) {
  PlanOptions options;
  options.routing = f.routing;
  options.max_message_bytes = f.max_message_bytes;
  if (f.topology_path.empty()) return options;
  absl::StatusOr<std::string> text = ReadFile(f.topology_path);
  if (!text.ok()) return text.status();
  absl::StatusOr<Topology> topology = ParseTopologyJson(*text);
  if (!topology.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.topology_path, ": ", topology.status().message()));
  }
  options.topology = *topology;
  return options;
}

void PrintPlanStats(const PlanStats& s) {
  std::printf(
      "plan: %lld tensors, %lld pieces -> %lld transfers, %lld descriptors, %lld messages\n",
      (long long)s.tensors, (long long)s.pieces, (long long)s.transfers, (long long)s.descriptors,
      (long long)s.messages);
  std::printf("bytes: %s = network %s + nvlink %s + local %s (forwarded over NVLink: %s)\n",
              Bytes(s.bytes_total).c_str(), Bytes(s.bytes_network).c_str(),
              Bytes(s.bytes_nvlink).c_str(), Bytes(s.bytes_local).c_str(),
              Bytes(s.bytes_forwarded).c_str());
  if (s.bytes_before_conversion != s.bytes_total) {
    // Quantized on the way (fp8 engines): what travels against what would at the source dtype.
    std::printf(
        "converted: %s travel of %s at the source dtypes (%.2f); gathered for blocks cut between "
        "sources %s, scratch %s\n",
        Bytes(s.bytes_total).c_str(), Bytes(s.bytes_before_conversion).c_str(),
        s.bytes_before_conversion > 0
            ? static_cast<double>(s.bytes_total) / s.bytes_before_conversion
            : 0.0,
        Bytes(s.bytes_gathered).c_str(), Bytes(s.scratch_bytes).c_str());
  }
  std::printf("busiest NIC: %s\n", Bytes(s.max_nic_bytes).c_str());
  std::printf("time: predicted %s, lower bound %s (ratio %.3f); planned in %s\n",
              Seconds(s.predicted_seconds).c_str(), Seconds(s.lower_bound_seconds).c_str(),
              s.lower_bound_seconds > 0 ? s.predicted_seconds / s.lower_bound_seconds : 1.0,
              Seconds(s.planning_seconds).c_str());
}

// `node`'s part as every refitd --backend cuda lays it out (addresses do not matter for the
// shape).
absl::StatusOr<NodeSchedule> ScheduleNode(const Plan& plan, const Layout& src, const Layout& dst,
                                          int32_t node, const PlanFlags& f) {
  ScheduleOptions o;
  o.node = node;
  o.staging_budget = f.staging_bytes;
  o.step_bytes = f.staging_bytes / 2;
  o.zero_copy_min_bytes = f.zero_copy_min_bytes;
  return BuildNodeSchedule(
      plan, o,
      [&](int32_t) -> absl::StatusOr<std::pair<BufferAddresses, BufferAddresses>> {
        return std::make_pair(BufferAddresses(src.buffers.size(), 0),
                              BufferAddresses(dst.buffers.size(), 0));
      },
      [](int32_t, int64_t) -> absl::StatusOr<uint64_t> { return 0; });
}

// Prints a node's schedule and returns its predicted network seconds.
double PrintNodeSchedule(int32_t node, const NodeSchedule& schedule) {
  int64_t steps = 0, staging = 0, items = 0;
  for (const StageSchedule& st : schedule.stages) {
    steps += st.num_steps;
    for (const auto& [gpu, list] : st.steps) {
      for (const NetworkStep& step : list) {
        items += static_cast<int64_t>(step.pack.items.size() + step.unpack.items.size());
      }
    }
  }
  for (const auto& [gpu, r] : schedule.region_bytes) {
    staging = std::max(staging, schedule.StagingBytes(gpu));
  }
  const double seconds = PredictNetworkSeconds(schedule, ExecutorModel());
  std::printf(
      "executor node %d: %lld operations in %lld steps, %lld copy items, out %s, in %s (%s "
      "zero-copy), staging %s per GPU, predicted %s\n",
      node, (long long)schedule.network_ops, (long long)steps, (long long)items,
      Bytes(schedule.bytes_sent).c_str(), Bytes(schedule.bytes_received).c_str(),
      Bytes(schedule.bytes_zero_copy).c_str(), Bytes(staging).c_str(), Seconds(seconds).c_str());
  return seconds;
}

// Each node's part for the cuda executor, printed as it is laid out, then the slowest node's
// network time. A node that cannot be laid out stops it there, naming the node.
absl::Status PrintExecutorPrediction(const Plan& plan, const Layout& src, const Layout& dst,
                                     const PlanFlags& f) {
  std::set<int32_t> nodes;
  for (const PlanGpu& g : plan.gpus) nodes.insert(g.node);
  double slowest = 0;
  for (int32_t node : nodes) {
    absl::StatusOr<NodeSchedule> schedule = ScheduleNode(plan, src, dst, node, f);
    if (!schedule.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("node ", node, ": ", schedule.status().message()));
    }
    if (!schedule->uses_network) continue;
    slowest = std::max(slowest, PrintNodeSchedule(node, *schedule));
  }
  std::printf("executor: predicted %s for the network part (slowest node)\n",
              Seconds(slowest).c_str());
  return absl::OkStatus();
}

void PrintVerified(const VerifyReport& report) {
  std::printf("verified: %lld destination elements and %lld padding bytes exact (%s on the host)\n",
              (long long)report.elements_checked, (long long)report.padding_bytes_checked,
              Seconds(report.seconds).c_str());
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  CliFlags flags("refit-plan", "--src S.json --dst D.json [--topology T.json] [--verify] [--json]");
  PlanFlags f;
  RegisterFlags(flags, f);
  flags.Parse(argc, argv);
  if (f.src_path.empty() || f.dst_path.empty()) flags.Fail("--src and --dst are required");
  const absl::StatusOr<Layout> src = ReadLayoutFile(f.src_path, "source");
  if (!src.ok()) flags.Fail(std::string(src.status().message()));
  const absl::StatusOr<Layout> dst = ReadLayoutFile(f.dst_path, "destination");
  if (!dst.ok()) flags.Fail(std::string(dst.status().message()));
  const absl::StatusOr<PlanOptions> options = MakePlanOptions(f);
  if (!options.ok()) flags.Fail(std::string(options.status().message()));
  const absl::StatusOr<Plan> plan = MakePlan(*src, *dst, *options);
  if (!plan.ok()) flags.Fail(std::string(plan.status().message()));

  std::optional<VerifyReport> verified;
  if (f.verify) {
    auto v = VerifyOnHost(*plan, *src, *dst, static_cast<uint64_t>(f.seed), f.verify_max_bytes);
    if (!v.ok()) {
      std::fprintf(stderr, "refit-plan: verification failed: %s\n",
                   std::string(v.status().message()).c_str());
      return v.status().code() == absl::StatusCode::kResourceExhausted ? 2 : 1;
    }
    verified = *v;
  }
  if (f.json) {
    std::printf("%s\n", SummaryToJson(plan->stats, verified.has_value()).c_str());
    return 0;
  }
  PrintPlanStats(plan->stats);
  if (f.executor) {
    if (absl::Status s = PrintExecutorPrediction(*plan, *src, *dst, f); !s.ok()) {
      flags.Fail(std::string(s.message()));
    }
  }
  if (verified) PrintVerified(*verified);
  return 0;
}
