// Planning benchmark: frontier-scale layout pairs generated in memory, validated and planned (on
// the machine's cores, or --planner-threads; `taskset -c 0` for one core). Prints one JSON object
// per case; --digest adds a hash of the whole plan, to check that a change leaves plans as they
// were.
//
//   bazel run -c opt //tests/bench:plan_benchmark -- --repeat 5 [--case deepseek-v3] [--configs
//   DIR]
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/models/fp8_layout.h"
#include "client/models/layout_generator.h"
#include "common/cli_flags.h"
#include "kernels/network_schedule.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"
#include "tests/bench/frontier_cases.h"

namespace refit {
namespace {

using Case = FrontierCase;

double Now() { return SteadySeconds(); }

// A digest of everything a plan holds except its timing: two plans with the same digest have the
// same descriptors in the same order, the same messages and the same statistics. FNV-1a over
// each field (not the structs' bytes, whose padding is unspecified).
class PlanHasher {
 public:
  void Add(std::initializer_list<int64_t> values) {
    for (int64_t v : values) {
      for (int i = 0; i < 8; ++i) {
        h_ = (h_ ^ ((static_cast<uint64_t>(v) >> (8 * i)) & 0xff)) * 0x100000001b3ull;
      }
    }
  }
  void Add(double v) { Add({static_cast<int64_t>(std::llround(v * 1e12))}); }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

uint64_t PlanDigest(const Plan& plan) {
  PlanHasher h;
  for (const PlanGpu& g : plan.gpus) h.Add({g.node, g.gpu});
  for (const ScratchBuffer& b : plan.scratch) {
    h.Add({b.gpu, b.worker, static_cast<int64_t>(b.dtype), b.elements});
  }
  h.Add({plan.first_scratch_buffer});
  for (const CopyDescriptor& d : plan.descriptors) {
    h.Add({d.src_buffer, d.dst_buffer, d.src_offset, d.dst_offset, d.inner});
    for (int i = 0; i < kMaxOuterDims; ++i) h.Add({d.count[i], d.src_stride[i], d.dst_stride[i]});
    h.Add({d.outer_rank, static_cast<int64_t>(d.src_dtype), static_cast<int64_t>(d.dst_dtype),
           d.src_is_destination, static_cast<int64_t>(d.op), d.quant_format, d.block_rows,
           d.block_cols, d.message});
  }
  for (int64_t i : plan.message_descriptors) h.Add({i});
  for (const Message& m : plan.messages) {
    h.Add({m.src_gpu, m.dst_gpu, m.stage, static_cast<int64_t>(m.link), m.bytes, m.first_descriptor,
           m.num_descriptors});
  }
  const PlanStats& s = plan.stats;
  h.Add({s.tensors, s.pieces, s.transfers, s.descriptors, s.messages, s.bytes_total,
         s.bytes_network, s.bytes_nvlink, s.bytes_local, s.bytes_forwarded,
         s.bytes_before_conversion, s.bytes_gathered, s.scratch_bytes, s.stages, s.max_nic_bytes});
  h.Add(s.predicted_seconds);
  h.Add(s.lower_bound_seconds);
  return h.value();
}

double ProcessCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
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
  int64_t gpus_per_node = 8;
  double nic_gbps = 50, nvlink_gbps = 450;
  bool executor = false;
  int64_t staging_bytes = int64_t{2} << 30, max_message_bytes = int64_t{64} << 20;
  CliFlags flags("plan_benchmark", "[--case NAME] [--repeat N] [--configs DIR] [topology flags]");
  flags.Int("gpus-per-node", &gpus_per_node,
            "GPUs per node (one NVLink domain); 72 for GB200 NVL72");
  flags.Double("nic-gbps", &nic_gbps, "GB/s per NIC, one NIC per GPU (50 = 400 Gb/s)");
  flags.Double("nvlink-gbps", &nvlink_gbps, "NVLink GB/s per GPU, each way");
  flags.Bool("executor", &executor,
             "also predict with the cuda executor's model (kernels/network_schedule.h), the "
             "wire at --nic-gbps, its other rates as calibrated on 2 x H200");
  flags.Int("staging-bytes", &staging_bytes, "--executor: refitd's --staging-bytes");
  flags.Int("max-message-bytes", &max_message_bytes, "the planner's bound on one message");
  int64_t max_relay_depth = PlanOptions().max_relay_depth;
  flags.Int("max-relay-depth", &max_relay_depth,
            "the planner's longest chain of relays between engine nodes (0: none)");
  flags.String("case", &only, "run only this case (deepseek-v3, kimi-k2, qwen3-235b)");
  flags.Int("repeat", &repeat, "planning runs per case; the median is reported");
  flags.String("configs", &configs, "folder with the models' config.json files");
  flags.Bool("routing", &routing, "topology routing on (--norouting: off)");
  std::string inference_dtype = "bf16";
  flags.String(
      "inference-dtype", &inference_dtype,
      "bf16, or fp8-block: engines load block fp8 (128x128, or the config's weight_block_size), "
      "quantized on the way");
  bool expert_parallel_engines = false;
  flags.Bool(
      "expert-parallel-engines", &expert_parallel_engines,
      "engines split the routed experts whole over their ranks (vLLM --enable-expert-parallel)");
  int64_t planner_threads = 0;
  flags.Int("planner-threads", &planner_threads,
            "threads the planner may use (0: as many as the machine has; the plan is the same "
            "whatever the count)");
  bool digest = false;
  flags.Bool("digest", &digest,
             "print a digest of the plan (descriptors, messages, statistics; not the timing): "
             "equal digests, equal plans");
  flags.Parse(argc, argv);
  if (repeat < 1) flags.Fail("--repeat must be >= 1");
  if (inference_dtype != "bf16" && inference_dtype != "fp8-block")
    flags.Fail("--inference-dtype must be bf16 or fp8-block");

