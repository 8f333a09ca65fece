// Planning benchmark: frontier-scale layout pairs generated in memory, validated and planned on
// one core. Prints one JSON object per case (machine-readable) and a table for people.
//
//   bazel run -c opt //tests/bench:plan_benchmark -- --repeat 5 [--case deepseek-v3] [--configs DIR]
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli_flags.h"
#include "client/layout_generator.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

struct Case {
  std::string name, config;
  TrainerParallelism trainer;
  InferenceParallelism inference;
};

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double PeakRssGiB() {
  rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / (1024.0 * 1024.0);  // ru_maxrss is in KiB
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  std::string only, configs = "tests/configs";
  int64_t repeat = 3;
  bool routing = true;
  CliFlags flags("plan_benchmark", "[--case NAME] [--repeat N] [--configs DIR]");
  flags.String("case", &only, "run only this case (deepseek-v3, kimi-k2, qwen3-235b)");
  flags.Int("repeat", &repeat, "planning runs per case; the median is reported");
  flags.String("configs", &configs, "folder with the models' config.json files");
  flags.Bool("routing", &routing, "topology routing on (--norouting: off)");
  flags.Parse(argc, argv);
  if (repeat < 1) flags.Fail("--repeat must be >= 1");

  // The anchors' configurations (ANCHORS.md): NCCL M2N's NeMo-RL DeepSeek-V3 run, Perplexity's
  // Kimi-K2 256 -> 128 GPUs, and Qwen3-235B as issue 5 names it.
  const std::vector<Case> cases = {
      {"deepseek-v3", "deepseek-v3.json", {1, 8, 16, 16, 1, 0}, {16, 8, false}},
      {"kimi-k2", "kimi-k2.json", {2, 8, 16, 16, 1, 0}, {16, 8, false}},
      {"qwen3-235b", "qwen3-235b-a22b.json", {2, 4, 16, 8, 2, 0}, {8, 8, false}},
  };
  for (const Case& c : cases) {
    if (!only.empty() && c.name != only) continue;
    auto text = ReadFile(absl::StrCat(configs, "/", c.config));
    if (!text.ok()) flags.Fail(std::string(text.status().message()));
    auto model = ParseModelConfig(*text);
    if (!model.ok()) flags.Fail(std::string(model.status().message()));
    const double t0 = Now();
    auto src = MakeTrainerLayout(*model, c.trainer, {8, 0}, DType::kBF16);
    if (!src.ok()) flags.Fail(std::string(src.status().message()));
    const int32_t trainer_nodes = (c.trainer.World() + 7) / 8;
    auto dst = MakeInferenceLayout(*model, c.inference, {8, trainer_nodes}, DType::kBF16);
    if (!dst.ok()) flags.Fail(std::string(dst.status().message()));
    const double t1 = Now();
    if (auto s = ValidateLayout(*src, "source"); !s.ok()) flags.Fail(std::string(s.message()));
    if (auto s = ValidateLayout(*dst, "destination"); !s.ok()) flags.Fail(std::string(s.message()));
    const double validate_seconds = Now() - t1;
    PlanOptions options;  // 8 GPUs per node, NVLink 450 GB/s, one 400 Gb/s NIC per GPU
    options.routing = routing;
    std::vector<double> seconds;
    PlanStats stats;
    for (int64_t r = 0; r < repeat; ++r) {
      auto plan = MakePlan(*src, *dst, options);
      if (!plan.ok()) flags.Fail(std::string(plan.status().message()));
      seconds.push_back(plan->stats.planning_seconds);
      stats = plan->stats;
    }
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds[seconds.size() / 2];
    std::printf(
        "{\"case\":\"%s\",\"trainer_gpus\":%d,\"inference_gpus\":%d,\"tensors\":%lld,"
        "\"pieces\":%lld,\"transfers\":%lld,\"messages\":%lld,\"bytes_total\":%lld,"
        "\"bytes_network\":%lld,\"bytes_nvlink\":%lld,\"max_nic_bytes\":%lld,"
        "\"predicted_seconds\":%.6f,\"lower_bound_seconds\":%.6f,\"ratio\":%.4f,"
        "\"generate_seconds\":%.3f,\"validate_seconds\":%.3f,\"planning_seconds_median\":%.3f,"
        "\"planning_seconds_min\":%.3f,\"planning_seconds_max\":%.3f,\"runs\":%lld,"
        "\"peak_rss_gib\":%.3f}\n",
        c.name.c_str(), c.trainer.World(), c.inference.World(), (long long)stats.tensors,
        (long long)stats.pieces, (long long)stats.transfers, (long long)stats.messages,
        (long long)stats.bytes_total, (long long)stats.bytes_network, (long long)stats.bytes_nvlink,
        (long long)stats.max_nic_bytes, stats.predicted_seconds, stats.lower_bound_seconds,
        stats.predicted_seconds / stats.lower_bound_seconds, t1 - t0, validate_seconds, median,
        seconds.front(), seconds.back(), (long long)repeat, PeakRssGiB());
    std::fflush(stdout);
  }
  return 0;
}
