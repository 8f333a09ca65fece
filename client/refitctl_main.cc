// refitctl: the operator's command line for a refit cluster, in the style of kubectl/etcdctl:
// human tables by default, -o wide for more columns, -o json for machines.
//
//   refitctl [--daemon ADDR[,ADDR...]] [-o table|wide|json] status
//   refitctl workers [GROUP]
//   refitctl plan GROUP
//   refitctl refit GROUP VERSION [--no-wait]
//   refitctl watch [GROUP]
//   refitctl rounds [GROUP] [--limit N]
//   refitctl health
//   refitctl version
//
// --daemon names any refitd of the cluster, or several: a call that cannot reach one
// (UNAVAILABLE) goes to the next. Exit codes (also in --help): 0 success; 1 the cluster said no
// (the gRPC code and message are printed); 2 bad usage; 3 unreachable (no daemon answered, or a
// watched stream broke); 4 timed out (DEADLINE_EXCEEDED); health: 1 when a service is not
// SERVING.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli_flags.h"
#include "google/protobuf/util/json_util.h"
#include "daemon/grpc_tls.h"
#include "daemon/version.h"
#include "proto/health.grpc.pb.h"
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

constexpr int kExitRefused = 1, kExitUnreachable = 3, kExitTimedOut = 4;

const char* CodeName(grpc::StatusCode c) {
  static const char* names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
                                "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const int code = static_cast<int>(c);
  return code >= 0 && code <= 16 ? names[code] : "?";
}

int ExitCode(const grpc::Status& s) {
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) return kExitUnreachable;
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) return kExitTimedOut;
  return kExitRefused;
}

int Fail(const grpc::Status& s) {
  std::fprintf(stderr, "refitctl: %s: %s\n", CodeName(s.error_code()), s.error_message().c_str());
  return ExitCode(s);
}

// The daemons named by --daemon, tried in order: a call that cannot reach one (UNAVAILABLE)
// goes to the next; any other answer, success or refusal, is the answer.
class Endpoints {
 public:
  Endpoints(std::vector<std::string> addresses, double timeout_s, const TlsConfig& tls)
      : addresses_(std::move(addresses)),
        timeout_s_(timeout_s),
        tls_(tls),
        tls_enabled_(tls.enabled()) {}

  template <typename Request, typename Response, typename Method>
  grpc::Status Call(Method method, const Request& request, Response* response, bool deadline = true) {
    grpc::Status last;
    for (const std::string& a : addresses_) {
      grpc::ClientContext ctx;
      if (deadline) ctx.set_deadline(Deadline());
      auto stub = v1::RefitControl::NewStub(Channel(a));
      last = (stub.get()->*method)(&ctx, request, response);
      if (last.error_code() != grpc::StatusCode::UNAVAILABLE) return last;
      last = ExplainClosed(a, last);
      if (addresses_.size() > 1) std::fprintf(stderr, "refitctl: %s unreachable: %s\n", a.c_str(), last.error_message().c_str());
    }
    return last;
  }
  // gRPC says "Socket closed" both for a daemon that stopped and for one with TLS that hung up on
  // a caller it does not accept: name both.
  grpc::Status ExplainClosed(const std::string& address, const grpc::Status& s) const {
    if (absl::StartsWith(address, "unix:") ||
        !absl::StrContains(s.error_message(), "Socket closed"))
      return s;
    return grpc::Status(
        s.error_code(),
        absl::StrCat(
            s.error_message(), " (", address,
            " closed the connection: the daemon stopped, or it uses TLS and ",
            tls_enabled_
                ? "does not accept this certificate (its CA, its names)"
                : "this call brought no certificate: give --tls-cert, --tls-key and --tls-ca",
            ")"));
  }
  const std::vector<std::string>& addresses() const { return addresses_; }
  // TLS to TCP addresses when configured; the unix socket is local (its file mode guards it).
  std::shared_ptr<grpc::Channel> Channel(const std::string& a) const {
    if (absl::StartsWith(a, "unix:")) return grpc::CreateChannel(a, grpc::InsecureChannelCredentials());
    return tls_.Channel(a, grpc::ChannelArguments());
  }
  std::chrono::system_clock::time_point Deadline() const {
    return std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
  }

 private:
  const std::vector<std::string> addresses_;
  const double timeout_s_;
  const GrpcTls tls_;
  const bool tls_enabled_;
};

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

