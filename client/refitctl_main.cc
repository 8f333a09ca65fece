// refitctl: the operator's command line for a refit cluster, in the style of kubectl/etcdctl:
// human tables by default, -o json for machines.
//
//   refitctl [--daemon ADDR] [-o table|json] status
//   refitctl workers [GROUP]
//   refitctl plan GROUP
//   refitctl refit GROUP VERSION [--no-wait]
//   refitctl watch [GROUP]
//
// Exit codes: 0 success; 1 the cluster said no (the gRPC code and message are printed);
// 2 bad usage.
#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli_flags.h"
#include "google/protobuf/util/json_util.h"
#include "proto/refit.grpc.pb.h"

namespace refit {
namespace {

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

int Fail(const grpc::Status& s) {
  static const char* names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                                "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int code = static_cast<int>(s.error_code());
  std::fprintf(stderr, "refitctl: %s: %s\n", code >= 0 && code <= 16 ? names[code] : "?",
               s.error_message().c_str());
  return 1;
}

std::string Human(int64_t b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1000 && u < 4) v /= 1000, ++u;
  return u == 0 ? absl::StrCat(b, " B") : absl::StrFormat("%.1f %s", v, units[u]);
}

const char* StateName(v1::RoundStats::State s) {
  switch (s) {
    case v1::RoundStats::PREPARING: return "preparing";
    case v1::RoundStats::TRANSFERRING: return "transferring";
    case v1::RoundStats::COMMITTED: return "committed";
    case v1::RoundStats::ABORTED: return "aborted";
    default: return "?";
  }
}

void PrintRound(const v1::RoundStats& r, bool json, bool header) {
  if (json) {
    std::printf("%s\n", Json(r).c_str());
    return;
  }
  // SECONDS is the whole round (workers' prepare and commit included); GB/S is over the transfer.
  if (header) {
    std::printf("%-10s %-6s %-8s %-12s %-10s %-8s %-8s %-8s %-8s %-7s %s\n", "GROUP", "ROUND", "VERSION",
                "STATE", "BYTES", "SECONDS", "PREPARE", "TRANSFER", "COMMIT", "GB/S", "REASON");
  }
  std::printf("%-10s %-6lld %-8lld %-12s %-10s %-8.3f %-8.3f %-8.3f %-8.3f %-7.2f %s\n", r.group().c_str(),
              (long long)r.round_id(), (long long)r.version(), StateName(r.state()), Human(r.bytes()).c_str(),
              r.seconds(), r.prepare_seconds(), r.transfer_seconds(), r.commit_seconds(),
              r.transfer_seconds() > 0 ? r.bytes() / r.transfer_seconds() / 1e9 : 0.0, r.reason().c_str());
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  std::string daemon = std::getenv("REFIT_DAEMON") ? std::getenv("REFIT_DAEMON") : "unix:/tmp/refitd-0.sock";
  std::string output = "table";
  bool no_wait = false;
  double timeout_s = 300;
  CliFlags flags("refitctl", "[--daemon ADDR] [-o table|json] status | workers [GROUP] | plan GROUP | "
                             "refit GROUP VERSION [--no-wait] | watch [GROUP]");
  flags.String("daemon", &daemon, "any refitd of the cluster (env REFIT_DAEMON)");
  flags.String("output", &output, "table or json", "o");
  flags.Bool("no-wait", &no_wait, "refit: start the round and return its id");
  flags.Double("timeout", &timeout_s, "seconds to wait for an answer");
  const auto args = flags.Parse(argc, argv);
  if (args.empty()) flags.Fail("a command is needed: status, workers, plan, refit, watch (see --help)");
  if (output != "table" && output != "json") flags.Fail("-o must be table or json");
  const bool json = output == "json";
  auto stub = v1::RefitControl::NewStub(grpc::CreateChannel(daemon, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  const std::string& cmd = args[0];
  if (cmd != "watch") {
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  }
  if (cmd == "status") {
    v1::StatusResponse r;
    if (auto s = stub->Status(&ctx, v1::StatusRequest(), &r); !s.ok()) return Fail(s);
    if (json) return std::printf("%s\n", Json(r).c_str()), 0;
    std::printf("coordinator %s\n\n%-6s %-22s %-6s %s\n", r.coordinator().c_str(), "NODE", "ADDRESS", "ALIVE", "WORKERS");
    for (const auto& n : r.nodes()) {
      std::printf("%-6d %-22s %-6s %d\n", n.node(), n.address().c_str(), n.alive() ? "yes" : "no", n.workers());
    }
    std::printf("\n%-10s %-6s %-8s %-9s %-10s %-10s %-10s %s\n", "GROUP", "READY", "VERSION", "TRAINERS", "INFERENCE", "BYTES", "MESSAGES", "WHY NOT READY");
    for (const auto& g : r.groups()) {
      std::printf("%-10s %-6s %-8lld %-9d %-10d %-10s %-10lld %s\n", g.name().c_str(), g.ready() ? "yes" : "no",
                  (long long)g.version(), g.trainers(), g.inference_workers(), Human(g.plan().bytes_total()).c_str(),
                  (long long)g.plan().messages(), g.not_ready_reason().c_str());
    }
    // The inference side by replica: which count (complete), which version each holds, and why
    // the others do not count (missing ranks).
    bool any_replicas = false;
    for (const auto& g : r.groups()) any_replicas |= g.replicas_size() > 0;
    if (any_replicas) {
      std::printf("\n%-10s %-16s %-6s %-9s %-8s %s\n", "GROUP", "REPLICA", "RANKS", "COMPLETE", "VERSION", "PROBLEM");
      for (const auto& g : r.groups()) {
        for (const auto& rep : g.replicas()) {
          const int held = static_cast<int>(std::count_if(rep.workers().begin(), rep.workers().end(),
                                                          [](const std::string& w) { return !w.empty(); }));
          const std::string ranks = std::to_string(held) + "/" + std::to_string(rep.size());
          const std::string behind = rep.complete() && rep.version() < g.version() ? " (missed versions)" : "";
          std::printf("%-10s %-16s %-6s %-9s %-8lld %s%s\n", g.name().c_str(), rep.name().c_str(), ranks.c_str(),
                      rep.complete() ? "yes" : "no", (long long)rep.version(), rep.problem().c_str(), behind.c_str());
        }
      }
    }
    return 0;
  }
  if (cmd == "workers") {
    v1::ListWorkersRequest req;
    if (args.size() > 1) req.set_group(args[1]);
    v1::ListWorkersResponse r;
    if (auto s = stub->ListWorkers(&ctx, req, &r); !s.ok()) return Fail(s);
    if (json) return std::printf("%s\n", Json(r).c_str()), 0;
    std::printf("%-32s %-10s %-5s %-4s %-8s %-7s %s\n", "WORKER", "ROLE", "NODE", "GPU", "BUFFERS", "PIECES", "BYTES");
    for (const auto& w : r.workers()) {
      std::printf("%-32s %-10s %-5d %-4d %-8d %-7d %s\n", w.worker_id().c_str(),
                  w.role() == v1::TRAINER ? "trainer" : "inference", w.node(), w.gpu(), w.buffers(),
                  w.pieces(), Human(w.bytes()).c_str());
    }
    return 0;
  }
  if (cmd == "plan") {
    if (args.size() != 2) flags.Fail("usage: refitctl plan GROUP");
    v1::GetPlanRequest req;
    req.set_group(args[1]);
    v1::PlanSummary r;
    if (auto s = stub->GetPlan(&ctx, req, &r); !s.ok()) return Fail(s);
    if (json) return std::printf("%s\n", Json(r).c_str()), 0;
    std::printf("tensors %lld  pieces %lld  transfers %lld  messages %lld\n", (long long)r.tensors(),
                (long long)r.pieces(), (long long)r.transfers(), (long long)r.messages());
    std::printf("bytes %s: network %s, nvlink %s, local %s\n", Human(r.bytes_total()).c_str(),
                Human(r.bytes_network()).c_str(), Human(r.bytes_nvlink()).c_str(), Human(r.bytes_local()).c_str());
    std::printf("predicted %.6f s, lower bound %.6f s, planned in %.3f s\n", r.predicted_seconds(),
                r.lower_bound_seconds(), r.planning_seconds());
    return 0;
  }
  if (cmd == "refit") {
    int64_t version = 0;
    if (args.size() != 3 || !absl::SimpleAtoi(args[2], &version)) flags.Fail("usage: refitctl refit GROUP VERSION");
    v1::RefitRequest req;
    req.set_group(args[1]);
    req.set_version(version);
    if (no_wait) {
      v1::StartRefitResponse r;
      if (auto s = stub->StartRefit(&ctx, req, &r); !s.ok()) return Fail(s);
      if (json) return std::printf("%s\n", Json(r).c_str()), 0;
      std::printf("round %lld started\n", (long long)r.round_id());
      return 0;
    }
    v1::RoundStats r;
    if (auto s = stub->Refit(&ctx, req, &r); !s.ok()) return Fail(s);
    PrintRound(r, json, true);
    return 0;
  }
  if (cmd == "watch") {
    v1::WatchRoundsRequest req;
    if (args.size() > 1) req.set_group(args[1]);
    auto reader = stub->WatchRounds(&ctx, req);
    v1::RoundStats r;
    bool header = true;
    while (reader->Read(&r)) {
      PrintRound(r, json, header);
      header = false;
      std::fflush(stdout);
    }
    return reader->Finish().ok() ? 0 : Fail(reader->Finish());
  }
  flags.Fail(absl::StrCat("unknown command \"", cmd, "\" (status, workers, plan, refit, watch)"));
}
