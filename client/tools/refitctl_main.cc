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
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cli_flags.h"
#include "common/grpc_tls.h"
#include "common/version.h"
#include "common/watch_protocol.h"
#include "google/protobuf/util/json_util.h"
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
  static const char* names[] = {"OK",
                                "CANCELLED",
                                "UNKNOWN",
                                "INVALID_ARGUMENT",
                                "DEADLINE_EXCEEDED",
                                "NOT_FOUND",
                                "ALREADY_EXISTS",
                                "PERMISSION_DENIED",
                                "RESOURCE_EXHAUSTED",
                                "FAILED_PRECONDITION",
                                "ABORTED",
                                "OUT_OF_RANGE",
                                "UNIMPLEMENTED",
                                "INTERNAL",
                                "UNAVAILABLE",
                                "DATA_LOSS",
                                "UNAUTHENTICATED"};
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

// Whether something listens on unix socket `path`, its backlog full or not (a daemon that is
// gone refuses at once: ECONNREFUSED, ENOENT).
bool ListeningAt(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof addr.sun_path) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  const int error = errno;
  close(fd);
  return rc == 0 || error == EAGAIN;
}

// The daemons named by --daemon, tried in order: a call that cannot reach one (UNAVAILABLE)
// goes to the next; any other answer, success or refusal, is the answer.
class Endpoints {
 public:
  static constexpr std::chrono::seconds kConnectRetry{2};

  Endpoints(std::vector<std::string> addresses, double timeout_s, const TlsConfig& tls)
      : addresses_(std::move(addresses)),
        timeout_s_(timeout_s),
        tls_(tls),
        tls_enabled_(tls.enabled()) {}

