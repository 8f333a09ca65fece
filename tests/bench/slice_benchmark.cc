// How a frontier plan is divided among the nodes (docs/PLANNING.md, "Dividing the plan"): the
// coordinator plans once, then cuts and encodes each node's slice; each node decodes, checks and
// installs its own. Per case, one JSON object on stdout: the plan's time, the coordinator's
// slicing (per node and in all), each slice's bytes and descriptors, and each node's install as
// NodeAgent::InstallPlan does it (parse the request, check both digests, SliceFromWire with its
// bounds checks), wall and CPU time, and memory.
//
//   bazel build -c opt //tests/bench:slice_benchmark
//   bazel-bin/tests/bench/slice_benchmark --case deepseek-v3 --repeat 3
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/models/layout_generator.h"
#include "common/cli_flags.h"
#include "plan/plan_slice.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"
#include "proto/plan_codec.h"
#include "proto/refit.pb.h"
#include "tests/bench/frontier_cases.h"

namespace refit {
namespace {

double Now() { return SteadySeconds(); }

double CpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + t.tv_nsec * 1e-9;
}

double PeakRssGiB() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / (1024.0 * 1024.0);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::string Num(double v) { return absl::StrCat(v); }

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  std::string only, configs = "tests/configs";
  int64_t repeat = 3, gpus_per_node = 8, max_message_bytes = 16 << 20,
          zero_copy_min = int64_t{16} << 20;
  CliFlags flags("slice_benchmark", "[--case NAME] [--repeat N] [--configs DIR]");
  flags.String("case", &only, "run only this case (deepseek-v3, kimi-k2, qwen3-235b)");
  flags.Int("repeat", &repeat, "timed installs per node after one warm-up; the median is reported");
  flags.String("configs", &configs, "folder with the models' config.json files");
  flags.Int("gpus-per-node", &gpus_per_node, "GPUs per node");
  flags.Int("max-message-bytes", &max_message_bytes, "the coordinator's --max-message-bytes");
  flags.Int("zero-copy-min-bytes", &zero_copy_min,
            "other nodes' network descriptors a slice keeps (refitd: 16 MiB)");
  flags.Parse(argc, argv);
  if (repeat < 1) flags.Fail("--repeat must be >= 1");
  for (const FrontierCase& c : FrontierCases()) {
    if (!only.empty() && c.name != only) continue;
    auto text = ReadFile(absl::StrCat(configs, "/", c.config));
    if (!text.ok()) flags.Fail(std::string(text.status().message()));
    auto model = ParseModelConfig(*text);
    if (!model.ok()) flags.Fail(std::string(model.status().message()));
    const int32_t per_node = static_cast<int32_t>(gpus_per_node);
    auto src = MakeTrainerLayout(*model, c.trainer, {per_node, 0}, DType::kBF16);
    if (!src.ok()) flags.Fail(std::string(src.status().message()));
    const int32_t trainer_nodes = (c.trainer.World() + per_node - 1) / per_node;
    auto dst = MakeInferenceLayout(*model, c.inference, {per_node, trainer_nodes}, DType::kBF16);
    if (!dst.ok()) flags.Fail(std::string(dst.status().message()));
    if (!ValidateLayout(*src, "source").ok() || !ValidateLayout(*dst, "destination").ok()) {
      flags.Fail("the generated layouts do not validate");
    }
    // The coordinator: digest of the compact layouts, one plan.
    PlanOptions options;
    options.max_message_bytes = max_message_bytes;
    options.max_relay_depth = 0;  // refitd's default
    options.topology.gpus_per_node = per_node;
    options.topology.nics_per_node = per_node;
    double t0 = Now();
    const std::string digest =
        PlanInputsDigest(CompactLayoutToProto(*src), CompactLayoutToProto(*dst), options);
    const double digest_seconds = Now() - t0;
    t0 = Now();
    const double cpu0 = CpuSeconds();
    auto plan = MakePlan(*src, *dst, options);
    if (!plan.ok()) flags.Fail(std::string(plan.status().message()));
    const double plan_seconds = Now() - t0, plan_cpu = CpuSeconds() - cpu0;
    const double rss_after_plan = PeakRssGiB();
    std::set<int32_t> nodes;
    for (const PlanGpu& g : plan->gpus) nodes.insert(g.node);

    std::vector<double> slice_seconds, install_seconds, install_cpu, slice_bytes, slice_descriptors;
    double slice_total = 0;
    for (int32_t node : nodes) {
      // The coordinator's part for this node (daemon/coordinator/plan_slices.cc SliceRequest).
      double s0 = Now();
      v1::InstallPlanRequest request;
      request.set_group("policy");
      request.set_epoch(1);
      request.set_plan_digest(digest);
      request.set_slice(SliceToWire(SliceOfPlan(*plan, node, zero_copy_min), node, *src, *dst));
      request.set_slice_digest(Sha256(request.slice()));
      const std::string wire = request.SerializeAsString();
      slice_seconds.push_back(Now() - s0);
      slice_total += slice_seconds.back();
      slice_bytes.push_back(static_cast<double>(wire.size()));
      // The node's install (daemon/node/node_agent.cc InstallPlan), median of `repeat`.
      std::vector<double> wall, cpu;
      for (int64_t r = 0; r <= repeat; ++r) {
        const double w0 = Now(), c0 = CpuSeconds();
        v1::InstallPlanRequest got;
        if (!got.ParseFromString(wire)) flags.Fail("the request does not parse");
        if (Sha256(got.slice()) != got.slice_digest()) flags.Fail("the slice's digest differs");
        auto decoded = SliceFromWire(got.slice(), node);
        if (!decoded.ok())
          flags.Fail(absl::StrCat(c.name, " node ", node, ": ", decoded.status().message()));
        if (r == 0)
          slice_descriptors.push_back(static_cast<double>(decoded->plan.descriptors.size()));
        if (r > 0) wall.push_back(Now() - w0), cpu.push_back(CpuSeconds() - c0);
      }
      install_seconds.push_back(Median(wall));
      install_cpu.push_back(Median(cpu));
    }
    double install_cpu_sum = 0;
    for (double v : install_cpu) install_cpu_sum += v;
    auto stats = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return absl::StrCat("{\"min\":", Num(v.front()), ",\"median\":", Num(v[v.size() / 2]),
                          ",\"max\":", Num(v.back()), "}");
    };
    std::printf(
        "{\"case\":\"%s\",\"nodes\":%zu,\"descriptors\":%zu,\"messages\":%zu,\"plan_seconds\":%.3f,"
        "\"plan_cpu_seconds\":%.3f,"
        "\"digest_seconds\":%.3f,\"coordinator_slicing_seconds_total\":%.3f,\"coordinator_slicing_"
        "seconds\":%s,"
        "\"slice_bytes\":%s,\"slice_descriptors\":%s,\"node_install_seconds\":%s,\"node_install_"
        "cpu_seconds\":%s,"
        "\"node_install_cpu_sum_over_plan_cpu\":%.3f,\"peak_rss_gib_after_plan\":%.3f,\"peak_rss_"
        "gib\":%.3f,"
        "\"max_message_bytes\":%lld,\"repeat\":%lld}\n",
        c.name.c_str(), nodes.size(), plan->descriptors.size(), plan->messages.size(), plan_seconds,
        plan_cpu, digest_seconds, slice_total, stats(slice_seconds).c_str(),
        stats(slice_bytes).c_str(), stats(slice_descriptors).c_str(),
        stats(install_seconds).c_str(), stats(install_cpu).c_str(), install_cpu_sum / plan_cpu,
        rss_after_plan, PeakRssGiB(), (long long)max_message_bytes, (long long)repeat);
    std::fflush(stdout);
  }
  return 0;
}