  // The anchors' configurations (ANCHORS.md): NCCL M2N's NeMo-RL DeepSeek-V3 run, Perplexity's
  // Kimi-K2 256 -> 128 GPUs, and Qwen3-235B 128 -> 64.
  const std::vector<Case> cases = FrontierCases();
  for (Case c : cases) {
    if (!only.empty() && c.name != only) continue;
    c.inference.expert_parallel |= expert_parallel_engines;
    auto text = ReadFile(absl::StrCat(configs, "/", c.config));
    if (!text.ok()) flags.Fail(std::string(text.status().message()));
    auto model = ParseModelConfig(*text);
    if (!model.ok()) flags.Fail(std::string(model.status().message()));
    const double t0 = Now();
    const int32_t per_node = static_cast<int32_t>(gpus_per_node);
    auto src = MakeTrainerLayout(*model, c.trainer, {per_node, 0}, DType::kBF16);
    if (!src.ok()) flags.Fail(std::string(src.status().message()));
    const int32_t trainer_nodes = (c.trainer.World() + per_node - 1) / per_node;
    const int32_t inference_nodes = (c.inference.World() + per_node - 1) / per_node;
    auto dst = MakeInferenceLayout(*model, c.inference, {per_node, trainer_nodes}, DType::kBF16);
    if (!dst.ok()) flags.Fail(std::string(dst.status().message()));
    if (inference_dtype == "fp8-block") {
      Fp8LayoutOptions fp8;
      if (model->fp8.present)
        fp8.block_rows = model->fp8.block_rows, fp8.block_cols = model->fp8.block_cols;
      fp8.modules_to_not_convert = model->fp8.modules_to_not_convert;
      dst = QuantizeInferenceLayout(*dst, fp8);
      if (!dst.ok()) flags.Fail(std::string(dst.status().message()));
    }
    const double t1 = Now();
    if (auto s = ValidateLayout(*src, "source"); !s.ok()) flags.Fail(std::string(s.message()));
    if (auto s = ValidateLayout(*dst, "destination"); !s.ok()) flags.Fail(std::string(s.message()));
    const double validate_seconds = Now() - t1;
    PlanOptions options;  // by default 8 GPUs per node, NVLink 450 GB/s, one 400 Gb/s NIC per GPU
    options.routing = routing;
    options.max_message_bytes = max_message_bytes;
    options.max_relay_depth = static_cast<int32_t>(max_relay_depth);
    options.threads = static_cast<int32_t>(planner_threads);
    options.topology.gpus_per_node = per_node;
    options.topology.nics_per_node = per_node;
    options.topology.nic_gbps = nic_gbps;
    options.topology.nvlink_gbps = nvlink_gbps;
    // The broadcast path users run today (gather to one trainer rank, NCCL broadcast to every
    // engine, which slices what it needs): each inference node receives the whole model once
    // (at best over all its engine GPUs' NICs at once), and so does every engine GPU (over
    // NVLink). The gather is left out: a bound in broadcast's favour.
    double model_bytes = 0;
    for (const LogicalTensor& t : src->tensors)
      model_bytes += static_cast<double>(t.shape.NumElements()) * DTypeSize(t.dtype);
    std::map<int32_t, int32_t> engine_gpus_on;  // node -> inference GPUs there
    {
      std::set<std::pair<int32_t, int32_t>> seen;
      for (const Worker& w : dst->workers) {
        if (seen.insert({w.node, w.gpu}).second) ++engine_gpus_on[w.node];
      }
    }
    int32_t fewest = per_node;
    for (const auto& [node, n] : engine_gpus_on) fewest = std::min(fewest, n);
    const double broadcast_network_bytes = model_bytes * inference_nodes;
    const double broadcast_seconds =
        std::max(model_bytes / (fewest * nic_gbps * 1e9), model_bytes / (nvlink_gbps * 1e9));
    std::vector<double> seconds, cpu_seconds;
    PlanStats stats;
    uint64_t plan_digest = 0;
    double executor_seconds = 0, executor_seconds_no_ops = 0;
    for (int64_t r = 0; r < repeat; ++r) {
      const double cpu0 = ProcessCpuSeconds();
      auto plan = MakePlan(*src, *dst, options);
      if (!plan.ok()) flags.Fail(std::string(plan.status().message()));
      cpu_seconds.push_back(ProcessCpuSeconds() - cpu0);
      seconds.push_back(plan->stats.planning_seconds);
      stats = plan->stats;
      if (digest) {  // every run must make the same plan
        const uint64_t d = PlanDigest(*plan);
        if (r > 0 && d != plan_digest)
          flags.Fail(absl::StrCat(c.name, ": run ", r, " made a different plan"));
        plan_digest = d;
      }
      if (!executor || r + 1 < repeat) continue;
      // Every node as refitd --backend cuda lays it out; the slowest node's network time.
      std::set<int32_t> nodes;
      for (const PlanGpu& g : plan->gpus) nodes.insert(g.node);
      ExecutorModel model;
      model.wire_gbps = nic_gbps;
      for (int32_t node : nodes) {
        ScheduleOptions o;
        o.node = node;
        o.staging_budget = staging_bytes;
        o.step_bytes = staging_bytes / 2;
        auto schedule = BuildNodeSchedule(
            *plan, o,
            [&](int32_t) -> absl::StatusOr<std::pair<BufferAddresses, BufferAddresses>> {
              return std::make_pair(BufferAddresses(src->buffers.size(), 0),
                                    BufferAddresses(dst->buffers.size(), 0));
            },
            [](int32_t, int64_t) -> absl::StatusOr<uint64_t> { return 0; });
        if (!schedule.ok())
          flags.Fail(absl::StrCat(c.name, " node ", node, ": ", schedule.status().message()));
        executor_seconds = std::max(executor_seconds, PredictNetworkSeconds(*schedule, model));
        ExecutorModel free_ops = model;  // what the per-operation cost adds
        free_ops.per_op_us = 0;
        executor_seconds_no_ops =
            std::max(executor_seconds_no_ops, PredictNetworkSeconds(*schedule, free_ops));
      }
    }
    std::sort(seconds.begin(), seconds.end());
    const double median = seconds[seconds.size() / 2];
    std::sort(cpu_seconds.begin(), cpu_seconds.end());
    std::printf(
        "{\"case\":\"%s\",\"trainer_gpus\":%d,\"inference_gpus\":%d,\"tensors\":%lld,"
        "\"pieces\":%lld,\"destination_pieces\":%lld,\"transfers\":%lld,\"descriptors\":%lld,"
        "\"messages\":%lld,\"bytes_total\":%lld,"
        "\"bytes_network\":%lld,\"bytes_nvlink\":%lld,\"max_nic_bytes\":%lld,"
        "\"predicted_seconds\":%.6f,\"lower_bound_seconds\":%.6f,\"ratio\":%.4f,"
        "\"generate_seconds\":%.3f,\"validate_seconds\":%.3f,\"planning_seconds_median\":%.3f,"
        "\"planning_seconds_min\":%.3f,\"planning_seconds_max\":%.3f,\"planning_cpu_seconds_"
        "median\":%.3f,\"runs\":%lld,"
        "\"peak_rss_gib\":%.3f,\"routing\":%s,\"gpus_per_node\":%d,\"nic_gbps\":%.1f,\"nvlink_"
        "gbps\":%.1f,"
        "\"model_bytes\":%.0f,\"broadcast_network_bytes\":%.0f,\"broadcast_seconds_bound\":%.4f,"
        "\"max_relay_depth\":%lld,\"planner_threads\":%lld,\"executor_predicted_seconds\":%.4f,"
        "\"executor_seconds_without_operation_cost\":%.4f,"
        "\"inference_dtype\":\"%s\",\"expert_parallel_engines\":%s,\"bytes_before_conversion\":%"
        "lld,\"bytes_gathered\":%lld%s}\n",
        c.name.c_str(), c.trainer.World(), c.inference.World(), (long long)stats.tensors,
        (long long)stats.pieces, (long long)dst->pieces.size(), (long long)stats.transfers,
        (long long)stats.descriptors, (long long)stats.messages, (long long)stats.bytes_total,
        (long long)stats.bytes_network, (long long)stats.bytes_nvlink,
        (long long)stats.max_nic_bytes, stats.predicted_seconds, stats.lower_bound_seconds,
        stats.predicted_seconds / stats.lower_bound_seconds, t1 - t0, validate_seconds, median,
        seconds.front(), seconds.back(), cpu_seconds[cpu_seconds.size() / 2], (long long)repeat,
        PeakRssGiB(), routing ? "true" : "false", per_node, nic_gbps, nvlink_gbps, model_bytes,
        broadcast_network_bytes, broadcast_seconds, (long long)max_relay_depth,
        (long long)planner_threads, executor_seconds, executor_seconds_no_ops,
        inference_dtype.c_str(), c.inference.expert_parallel ? "true" : "false",
        (long long)stats.bytes_before_conversion, (long long)stats.bytes_gathered,
        digest ? absl::StrFormat(",\"plan_digest\":\"%016x\"", plan_digest).c_str() : "");
    std::fflush(stdout);
  }
  return 0;
}