  template <typename Request, typename Response, typename Method>
  grpc::Status Call(Method method, const Request& request, Response* response,
                    bool deadline = true) {
    grpc::Status last;
    for (const std::string& a : addresses_) {
      auto stub = v1::RefitControl::NewStub(Channel(a));
      // A unix socket whose backlog is full for a moment (a burst of connections) refuses the
      // connection before anything is sent: tried again for up to kConnectRetry, 100 ms apart.
      const auto retry_until = std::chrono::steady_clock::now() + kConnectRetry;
      while (true) {
        grpc::ClientContext ctx;
        if (deadline) ctx.set_deadline(Deadline());
        last = (stub.get()->*method)(&ctx, request, response);
        if (last.error_code() != grpc::StatusCode::UNAVAILABLE || !absl::StartsWith(a, "unix:") ||
            !absl::StrContains(last.error_message(), "failed to connect") ||
            !ListeningAt(a.substr(5)) || std::chrono::steady_clock::now() >= retry_until) {
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (last.error_code() != grpc::StatusCode::UNAVAILABLE) return last;
      last = ExplainClosed(a, last);
      if (addresses_.size() > 1)
        std::fprintf(stderr, "refitctl: %s unreachable: %s\n", a.c_str(),
                     last.error_message().c_str());
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
    if (absl::StartsWith(a, "unix:"))
      return grpc::CreateChannel(a, grpc::InsecureChannelCredentials());
    return tls_.Channel(a, grpc::ChannelArguments());
  }
  std::chrono::system_clock::time_point Deadline() const {
    return std::chrono::system_clock::now() +
           std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
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
    case v1::RoundStats::PREPARING:
      return "preparing";
    case v1::RoundStats::TRANSFERRING:
      return "transferring";
    case v1::RoundStats::COMMITTED:
      return "committed";
    case v1::RoundStats::ABORTED:
      return "aborted";
    default:
      return "?";
  }
}

std::string CulpritText(const v1::Culprit& c) {
  switch (c.kind()) {
    case v1::Culprit::WORKER:
      return absl::StrCat("worker ", c.worker_id());
    case v1::Culprit::NODE:
      return absl::StrCat("node ", c.node());
    case v1::Culprit::COORDINATOR:
      return absl::StrCat("coordinator (node ", c.node(), ")");
    default:
      return "-";
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
    std::printf("%-10s %-6s %-8s %-12s %-10s %-8s %-8s %-8s %-8s %-7s ", "GROUP", "ROUND",
                "VERSION", "STATE", "BYTES", "SECONDS", "PREPARE", "TRANSFER", "COMMIT", "GB/S");
    if (wide) std::printf("%-24s %-28s ", "REPLICAS", "CULPRIT");
    std::printf("%s\n", "REASON");
  }
  std::printf("%-10s %-6lld %-8lld %-12s %-10s %-8.3f %-8.3f %-8.3f %-8.3f %-7.2f ",
              r.group().c_str(), (long long)r.round_id(), (long long)r.version(),
              StateName(r.state()), Human(r.bytes()).c_str(), r.seconds(), r.prepare_seconds(),
              r.transfer_seconds(), r.commit_seconds(),
              r.transfer_seconds() > 0 ? r.bytes() / r.transfer_seconds() / 1e9 : 0.0);
  if (wide) {
    std::vector<std::string> replicas(r.replicas().begin(), r.replicas().end());
    const std::string list = replicas.empty() ? "-" : absl::StrJoin(replicas, ",");
    std::printf("%-24s %-28s ", list.c_str(), CulpritText(r.culprit()).c_str());
  }
  std::printf("%s\n", r.state() == v1::RoundStats::COMMITTED ? r.commit_note().c_str()
                                                             : r.reason().c_str());
}

// Output formatting, one function per answer.

void PrintJson(const google::protobuf::Message& m) { std::printf("%s\n", Json(m).c_str()); }

// `cluster` is null when no daemon answered: refitctl's own version is still printed.
void PrintVersion(const v1::StatusResponse* cluster, Output out) {
  if (out == Output::kJson) {
    std::printf("{\"refitctl\":\"%s\",\"daemon\":\"%s\"}\n", kRefitVersion,
                cluster != nullptr ? cluster->version().c_str() : "");
    return;
  }
  std::printf("refitctl %s\n", kRefitVersion);
  if (cluster != nullptr) {
    std::printf("cluster (coordinator %s) %s\n", cluster->coordinator().c_str(),
                cluster->version().empty() ? "?" : cluster->version().c_str());
  }
}

void PrintHealthHeader(Output out) {
  if (out != Output::kJson) std::printf("%-28s %-24s %s\n", "DAEMON", "SERVICE", "STATUS");
}

void PrintHealthLine(const std::string& address, const char* service, const std::string& status,
                     Output out) {
  if (out == Output::kJson) {
    std::printf("{\"daemon\":\"%s\",\"service\":\"%s\",\"status\":\"%s\"}\n", address.c_str(),
                service, status.c_str());
  } else {
    std::printf("%-28s %-24s %s\n", address.c_str(), *service ? service : "(server)",
                status.c_str());
  }
}

void PrintNodes(const v1::StatusResponse& r) {
  std::printf("coordinator %s%s\n\n%-6s %-22s %-6s %s\n", r.coordinator().c_str(),
              r.version().empty() ? "" : absl::StrCat(" (refit ", r.version(), ")").c_str(), "NODE",
              "ADDRESS", "ALIVE", "WORKERS");
  for (const auto& n : r.nodes()) {
    std::printf("%-6d %-22s %-6s %d\n", n.node(), n.address().c_str(), n.alive() ? "yes" : "no",
                n.workers());
  }
}

void PrintGroups(const v1::StatusResponse& r, bool wide) {
  std::printf("\n%-10s %-6s %-8s %-9s %-10s %-10s %-10s ", "GROUP", "READY", "VERSION", "TRAINERS",
              "INFERENCE", "BYTES", "MESSAGES");
  if (wide) std::printf("%-8s %-10s %-10s ", "EPOCH", "NETWORK", "PREDICTED");
  std::printf("%s\n", "WHY NOT READY");
  for (const auto& g : r.groups()) {
    std::printf("%-10s %-6s %-8lld %-9d %-10d %-10s %-10lld ", g.name().c_str(),
                g.ready() ? "yes" : "no", (long long)g.version(), g.trainers(),
                g.inference_workers(), Human(g.plan().bytes_total()).c_str(),
                (long long)g.plan().messages());
    if (wide) {
      std::printf("%-8lld %-10s %-10s ", (long long)g.planned_at_membership(),
                  Human(g.plan().bytes_network()).c_str(),
                  absl::StrFormat("%.3f s", g.plan().predicted_seconds()).c_str());
    }
    std::printf("%s\n", g.not_ready_reason().c_str());
  }
}

// The inference side by replica: which count (complete), which version each holds, and why the
// others do not count (missing ranks). Nothing when no group has replicas.
void PrintReplicas(const v1::StatusResponse& r, bool wide) {
  bool any_replicas = false;
  for (const auto& g : r.groups()) any_replicas |= g.replicas_size() > 0;
  if (!any_replicas) return;
  std::printf("\n%-10s %-16s %-6s %-9s %-8s %s\n", "GROUP", "REPLICA", "RANKS", "COMPLETE",
              "VERSION", "PROBLEM");
  for (const auto& g : r.groups()) {
    for (const auto& rep : g.replicas()) {
      const int held =
          static_cast<int>(std::count_if(rep.workers().begin(), rep.workers().end(),
                                         [](const std::string& w) { return !w.empty(); }));
      const std::string ranks = std::to_string(held) + "/" + std::to_string(rep.size());
      std::printf("%-10s %-16s %-6s %-9s %-8lld %s\n", g.name().c_str(), rep.name().c_str(),
                  ranks.c_str(), rep.complete() ? "yes" : "no", (long long)rep.version(),
                  rep.problem().c_str());
      if (!wide) continue;
      for (int rank = 0; rank < rep.workers_size(); ++rank) {
        std::printf("%-10s   rank %-4d %s\n", "", rank,
                    rep.workers(rank).empty() ? "(missing)" : rep.workers(rank).c_str());
      }
    }
  }
}

void PrintWorkers(const v1::ListWorkersResponse& r) {
  std::printf("%-32s %-10s %-5s %-4s %-8s %-7s %s\n", "WORKER", "ROLE", "NODE", "GPU", "BUFFERS",
              "PIECES", "BYTES");
  for (const auto& w : r.workers()) {
    std::printf("%-32s %-10s %-5d %-4d %-8d %-7d %s\n", w.worker_id().c_str(),
                w.role() == v1::TRAINER ? "trainer" : "inference", w.node(), w.gpu(), w.buffers(),
                w.pieces(), Human(w.bytes()).c_str());
  }
}

void PrintPlanSummary(const v1::PlanSummary& r) {
  std::printf("tensors %lld  pieces %lld  transfers %lld  messages %lld\n", (long long)r.tensors(),
              (long long)r.pieces(), (long long)r.transfers(), (long long)r.messages());
  std::printf("bytes %s: network %s, nvlink %s, local %s\n", Human(r.bytes_total()).c_str(),
              Human(r.bytes_network()).c_str(), Human(r.bytes_nvlink()).c_str(),
              Human(r.bytes_local()).c_str());
  std::printf("predicted %.6f s, lower bound %.6f s, planned in %.3f s\n", r.predicted_seconds(),
              r.lower_bound_seconds(), r.planning_seconds());
}

// Rounds as a table under one header, or "no rounds yet".
void PrintRounds(const v1::ListRoundsResponse& r, Output out) {
  bool header = true;
  for (const auto& round : r.rounds()) {
    PrintRound(round, out, header);
    header = false;
  }
  if (header) std::printf("no rounds yet\n");
}

// The command line: flags, then the command and its arguments, each checked before any call.

constexpr char kUsage[] =
    "[--daemon ADDR[,ADDR...]] [-o table|wide|json] status | workers [GROUP] | plan GROUP | "
    "refit GROUP VERSION [--no-wait] | watch [GROUP] | rounds [GROUP] [--limit N] | health | "
    "version\n"
    "exit codes: 0 success; 1 refused by the cluster (its gRPC code and message printed), or "
    "health not SERVING; 2 bad usage; 3 unreachable (no daemon answered, or a watched stream "
    "broke); 4 timed out";

std::string EnvOr(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : fallback;
}

// TLS (docs/SECURITY.md): an operator's or viewer's certificate, signed by the cluster's CA.
TlsConfig TlsFromEnvironment() {
  TlsConfig tls;
  tls.cert = EnvOr("REFIT_TLS_CERT", "");
  tls.key = EnvOr("REFIT_TLS_KEY", "");
  tls.ca = EnvOr("REFIT_TLS_CA", "");
  return tls;
}

// The flags as given, defaults from the environment where it names them.
struct FlagValues {
  std::string daemon = EnvOr("REFIT_DAEMON", "unix:/tmp/refitd-0.sock");
  std::string output = "table";
  bool no_wait = false;
  double timeout_s = 300;
  int64_t limit = 20;
  TlsConfig tls = TlsFromEnvironment();
};

void RegisterFlags(CliFlags& flags, FlagValues& v) {
  flags.String("daemon", &v.daemon,
               "refitd addresses, comma-separated: the next is tried when one is unreachable (env "
               "REFIT_DAEMON)");
  flags.String("output", &v.output, "table, wide or json", "o");
  flags.Bool("no-wait", &v.no_wait, "refit: start the round and return its id");
  flags.Double("timeout", &v.timeout_s, "seconds to wait for an answer");
  flags.Int("limit", &v.limit, "rounds: how many of the most recent");
  flags.String("tls-cert", &v.tls.cert,
               "PEM client certificate (an operator's or viewer's) for TCP addresses (env "
               "REFIT_TLS_CERT)");
  flags.String("tls-key", &v.tls.key, "PEM private key of --tls-cert (env REFIT_TLS_KEY)");
  flags.String("tls-ca", &v.tls.ca, "PEM CA bundle of the cluster (env REFIT_TLS_CA)");
}

absl::Status CheckTlsFiles(const TlsConfig& tls) {
  if (tls.cert.empty() != tls.key.empty() || tls.cert.empty() != tls.ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls-cert, --tls-key and --tls-ca go together: give all three, or none");
  }
  for (const std::string* file : {&tls.cert, &tls.key, &tls.ca}) {
    if (!file->empty() && !std::ifstream(*file).good()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot read TLS file ", *file));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Output> ParseOutput(const std::string& name) {
  if (name == "table") return Output::kTable;
  if (name == "wide") return Output::kWide;
  if (name == "json") return Output::kJson;
  return absl::InvalidArgumentError("-o must be table, wide or json");
}

// What every command runs with, checked.
struct Settings {
  std::vector<std::string> addresses;
  Output output = Output::kTable;
  bool no_wait = false;
  int64_t limit = 0;
};

absl::StatusOr<Settings> CheckFlags(const FlagValues& v, const std::vector<std::string>& args) {
  if (absl::Status s = CheckTlsFiles(v.tls); !s.ok()) return s;
  if (args.empty()) {
    return absl::InvalidArgumentError(
        "a command is needed: status, workers, plan, refit, watch, rounds, health, version (see "
        "--help)");
  }
  absl::StatusOr<Output> output = ParseOutput(v.output);
  if (!output.ok()) return output.status();
  Settings settings;
  settings.output = *output;
  settings.no_wait = v.no_wait;
  settings.limit = v.limit;
  settings.addresses = absl::StrSplit(v.daemon, ',', absl::SkipWhitespace());
  if (settings.addresses.empty()) return absl::InvalidArgumentError("--daemon names no address");
  if (v.limit < 1 || v.limit > 1024) {
    return absl::InvalidArgumentError("--limit must be in [1, 1024]");
  }
  return settings;
}

struct Command {
  std::string name;
  std::string group;    // the first argument; empty (every group) when not given
  int64_t version = 0;  // refit
};

// The subcommands: each calls the cluster, prints its answer and returns the exit code.

int RunVersion(const Command&, const Settings& settings, Endpoints& daemons) {
  v1::StatusResponse r;
  const grpc::Status s = daemons.Call(&v1::RefitControl::Stub::Status, v1::StatusRequest(), &r);
  PrintVersion(s.ok() ? &r : nullptr, settings.output);
  return s.ok() ? 0 : Fail(s);
}

// grpc.health.v1, as Kubernetes' probes ask: the server as a whole, then each service.
constexpr const char* kHealthServices[] = {"", "refit.v1.RefitControl", "refit.v1.RefitPeer",
                                           "refit.v1.RefitWorker"};

// Each service of the daemon at `address`, printed; the worst exit code among them.
int CheckDaemonHealth(const Endpoints& daemons, const std::string& address, Output out) {
  using grpc::health::v1::HealthCheckResponse;
  int rc = 0;
  auto stub = grpc::health::v1::Health::NewStub(daemons.Channel(address));
  for (const char* service : kHealthServices) {
    grpc::ClientContext ctx;
    ctx.set_deadline(daemons.Deadline());
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    HealthCheckResponse r;
    const grpc::Status s = stub->Check(&ctx, req, &r);
    if (!s.ok()) {
      rc = std::max(rc, ExitCode(s));
    } else if (r.status() != HealthCheckResponse::SERVING) {
      rc = std::max(rc, kExitRefused);
    }
    PrintHealthLine(address, service,
                    s.ok() ? HealthCheckResponse::ServingStatus_Name(r.status())
                           : absl::StrCat(CodeName(s.error_code()), ": ", s.error_message()),
                    out);
    if (!s.ok()) break;  // unreachable: its other services are too
  }
  return rc;
}

// Each daemon named, each of its services.
int RunHealth(const Command&, const Settings& settings, Endpoints& daemons) {
  PrintHealthHeader(settings.output);
  int rc = 0;
  for (const std::string& a : daemons.addresses()) {
    rc = std::max(rc, CheckDaemonHealth(daemons, a, settings.output));
  }
  return rc;
}

int RunStatus(const Command&, const Settings& settings, Endpoints& daemons) {
  v1::StatusResponse r;
  const grpc::Status s = daemons.Call(&v1::RefitControl::Stub::Status, v1::StatusRequest(), &r);
  if (!s.ok()) return Fail(s);
  if (settings.output == Output::kJson) {
    PrintJson(r);
    return 0;
  }
  const bool wide = settings.output == Output::kWide;
  PrintNodes(r);
  PrintGroups(r, wide);
  PrintReplicas(r, wide);
  return 0;
}

int RunWorkers(const Command& command, const Settings& settings, Endpoints& daemons) {
  v1::ListWorkersRequest req;
  req.set_group(command.group);
  v1::ListWorkersResponse r;
  const grpc::Status s = daemons.Call(&v1::RefitControl::Stub::ListWorkers, req, &r);
  if (!s.ok()) return Fail(s);
  if (settings.output == Output::kJson) {
    PrintJson(r);
  } else {
    PrintWorkers(r);
  }
  return 0;
}

int RunPlan(const Command& command, const Settings& settings, Endpoints& daemons) {
  v1::GetPlanRequest req;
  req.set_group(command.group);
  v1::PlanSummary r;
  const grpc::Status s = daemons.Call(&v1::RefitControl::Stub::GetPlan, req, &r);
  if (!s.ok()) return Fail(s);
  if (settings.output == Output::kJson) {
    PrintJson(r);
  } else {
    PrintPlanSummary(r);
  }
  return 0;
}

// A daemon that was unreachable never saw the request; one that answered (even "no") did:
// failover only past the former, so a round is never started twice by refitctl.
int RunRefit(const Command& command, const Settings& settings, Endpoints& daemons) {
  v1::RefitRequest req;
  req.set_group(command.group);
  req.set_version(command.version);
  if (settings.no_wait) {
    v1::StartRefitResponse r;
    const grpc::Status s = daemons.Call(&v1::RefitControl::Stub::StartRefit, req, &r);
    if (!s.ok()) return Fail(s);
    if (settings.output == Output::kJson) {
      PrintJson(r);
    } else {
      std::printf("round %lld started\n", (long long)r.round_id());
    }
    return 0;
  }
  v1::RoundStats r;
  const grpc::Status s = daemons.Call(&v1::RefitControl::Stub::Refit, req, &r);
  if (!s.ok()) return Fail(s);
  PrintRound(r, settings.output, true);
  return 0;
}

int RunRounds(const Command& command, const Settings& settings, Endpoints& daemons) {
  v1::ListRoundsRequest req;
  req.set_group(command.group);
  req.set_limit(static_cast<int32_t>(settings.limit));
  v1::ListRoundsResponse r;
  const grpc::Status s = daemons.Call(&v1::RefitControl::Stub::ListRounds, req, &r);
  if (!s.ok()) return Fail(s);
  if (settings.output == Output::kJson) {
    PrintJson(r);
  } else {
    PrintRounds(r, settings.output);
  }
  return 0;
}

bool WatchOpened(const grpc::ClientContext& ctx) {
  const auto& metadata = ctx.GetServerInitialMetadata();
  auto open = metadata.find(kWatchOpenKey);
  return open != metadata.end() && open->second == kWatchOpenValue;
}

// Prints rounds from the first daemon that takes the stream until it ends; how it ended. Says on
// stderr once the stream is open: rounds started from then on are all shown.
grpc::Status WatchFirstDaemon(Endpoints& daemons, const v1::WatchRoundsRequest& req, Output out) {
  bool header = true;
  grpc::Status last;
  for (const std::string& a : daemons.addresses()) {
    grpc::ClientContext ctx;
    auto stub = v1::RefitControl::NewStub(daemons.Channel(a));
    auto reader = stub->WatchRounds(&ctx, req);
    reader->WaitForInitialMetadata();  // or the stream's end
    bool any = WatchOpened(ctx);
    if (any) {
      const std::string what =
          req.group().empty() ? "every group" : absl::StrCat("group \"", req.group(), "\"");
      std::fprintf(stderr, "refitctl: watching the rounds of %s at %s\n", what.c_str(), a.c_str());
    }
    v1::RoundStats r;
    while (reader->Read(&r)) {
      any = true;
      PrintRound(r, out, header);
      header = false;
      std::fflush(stdout);
    }
    last = reader->Finish();  // once: a second Finish() aborts the process
    if (any || last.error_code() != grpc::StatusCode::UNAVAILABLE) break;
  }
  return last;
}

// The stream runs until interrupted. Any end is a break (the daemon or its coordinator went
// away): exit 3, never a clean 0.
int RunWatch(const Command& command, const Settings& settings, Endpoints& daemons) {
  v1::WatchRoundsRequest req;
  req.set_group(command.group);
  const grpc::Status last = WatchFirstDaemon(daemons, req, settings.output);
  std::fprintf(stderr, "refitctl: the watch stream ended: %s%s%s\n", CodeName(last.error_code()),
               last.error_message().empty() ? "" : ": ", last.error_message().c_str());
  return last.ok() || last.error_code() == grpc::StatusCode::UNAVAILABLE ||
                 last.error_code() == grpc::StatusCode::CANCELLED
             ? kExitUnreachable
             : Fail(last);
}

using CommandFunction = int (*)(const Command&, const Settings&, Endpoints&);

struct CommandEntry {
  const char* name;
  CommandFunction run;
};

constexpr CommandEntry kCommands[] = {
    {"version", RunVersion}, {"health", RunHealth}, {"status", RunStatus}, {"workers", RunWorkers},
    {"plan", RunPlan},       {"refit", RunRefit},   {"rounds", RunRounds}, {"watch", RunWatch},
};

CommandFunction FindCommand(const std::string& name) {
  for (const CommandEntry& c : kCommands) {
    if (name == c.name) return c.run;
  }
  return nullptr;
}

// The command and its arguments; a usage error names what is wrong.
absl::StatusOr<Command> ParseCommand(const std::vector<std::string>& args) {
  Command command{args[0], args.size() > 1 ? args[1] : ""};
  if (command.name == "plan" && args.size() != 2) {
    return absl::InvalidArgumentError("usage: refitctl plan GROUP");
  }
  if (command.name == "refit" &&
      (args.size() != 3 || !absl::SimpleAtoi(args[2], &command.version))) {
    return absl::InvalidArgumentError("usage: refitctl refit GROUP VERSION");
  }
  if (FindCommand(command.name) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown command \"", command.name,
                     "\" (status, workers, plan, refit, watch, rounds, health, version)"));
  }
  return command;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  CliFlags flags("refitctl", kUsage);
  FlagValues values;
  RegisterFlags(flags, values);
  const std::vector<std::string> args = flags.Parse(argc, argv);
  const absl::StatusOr<Settings> settings = CheckFlags(values, args);
  if (!settings.ok()) flags.Fail(std::string(settings.status().message()));
  Endpoints daemons(settings->addresses, values.timeout_s, values.tls);
  const absl::StatusOr<Command> command = ParseCommand(args);
  if (!command.ok()) flags.Fail(std::string(command.status().message()));
  return FindCommand(command->name)(*command, *settings, daemons);
}