std::string CulpritText(const v1::Culprit& c) {
  switch (c.kind()) {
    case v1::Culprit::WORKER: return absl::StrCat("worker ", c.worker_id());
    case v1::Culprit::NODE: return absl::StrCat("node ", c.node());
    case v1::Culprit::COORDINATOR: return absl::StrCat("coordinator (node ", c.node(), ")");
    default: return "-";
  }
}

enum class Output { kTable, kWide, kJson };

void PrintRound(const v1::RoundStats& r, Output out, bool header) {
  if (out == Output::kJson) {
    std::printf("%s\n", Json(r).c_str());
    return;
  }
  const bool wide = out == Output::kWide;
  // SECONDS is the whole round (workers' prepare and commit included); GB/S is over the transfer.
  if (header) {
    std::printf("%-10s %-6s %-8s %-12s %-10s %-8s %-8s %-8s %-8s %-7s ", "GROUP", "ROUND", "VERSION", "STATE",
                "BYTES", "SECONDS", "PREPARE", "TRANSFER", "COMMIT", "GB/S");
    if (wide) std::printf("%-24s %-28s ", "REPLICAS", "CULPRIT");
    std::printf("%s\n", "REASON");
  }
  std::printf("%-10s %-6lld %-8lld %-12s %-10s %-8.3f %-8.3f %-8.3f %-8.3f %-7.2f ", r.group().c_str(),
              (long long)r.round_id(), (long long)r.version(), StateName(r.state()), Human(r.bytes()).c_str(),
              r.seconds(), r.prepare_seconds(), r.transfer_seconds(), r.commit_seconds(),
              r.transfer_seconds() > 0 ? r.bytes() / r.transfer_seconds() / 1e9 : 0.0);
  if (wide) {
    std::vector<std::string> replicas(r.replicas().begin(), r.replicas().end());
    const std::string list = replicas.empty() ? "-" : absl::StrJoin(replicas, ",");
    std::printf("%-24s %-28s ", list.c_str(), CulpritText(r.culprit()).c_str());
  }
  std::printf("%s\n", r.state() == v1::RoundStats::COMMITTED ? r.commit_note().c_str() : r.reason().c_str());
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  std::string daemon = std::getenv("REFIT_DAEMON") ? std::getenv("REFIT_DAEMON") : "unix:/tmp/refitd-0.sock";
  std::string output = "table";
  bool no_wait = false;
  double timeout_s = 300;
  int64_t limit = 20;
  CliFlags flags("refitctl",
                 "[--daemon ADDR[,ADDR...]] [-o table|wide|json] status | workers [GROUP] | plan GROUP | "
                 "refit GROUP VERSION [--no-wait] | watch [GROUP] | rounds [GROUP] [--limit N] | health | version\n"
                 "exit codes: 0 success; 1 refused by the cluster (its gRPC code and message printed), or health "
                 "not SERVING; 2 bad usage; 3 unreachable (no daemon answered, or a watched stream broke); "
                 "4 timed out");
  flags.String("daemon", &daemon, "refitd addresses, comma-separated: the next is tried when one is unreachable (env REFIT_DAEMON)");
  flags.String("output", &output, "table, wide or json", "o");
  flags.Bool("no-wait", &no_wait, "refit: start the round and return its id");
  flags.Double("timeout", &timeout_s, "seconds to wait for an answer");
  flags.Int("limit", &limit, "rounds: how many of the most recent");
  // TLS (docs/SECURITY.md): an operator's or viewer's certificate, signed by the cluster's CA.
  auto env = [](const char* name) { return std::string(std::getenv(name) ? std::getenv(name) : ""); };
  TlsConfig tls;
  tls.cert = env("REFIT_TLS_CERT");
  tls.key = env("REFIT_TLS_KEY");
  tls.ca = env("REFIT_TLS_CA");
  flags.String("tls-cert", &tls.cert, "PEM client certificate (an operator's or viewer's) for TCP addresses (env REFIT_TLS_CERT)");
  flags.String("tls-key", &tls.key, "PEM private key of --tls-cert (env REFIT_TLS_KEY)");
  flags.String("tls-ca", &tls.ca, "PEM CA bundle of the cluster (env REFIT_TLS_CA)");
  const auto args = flags.Parse(argc, argv);
  if (tls.cert.empty() != tls.key.empty() || tls.cert.empty() != tls.ca.empty()) {
    flags.Fail("--tls-cert, --tls-key and --tls-ca go together: give all three, or none");
  }
  for (const std::string* file : {&tls.cert, &tls.key, &tls.ca}) {
    if (!file->empty() && !std::ifstream(*file).good()) flags.Fail(absl::StrCat("cannot read TLS file ", *file));
  }
  if (args.empty()) flags.Fail("a command is needed: status, workers, plan, refit, watch, rounds, health, version (see --help)");
  Output out = Output::kTable;
  if (output == "wide") {
    out = Output::kWide;
  } else if (output == "json") {
    out = Output::kJson;
  } else if (output != "table") {
    flags.Fail("-o must be table, wide or json");
  }
  const bool json = out == Output::kJson;
  std::vector<std::string> addresses = absl::StrSplit(daemon, ',', absl::SkipWhitespace());
  if (addresses.empty()) flags.Fail("--daemon names no address");
  if (limit < 1 || limit > 1024) flags.Fail("--limit must be in [1, 1024]");
  Endpoints daemons(addresses, timeout_s, tls);
  const std::string& cmd = args[0];
  if (cmd == "version") {
    v1::StatusResponse r;
    const grpc::Status s = daemons.Call(&v1::RefitControl::Stub::Status, v1::StatusRequest(), &r);
    if (json) {
      std::printf("{\"refitctl\":\"%s\",\"daemon\":\"%s\"}\n", kRefitVersion, s.ok() ? r.version().c_str() : "");
    } else {
      std::printf("refitctl %s\n", kRefitVersion);
      if (s.ok()) std::printf("cluster (coordinator %s) %s\n", r.coordinator().c_str(), r.version().empty() ? "?" : r.version().c_str());
    }
    return s.ok() ? 0 : Fail(s);
  }
  if (cmd == "health") {
    // Each daemon named, each of its services (grpc.health.v1, as Kubernetes' probes ask).
    static const char* kServices[] = {"", "refit.v1.RefitControl", "refit.v1.RefitPeer", "refit.v1.RefitWorker"};
    int rc = 0;
    if (!json) std::printf("%-28s %-24s %s\n", "DAEMON", "SERVICE", "STATUS");
    for (const std::string& a : daemons.addresses()) {
      auto stub = grpc::health::v1::Health::NewStub(daemons.Channel(a));
      for (const char* service : kServices) {
        grpc::ClientContext ctx;
        ctx.set_deadline(daemons.Deadline());
        grpc::health::v1::HealthCheckRequest req;
        req.set_service(service);
        grpc::health::v1::HealthCheckResponse r;
        const grpc::Status s = stub->Check(&ctx, req, &r);
        const std::string status = s.ok() ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(r.status())
                                          : absl::StrCat(CodeName(s.error_code()), ": ", s.error_message());
        if (!s.ok()) {
          rc = std::max(rc, ExitCode(s));
        } else if (r.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
          rc = std::max(rc, kExitRefused);
        }
        if (json) {
          std::printf("{\"daemon\":\"%s\",\"service\":\"%s\",\"status\":\"%s\"}\n", a.c_str(), service, status.c_str());
        } else {
          std::printf("%-28s %-24s %s\n", a.c_str(), *service ? service : "(server)", status.c_str());
        }
        if (!s.ok()) break;  // unreachable: its other services are too
      }
    }
    return rc;
  }
  if (cmd == "status") {
    v1::StatusResponse r;
    if (auto s = daemons.Call(&v1::RefitControl::Stub::Status, v1::StatusRequest(), &r); !s.ok()) return Fail(s);
    if (json) return std::printf("%s\n", Json(r).c_str()), 0;
    const bool wide = out == Output::kWide;
    std::printf("coordinator %s%s\n\n%-6s %-22s %-6s %s\n", r.coordinator().c_str(),
                r.version().empty() ? "" : absl::StrCat(" (refit ", r.version(), ")").c_str(), "NODE", "ADDRESS",
                "ALIVE", "WORKERS");
    for (const auto& n : r.nodes()) {
      std::printf("%-6d %-22s %-6s %d\n", n.node(), n.address().c_str(), n.alive() ? "yes" : "no", n.workers());
    }
    std::printf("\n%-10s %-6s %-8s %-9s %-10s %-10s %-10s ", "GROUP", "READY", "VERSION", "TRAINERS", "INFERENCE",
                "BYTES", "MESSAGES");
    if (wide) std::printf("%-8s %-10s %-10s ", "EPOCH", "NETWORK", "PREDICTED");
    std::printf("%s\n", "WHY NOT READY");
    for (const auto& g : r.groups()) {
      std::printf("%-10s %-6s %-8lld %-9d %-10d %-10s %-10lld ", g.name().c_str(), g.ready() ? "yes" : "no",
                  (long long)g.version(), g.trainers(), g.inference_workers(), Human(g.plan().bytes_total()).c_str(),
                  (long long)g.plan().messages());
      if (wide) {
        std::printf("%-8lld %-10s %-10s ", (long long)g.planned_at_membership(), Human(g.plan().bytes_network()).c_str(),
                    absl::StrFormat("%.3f s", g.plan().predicted_seconds()).c_str());
      }
      std::printf("%s\n", g.not_ready_reason().c_str());
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
          std::printf("%-10s %-16s %-6s %-9s %-8lld %s\n", g.name().c_str(), rep.name().c_str(), ranks.c_str(),
                      rep.complete() ? "yes" : "no", (long long)rep.version(), rep.problem().c_str());
          if (wide) {
            for (int rank = 0; rank < rep.workers_size(); ++rank) {
              std::printf("%-10s   rank %-4d %s\n", "", rank, rep.workers(rank).empty() ? "(missing)" : rep.workers(rank).c_str());
            }
          }
        }
      }
    }
    return 0;
  }
  if (cmd == "workers") {
    v1::ListWorkersRequest req;
    if (args.size() > 1) req.set_group(args[1]);
    v1::ListWorkersResponse r;
    if (auto s = daemons.Call(&v1::RefitControl::Stub::ListWorkers, req, &r); !s.ok()) return Fail(s);
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
    if (auto s = daemons.Call(&v1::RefitControl::Stub::GetPlan, req, &r); !s.ok()) return Fail(s);
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
    // A daemon that was unreachable never saw the request; one that answered (even "no") did:
    // failover only past the former, so a round is never started twice by refitctl.
    if (no_wait) {
      v1::StartRefitResponse r;
      if (auto s = daemons.Call(&v1::RefitControl::Stub::StartRefit, req, &r); !s.ok()) return Fail(s);
      if (json) return std::printf("%s\n", Json(r).c_str()), 0;
      std::printf("round %lld started\n", (long long)r.round_id());
      return 0;
    }
    v1::RoundStats r;
    if (auto s = daemons.Call(&v1::RefitControl::Stub::Refit, req, &r); !s.ok()) return Fail(s);
    PrintRound(r, out, true);
    return 0;
  }
  if (cmd == "rounds") {
    v1::ListRoundsRequest req;
    if (args.size() > 1) req.set_group(args[1]);
    req.set_limit(static_cast<int32_t>(limit));
    v1::ListRoundsResponse r;
    if (auto s = daemons.Call(&v1::RefitControl::Stub::ListRounds, req, &r); !s.ok()) return Fail(s);
    if (json) return std::printf("%s\n", Json(r).c_str()), 0;
    bool header = true;
    for (const auto& round : r.rounds()) {
      PrintRound(round, out, header);
      header = false;
    }
    if (header) std::printf("no rounds yet\n");
    return 0;
  }
  if (cmd == "watch") {
    v1::WatchRoundsRequest req;
    if (args.size() > 1) req.set_group(args[1]);
    // The first daemon that takes the stream; it runs until interrupted. Any end is a break (the
    // daemon or its coordinator went away): exit 3, never a clean 0.
    bool header = true;
    grpc::Status last;
    for (const std::string& a : daemons.addresses()) {
      grpc::ClientContext ctx;
      auto stub = v1::RefitControl::NewStub(daemons.Channel(a));
      auto reader = stub->WatchRounds(&ctx, req);
      v1::RoundStats r;
      bool any = false;
      while (reader->Read(&r)) {
        any = true;
        PrintRound(r, out, header);
        header = false;
        std::fflush(stdout);
      }
      last = reader->Finish();  // once: a second Finish() aborts the process
      if (any || last.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    }
    std::fprintf(stderr, "refitctl: the watch stream ended: %s%s%s\n", CodeName(last.error_code()),
                 last.error_message().empty() ? "" : ": ", last.error_message().c_str());
    return last.ok() || last.error_code() == grpc::StatusCode::UNAVAILABLE ||
                   last.error_code() == grpc::StatusCode::CANCELLED
               ? kExitUnreachable
               : Fail(last);
  }
  flags.Fail(absl::StrCat("unknown command \"", cmd, "\" (status, workers, plan, refit, watch, rounds, health, version)"));
}
