// Plan installation at frontier scale: the InstallPlanRequest the coordinator sends
// to every daemon, its size in full and compact form, and what a daemon spends installing it.
// Layouts are generated as refit-layout writes them (client/models/layout_generator.h); the full
// form is what the coordinator gathers from the workers' registrations (every piece spelled out),
// the compact form what GroupPlanner caches and RoundDriver sends (proto/layout_codec.h). One JSON
// object per case on stdout.
//
//   bazel build -c opt //tests/bench:install_benchmark
//   bazel-bin/tests/bench/install_benchmark --case deepseek-v3 --repeat 3
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/models/layout_generator.h"
#include "common/cli_flags.h"
#include "daemon/node/node_agent.h"
#include "google/protobuf/util/json_util.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "proto/layout_codec.h"
#include "proto/refit.pb.h"
#include "tests/bench/frontier_cases.h"

namespace refit {
namespace {

using Case = FrontierCase;

double Now() { return SteadySeconds(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The request RoundDriver forms (daemon/coordinator/round_driver.cc), with these layouts.
v1::InstallPlanRequest Request(v1::Layout src, v1::Layout dst, int32_t nodes,
                               int64_t max_message_bytes, int32_t max_relay_depth) {
  v1::InstallPlanRequest r;
  r.set_group("policy");
  r.set_epoch(7);
  r.mutable_source()->Swap(&src);
  r.mutable_destination()->Swap(&dst);
  r.set_max_message_bytes(max_message_bytes);
  r.set_max_relay_depth(max_relay_depth);
  r.set_step_bytes(int64_t{128} << 20);
  r.set_zero_copy_min_bytes(int64_t{16} << 20);
  r.set_nccl_id(std::string(128, '\x5a'));  // an ncclUniqueId
  for (int32_t n = 0; n < nodes; ++n) {
    v1::NodeAddress* a = r.add_nodes();
    a->set_node(n);
    a->set_data_address(absl::StrCat("10.0.", n / 256, ".", n % 256, ":7101"));
  }
  return r;
}

struct Install {
  double decode = 0, expand = 0, validate = 0, plan = 0;
  double total() const { return decode + expand + validate + plan; }
};

// A daemon's InstallPlan (daemon/node/node_agent.cc) on the bytes it receives: gRPC's parse, then
// LayoutFromProto (which expands the compact form), ValidateLayout and MakePlan.
absl::StatusOr<Install> InstallOnNode(const std::string& wire) {
  Install t;
  double t0 = Now();
  v1::InstallPlanRequest request;
  if (!request.ParseFromString(wire)) return absl::InternalError("the request does not parse");
  double t1 = Now();
  t.decode = t1 - t0;
  auto src = LayoutFromProto(request.source());
  auto dst = LayoutFromProto(request.destination());
  if (!src.ok()) return src.status();
  if (!dst.ok()) return dst.status();
  double t2 = Now();
  t.expand = t2 - t1;
  if (auto s = ValidateLayout(*src, "source"); !s.ok()) return s;
  if (auto s = ValidateLayout(*dst, "destination"); !s.ok()) return s;
  double t3 = Now();
  t.validate = t3 - t2;
  auto plan = MakePlan(*src, *dst, PlanOptionsFor(request));
  if (!plan.ok()) return plan.status();
  t.plan = Now() - t3;
  return t;
}

std::string Seconds(double s) { return absl::StrFormat("%.3f", s); }

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  std::string only, configs = "tests/configs", show_buffer;
  int64_t repeat = 3, gpus_per_node = 8, max_message_bytes = 16 << 20, max_relay_depth = 0;
  bool install = true, install_full = true, plan_generated = false;
  CliFlags flags("install_benchmark", "[--case NAME] [--repeat N] [--configs DIR]");
  flags.String("case", &only, "run only this case (deepseek-v3, kimi-k2)");
  flags.Int("repeat", &repeat,
            "timed runs of each measurement after one warm-up; the median is reported");
  flags.String("configs", &configs, "folder with the models' config.json files");
  flags.Int("gpus-per-node", &gpus_per_node, "GPUs per node");
  flags.Int("max-message-bytes", &max_message_bytes,
            "the coordinator's --max-message-bytes (shipped in the request)");
  flags.Int("max-relay-depth", &max_relay_depth,
            "the coordinator's --max-relay-depth (shipped in the request)");
  flags.Bool("plan-generated", &plan_generated,
             "also plan the generated layouts once with the request's options "
             "(pieces in the generator's order, not grouped by buffer)");
  flags.String("show-buffer", &show_buffer,
               "print (stderr) the compact JSON of the first engine buffer whose name "
               "contains this");
  flags.Bool("install", &install, "time a node's install (--noinstall: sizes and encoding only)");
  flags.Bool("install-full", &install_full,
             "also time a node's install from the full form (--noinstall-full: not)");
  flags.Parse(argc, argv);
  if (repeat < 1) flags.Fail("--repeat must be >= 1");

  // The shapes of docs/BENCHMARKS.md, "Planning at frontier scale".
  std::vector<Case> cases;
  for (Case& c : FrontierCases()) {
    if (c.name == "deepseek-v3" || c.name == "kimi-k2")
      cases.push_back(std::move(c));  // DeepSeek-V3 and Kimi-K2
  }
  constexpr double kGrpcCap = 2147483647.0;           // gRPC's largest message (INT32_MAX)
  constexpr double kDaemonCap = 256.0 * 1024 * 1024;  // refitd's --max-rpc-bytes default
  for (const Case& c : cases) {
    if (!only.empty() && c.name != only) continue;
    auto text = ReadFile(absl::StrCat(configs, "/", c.config));
    if (!text.ok()) flags.Fail(std::string(text.status().message()));
    auto model = ParseModelConfig(*text);
    if (!model.ok()) flags.Fail(std::string(model.status().message()));
    const int32_t per_node = static_cast<int32_t>(gpus_per_node);
    auto src = MakeTrainerLayout(*model, c.trainer, {per_node, 0}, DType::kBF16);
    if (!src.ok()) flags.Fail(std::string(src.status().message()));
    const int32_t trainer_nodes = (c.trainer.World() + per_node - 1) / per_node;
    const int32_t inference_nodes = (c.inference.World() + per_node - 1) / per_node;
    auto dst = MakeInferenceLayout(*model, c.inference, {per_node, trainer_nodes}, DType::kBF16);
    if (!dst.ok()) flags.Fail(std::string(dst.status().message()));
    const int32_t nodes = trainer_nodes + inference_nodes;

    // What the coordinator holds today: every registered worker's pieces spelled out.
    v1::Layout full_src = LayoutToProto(*src, "trainers"),
               full_dst = LayoutToProto(*dst, "inference");
    // Its own decode (GroupPlanner plans from it), then the compaction it adds once per epoch.
    std::vector<double> coordinator_decode, compact_seconds;
    v1::Layout compact_src, compact_dst;
    for (int64_t r = 0; r <= repeat; ++r) {
      double t0 = Now();
      auto s = LayoutFromProto(full_src);
      auto d = LayoutFromProto(full_dst);
      if (!s.ok() || !d.ok()) flags.Fail("the full layouts do not decode");
      double t1 = Now();
      compact_src = CompactLayoutToProto(*s, "trainers");
      compact_dst = CompactLayoutToProto(*d, "inference");
      double t2 = Now();
      if (r == 0) continue;  // warm-up
      coordinator_decode.push_back(t1 - t0);
      compact_seconds.push_back(t2 - t1);
    }
    // Bytes after each step of compaction, cumulative (which redundancy is worth what).
    std::vector<std::string> steps;
    {
      CompactOptions o{false, false, false, false};
      const char* names[] = {"buffers_like", "tensor_index", "omit_whole_boxes", "runs"};
      bool* fields[] = {&o.buffers_like, &o.tensor_index, &o.omit_whole_boxes, &o.runs};
      for (int i = 0; i < 4; ++i) {
        *fields[i] = true;
        const int64_t s = CompactLayoutToProto(*src, "trainers", o).ByteSizeLong();
        const int64_t d = CompactLayoutToProto(*dst, "inference", o).ByteSizeLong();
        steps.push_back(
            absl::StrCat("\"+", names[i], "\":{\"source\":", s, ",\"destination\":", d, "}"));
      }
    }
    if (!show_buffer.empty()) {
      for (const v1::Worker& w : compact_dst.workers()) {
        auto it = std::find_if(w.buffers().begin(), w.buffers().end(), [&](const v1::Buffer& b) {
          return b.name().find(show_buffer) != std::string::npos;
        });
        if (it == w.buffers().end()) continue;
        std::string json;
        (void)google::protobuf::util::MessageToJsonString(*it, &json);
        std::fprintf(stderr, "worker %s: %s\n", w.name().c_str(), json.c_str());
        break;
      }
    }
    const size_t full_src_bytes = full_src.ByteSizeLong(), full_dst_bytes = full_dst.ByteSizeLong();
    // What is left once compact: the tensor tables (every name, shape, dtype; one per side).
    size_t tensor_table_bytes = 0;
    for (const v1::Layout* l : {&compact_src, &compact_dst}) {
      v1::Layout tensors_only;
      *tensors_only.mutable_tensors() = l->tensors();
      tensor_table_bytes += tensors_only.ByteSizeLong();
    }
    const v1::InstallPlanRequest full =
        Request(std::move(full_src), std::move(full_dst), nodes, max_message_bytes,
                static_cast<int32_t>(max_relay_depth));
    const v1::InstallPlanRequest compact =
        Request(std::move(compact_src), std::move(compact_dst), nodes, max_message_bytes,
                static_cast<int32_t>(max_relay_depth));
    const double full_bytes = full.ByteSizeLong(), compact_bytes = compact.ByteSizeLong();

    // Encode: what gRPC's serializer does once per node called.
    std::string full_wire, compact_wire;
    std::vector<double> encode_full, encode_compact;
    for (int64_t r = 0; r <= repeat; ++r) {
      double t0 = Now();
      full_wire.clear();
      full.SerializeToString(&full_wire);
      double t1 = Now();
      compact_wire.clear();
      compact.SerializeToString(&compact_wire);
      double t2 = Now();
      if (r == 0) continue;
      encode_full.push_back(t1 - t0);
      encode_compact.push_back(t2 - t1);
    }

    // A node's install, median of `repeat` after one warm-up.
    auto time_install = [&](const std::string& wire, Install* median) {
      std::vector<Install> runs;
      for (int64_t r = 0; r <= repeat; ++r) {
        auto t = InstallOnNode(wire);
        if (!t.ok()) flags.Fail(absl::StrCat(c.name, ": ", t.status().message()));
        if (r > 0) runs.push_back(*t);
      }
      std::sort(runs.begin(), runs.end(),
                [](const Install& a, const Install& b) { return a.total() < b.total(); });
      *median = runs[runs.size() / 2];
      std::vector<double> totals;
      for (const Install& i : runs) totals.push_back(i.total());
      return absl::StrJoin(totals, ",",
                           [](std::string* out, double s) { absl::StrAppend(out, Seconds(s)); });
    };
    std::string generated;
    if (plan_generated) {
      if (!ValidateLayout(*src, "source").ok() || !ValidateLayout(*dst, "destination").ok()) {
        flags.Fail("the generated layouts do not validate");
      }
      double t0 = Now();
      auto plan = MakePlan(*src, *dst, PlanOptionsFor(compact));
      if (!plan.ok()) flags.Fail(std::string(plan.status().message()));
      generated = absl::StrCat(",\"plan_generated_s\":", Seconds(Now() - t0));
    }
    Install compact_install, full_install;
    std::string compact_runs, full_runs;
    if (!install) install_full = false;
    if (install) compact_runs = time_install(compact_wire, &compact_install);
    if (install_full) full_runs = time_install(full_wire, &full_install);
    auto install_json = [](const Install& i, const std::string& runs) {
      return absl::StrCat("{\"decode_s\":", Seconds(i.decode), ",\"expand_s\":", Seconds(i.expand),
                          ",\"validate_s\":", Seconds(i.validate), ",\"plan_s\":", Seconds(i.plan),
                          ",\"total_s\":", Seconds(i.total()), ",\"runs_s\":[", runs, "]}");
    };
    std::printf(
        "{\"case\":\"%s\",\"trainer_gpus\":%d,\"engine_gpus\":%d,\"nodes\":%d,\"source_pieces\":%"
        "zu,"
        "\"destination_pieces\":%zu,\"source_workers\":%zu,\"destination_workers\":%zu,"
        "\"request_bytes_full\":%.0f,\"request_bytes_compact\":%.0f,\"ratio\":%.1f,"
        "\"full_of_grpc_cap\":%.3f,\"compact_of_grpc_cap\":%.5f,\"full_of_max_rpc_bytes\":%.3f,"
        "\"compact_of_max_rpc_bytes\":%.4f,\"layout_bytes_full\":{\"source\":%zu,\"destination\":%"
        "zu},"
        "\"layout_bytes_by_step\":{%s},\"compact_tensor_tables_bytes\":%zu,\"coordinator_decode_"
        "s\":%s,\"compact_s\":%s,\"encode_full_s\":%s,"
        "\"encode_compact_s\":%s%s%s%s%s%s,\"max_message_bytes\":%lld,\"max_relay_depth\":%lld,"
        "\"repeat\":%lld}\n",
        c.name.c_str(), c.trainer.World(), c.inference.World(), nodes, src->pieces.size(),
        dst->pieces.size(), src->workers.size(), dst->workers.size(), full_bytes, compact_bytes,
        full_bytes / compact_bytes, full_bytes / kGrpcCap, compact_bytes / kGrpcCap,
        full_bytes / kDaemonCap, compact_bytes / kDaemonCap, full_src_bytes, full_dst_bytes,
        absl::StrJoin(steps, ",").c_str(), tensor_table_bytes,
        Seconds(Median(coordinator_decode)).c_str(), Seconds(Median(compact_seconds)).c_str(),
        Seconds(Median(encode_full)).c_str(), Seconds(Median(encode_compact)).c_str(),
        install ? ",\"install_compact\":" : "",
        install ? install_json(compact_install, compact_runs).c_str() : "",
        install_full ? ",\"install_full\":" : "",
        install_full ? install_json(full_install, full_runs).c_str() : "", generated.c_str(),
        static_cast<long long>(max_message_bytes), static_cast<long long>(max_relay_depth),
        static_cast<long long>(repeat));
    std::fflush(stdout);
  }
  return 0;
}
