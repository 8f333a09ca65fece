#include "daemon/config.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <type_traits>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cli_flags.h"
#include "daemon/backend_names.h"
#include "daemon/security/certificate_check.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "plan/plan.h"
#include "plan/status_macros.h"
#include "proto/layout_codec.h"

namespace refit {

bool IsLoopbackAddress(const std::string& address) {
  // host:port, [v6]:port, or a gRPC URI such as ipv4:127.0.0.1:7070.
  std::string host = address;
  for (const char* scheme : {"ipv4:", "ipv6:", "dns:///"}) {
    if (host.rfind(scheme, 0) == 0) host = host.substr(std::string(scheme).size());
  }
  if (const size_t colon = host.rfind(':'); colon != std::string::npos)
    host = host.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

namespace {

// Every flag's default is DaemonConfig's own.
const DaemonConfig& Defaults() {
  static const DaemonConfig* const defaults = new DaemonConfig();
  return *defaults;
}

double DefaultSeconds(absl::Duration DaemonConfig::*field) {
  return absl::ToDoubleSeconds(Defaults().*field);
}

}  // namespace
}  // namespace refit

// refitd's flags, in the order --help lists them. Durations are seconds, as doubles.
ABSL_FLAG(std::string, config, "",
          "JSON file of flag values, e.g. {\"node\": 1, \"coordinator\": \"10.0.0.1:7070\"}");
ABSL_FLAG(int32_t, node, refit::Defaults().node, "this node's index in the cluster");
ABSL_FLAG(std::string, listen, refit::Defaults().listen,
          "gRPC address for peers and operators (host:port; port 0 picks one)");
ABSL_FLAG(std::string, worker_socket, "",
          "Unix socket for local workers (default /tmp/refitd-<node>.sock)");
ABSL_FLAG(std::string, coordinator, "",
          "the coordinator's --listen address (a gRPC target, e.g. dns:///name:port), or file:PATH "
          "naming it (read again when it stops answering); empty: this daemon coordinates");
ABSL_FLAG(int32_t, coordinator_node, refit::Defaults().coordinator_node,
          "the coordinator's --node: obey only that node's certificate as the coordinator (-1: "
          "whichever node answers as itself)");
ABSL_FLAG(std::string, data_listen, refit::Defaults().data_listen,
          "host data plane address peers send messages to");
ABSL_FLAG(double, data_first_byte_timeout,
          refit::DefaultSeconds(&refit::DaemonConfig::data_first_byte_timeout),
          "host data plane: seconds within which a new connection's first frame must begin "
          "(after its TLS handshake, with TLS)");
ABSL_FLAG(double, data_idle_timeout, refit::DefaultSeconds(&refit::DaemonConfig::data_idle_timeout),
          "host data plane: seconds a connection may idle between frames before the receiver "
          "closes it (the sender dials again)");
ABSL_FLAG(std::string, backend, refit::Defaults().backend,
          "data plane: host (shared memory + TCP) or cuda");
ABSL_FLAG(std::string, gpus, "",
          "comma-separated local GPU indices this daemon serves (empty: any)");
ABSL_FLAG(int64_t, max_message_bytes, refit::Defaults().max_message_bytes,
          "staging bound: one message's bytes, per connection");
ABSL_FLAG(bool, routing, refit::Defaults().routing,
          "coordinator: topology routing, network once per node then NVLink (--norouting: off)");
ABSL_FLAG(int64_t, staging_bytes, refit::Defaults().staging_bytes,
          "cuda backend: staging memory per GPU per group (pipelined network steps)");
ABSL_FLAG(int32_t, max_relay_depth, refit::Defaults().max_relay_depth,
          "coordinator: longest chain of relays between destination nodes (0: none)");
ABSL_FLAG(bool, nccl_register, refit::Defaults().nccl_register,
          "coordinator, cuda: staging allocated by NCCL and registered with the communicator "
          "(NCCL moves it buffer to buffer)");
ABSL_FLAG(bool, aligned_copy_kernel, refit::Defaults().aligned_copy_kernel,
          "cuda: copy work whose every unit is 16-byte aligned through the aligned kernel "
          "(inlined loops, no spills; =false: the general kernel for all work)");
ABSL_FLAG(std::string, arm_rounds, refit::Defaults().arm_rounds,
          "cuda: launch a round copied within the node while its workers prepare, let go at "
          "TRANSFER by a host store: auto (default: when MPS shares the GPUs; on one H200 under "
          "MPS the transfer phase 0.02-0.08 ms shorter and PREPARE no longer), always (without "
          "MPS being let go costs a context switch: slower), never");
ABSL_FLAG(bool, nccl_stream_priority, refit::Defaults().nccl_stream_priority,
          "cuda: NCCL's stream at the GPU's highest priority, ahead of pack and unpack kernels "
          "(not yet measured end to end)");
ABSL_FLAG(int64_t, zero_copy_min_bytes, refit::Defaults().zero_copy_min_bytes,
          "coordinator, cuda: smallest descriptor sent without staging (larger: fewer NCCL "
          "operations, more packing)");
ABSL_FLAG(double, prepare_timeout, refit::DefaultSeconds(&refit::DaemonConfig::prepare_timeout),
          "seconds for every worker to confirm PREPARE");
ABSL_FLAG(double, transfer_timeout, refit::DefaultSeconds(&refit::DaemonConfig::transfer_timeout),
          "seconds for a round's transfer");
ABSL_FLAG(double, commit_timeout, refit::DefaultSeconds(&refit::DaemonConfig::commit_timeout),
          "seconds for every worker to confirm COMMIT");
ABSL_FLAG(double, rpc_keepalive, refit::DefaultSeconds(&refit::DaemonConfig::rpc_keepalive),
          "gRPC servers: seconds after which a quiet connection is pinged, and within which the "
          "ping must be answered, or the connection is closed (a caller gone silent or frozen); "
          "not below ~8: an idle gRPC client answers pings only every 5 s");
ABSL_FLAG(double, peer_timeout, refit::DefaultSeconds(&refit::DaemonConfig::peer_timeout),
          "seconds for one control call between daemons");
ABSL_FLAG(double, heartbeat, refit::DefaultSeconds(&refit::DaemonConfig::heartbeat),
          "seconds between a daemon's heartbeats to the coordinator");
ABSL_FLAG(double, join_timeout, refit::DefaultSeconds(&refit::DaemonConfig::join_timeout),
          "seconds to wait for the coordinator at start (0: until it answers)");
ABSL_FLAG(double, drain_timeout, refit::DefaultSeconds(&refit::DaemonConfig::drain_timeout),
          "seconds SIGTERM waits for running rounds before aborting them (then exit 0)");
ABSL_FLAG(int32_t, heartbeats_missed, refit::Defaults().heartbeats_missed,
          "a daemon silent for this many heartbeats is declared dead");
ABSL_FLAG(int32_t, fanout_threads, refit::Defaults().fanout_threads,
          "coordinator: threads that start a phase's calls to the nodes, 1 to 16 (0: a quarter of "
          "the machine's cores, 1 to 4); phases with 16 peers or more are split among them");
ABSL_FLAG(int64_t, max_nodes, refit::Defaults().max_nodes,
          "coordinator: most nodes it lists, itself included; a new node past it is refused "
          "unless a dead one can be forgotten to make room");
ABSL_FLAG(double, forget_dead_after, refit::DefaultSeconds(&refit::DaemonConfig::forget_dead_after),
          "coordinator: seconds a node declared dead stays listed (refitctl status) before it "
          "is forgotten; it may join again");
ABSL_FLAG(int64_t, max_rpc_bytes, refit::Defaults().max_rpc_bytes,
          "largest gRPC message accepted (layouts of big models are large)");
ABSL_FLAG(int64_t, max_registration_pieces, refit::Defaults().limits.max_pieces,
          "most pieces one worker's registration may hold");
ABSL_FLAG(int64_t, max_registration_buffers, refit::Defaults().limits.max_buffers,
          "most buffers one worker's registration may hold");
ABSL_FLAG(int64_t, max_registration_tensors, refit::Defaults().limits.max_tensors,
          "most tensors one worker's registration may name");
ABSL_FLAG(int64_t, max_registration_bytes, refit::Defaults().limits.max_bytes,
          "largest registration, as encoded");
ABSL_FLAG(int64_t, max_group_workers, refit::Defaults().group_limits.max_workers,
          "coordinator: most workers one model group may hold");
ABSL_FLAG(int64_t, max_group_buffers, refit::Defaults().group_limits.max_buffers,
          "coordinator: most buffers one model group's workers may hold in all");
ABSL_FLAG(int64_t, max_group_tensors, refit::Defaults().group_limits.max_tensors,
          "coordinator: most tensor specs one model group's workers may declare in all");
ABSL_FLAG(int64_t, max_group_pieces, refit::Defaults().group_limits.max_pieces,
          "coordinator: most pieces one model group's workers may hold in all");
ABSL_FLAG(int64_t, max_group_bytes, refit::Defaults().group_limits.max_bytes,
          "coordinator: most bytes of registrations (as encoded) one model group may hold in all");
ABSL_FLAG(std::string, log_level, refit::Defaults().log_level,
          "trace, debug, info, warn, error, critical, off");
ABSL_FLAG(std::string, log_format, refit::Defaults().log_format,
          "text (dated lines) or json (one object a line: time, level, logger, node, group, "
          "round, message)");
ABSL_FLAG(std::string, address_file, "",
          "write \"<listen address> <worker socket>\" here once serving");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port serving Prometheus metrics at /metrics (empty: none)");
// The default stands for "<worker socket>.state", known once --worker-socket is.
ABSL_FLAG(std::string, state_file, "<worker socket>.state",
          "coordinator: the file where round ids and committed versions survive a restart "
          "(empty: in memory only)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of this daemon (CN or DNS SAN refit-node-<node>, DNS SAN "
          "refitd); with --tls-key and --tls-ca: mutual TLS (docs/SECURITY.md)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle that signs every certificate of the cluster");
ABSL_FLAG(double, tls_reload_interval, absl::ToDoubleSeconds(refit::Defaults().tls.reload),
          "seconds between checks of the TLS files for a rotated certificate");
ABSL_FLAG(std::string, tls_operators, absl::StrJoin(refit::Defaults().tls.operators, ","),
          "comma-separated certificate names (CN or DNS SAN) allowed to start refits");
ABSL_FLAG(std::string, tls_workers, absl::StrJoin(refit::Defaults().tls.workers, ","),
          "comma-separated certificate names allowed to register workers over --worker-listen");
ABSL_FLAG(std::string, tls_viewers, absl::StrJoin(refit::Defaults().tls.viewers, ","),
          "comma-separated certificate names allowed to read status, plans, workers and rounds");
ABSL_FLAG(bool, insecure_listen, refit::Defaults().insecure_listen,
          "without TLS, listen on a non-loopback address all the same (anyone who reaches it "
          "can steer and read the weights)");
ABSL_FLAG(std::string, worker_uids, "",
          "comma-separated uids whose processes may register workers (empty: this daemon's "
          "uid and root)");
ABSL_FLAG(double, worker_attach_timeout,
          refit::DefaultSeconds(&refit::DaemonConfig::worker_attach_timeout),
          "seconds a registered worker has to open its session before it is dropped");
ABSL_FLAG(bool, check_config, false,
          "check the flags and the config file (TLS files readable, listeners allowed), print "
          "what would run, exit 0; exit 2 naming what is wrong");
ABSL_FLAG(std::string, health_listen, "",
          "plaintext gRPC health service only, for probes without a certificate (host:port; "
          "empty: none)");
ABSL_FLAG(std::string, worker_listen, "",
          "also serve workers over TCP here (host:port; empty: the unix socket only)");

namespace refit {
namespace {

const FlagSet& DaemonFlags() {
  static const FlagSet* const flags = new FlagSet(
      "refitd", "[--config FILE] [flags]", FLAGS_config, FLAGS_node, FLAGS_listen,
      FLAGS_worker_socket, FLAGS_coordinator, FLAGS_coordinator_node, FLAGS_data_listen,
      FLAGS_data_first_byte_timeout, FLAGS_data_idle_timeout, FLAGS_backend, FLAGS_gpus,
      FLAGS_max_message_bytes, FLAGS_routing, FLAGS_staging_bytes, FLAGS_max_relay_depth,
      FLAGS_nccl_register, FLAGS_aligned_copy_kernel, FLAGS_arm_rounds, FLAGS_nccl_stream_priority,
      FLAGS_zero_copy_min_bytes, FLAGS_prepare_timeout, FLAGS_transfer_timeout,
      FLAGS_commit_timeout, FLAGS_peer_timeout, FLAGS_rpc_keepalive, FLAGS_heartbeat,
      FLAGS_join_timeout, FLAGS_drain_timeout, FLAGS_heartbeats_missed, FLAGS_fanout_threads,
      FLAGS_max_nodes, FLAGS_forget_dead_after, FLAGS_max_rpc_bytes, FLAGS_max_registration_pieces,
      FLAGS_max_registration_buffers, FLAGS_max_registration_tensors, FLAGS_max_registration_bytes,
      FLAGS_max_group_workers, FLAGS_max_group_buffers, FLAGS_max_group_tensors,
      FLAGS_max_group_pieces, FLAGS_max_group_bytes, FLAGS_log_level, FLAGS_log_format,
      FLAGS_address_file, FLAGS_metrics_listen, FLAGS_state_file, FLAGS_tls_cert, FLAGS_tls_key,
      FLAGS_tls_ca, FLAGS_tls_reload_interval, FLAGS_tls_operators, FLAGS_tls_workers,
      FLAGS_tls_viewers, FLAGS_insecure_listen, FLAGS_worker_uids, FLAGS_worker_attach_timeout,
      FLAGS_check_config, FLAGS_health_listen, FLAGS_worker_listen);
  return *flags;
}

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// --- The config file: a JSON object whose keys are the flags' names.

// A JSON number as a flag's text: whole numbers without exponent (an int64 flag such as
// --max-rpc-bytes parses them), others with the fewest digits that give the number back.
std::string NumberText(double number) {
  if (number == std::trunc(number) && std::abs(number) < 0x1p62) {
    return absl::StrCat(static_cast<int64_t>(number));
  }
  for (int digits = 6;; ++digits) {
    const std::string text = absl::StrFormat("%.*g", digits, number);
    double back = 0;
    if (digits >= 17 || (absl::SimpleAtod(text, &back) && back == number)) return text;
  }
}

absl::StatusOr<std::string> ValueText(const google::protobuf::Value& value) {
  switch (value.kind_case()) {
    case google::protobuf::Value::kStringValue:
      return value.string_value();
    case google::protobuf::Value::kNumberValue:
      return NumberText(value.number_value());
    case google::protobuf::Value::kBoolValue:
      return std::string(value.bool_value() ? "true" : "false");
    default:
      return Invalid("must be a string, number or boolean");
  }
}

// The flags a config file gives; errors name the file (and the key).
absl::StatusOr<std::vector<GivenFlag>> ConfigFileFlags(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::string text, ReadFile(path));
  google::protobuf::Struct object;
  if (!google::protobuf::util::JsonStringToMessage(text, &object).ok()) {
    return Invalid(absl::StrCat(path, ": not a JSON object"));
  }
  std::vector<GivenFlag> flags;
  for (const auto& [key, value] : object.fields()) {
    if (key == "config" || !DaemonFlags().Has(key)) {
      return Invalid(absl::StrCat(path, ": unknown key \"", key,
                                  "\" (keys are refitd's flags without \"--\": refitd --help)"));
    }
    absl::StatusOr<std::string> text = ValueText(value);
    if (!text.ok()) return Invalid(absl::StrCat(path, ": \"", key, "\" ", text.status().message()));
    flags.push_back({key, *std::move(text)});
  }
  return flags;
}

absl::Status ApplyConfigFile(const std::string& path) {
  REFIT_ASSIGN_OR_RETURN(const std::vector<GivenFlag> flags, ConfigFileFlags(path));
  if (absl::Status s = DaemonFlags().Apply(flags); !s.ok()) {
    return Invalid(absl::StrCat(path, ": ", s.message()));  // a bad value names its file
  }
  return absl::OkStatus();
}

// The config file the command line names (the last --config), or "".
std::string ConfigFileOf(const CommandLine& line) {
  std::string path;
  for (const GivenFlag& f : line.flags) {
    if (f.name == CommandLineName(FLAGS_config)) path = f.value;
  }
  return path;
}

// --- Reading the flags into a DaemonConfig, each checked.

absl::StatusOr<absl::Duration> PositiveSeconds(const absl::Flag<double>& flag) {
  const double seconds = absl::GetFlag(flag);
  if (!(seconds > 0))
    return Invalid(absl::StrCat("--", CommandLineName(flag), " must be positive"));
  return absl::Seconds(seconds);
}

absl::StatusOr<absl::Duration> NonNegativeSeconds(const absl::Flag<double>& flag) {
  const double seconds = absl::GetFlag(flag);
  if (!(seconds >= 0)) return Invalid(absl::StrCat("--", CommandLineName(flag), " must be >= 0"));
  return absl::Seconds(seconds);
}

absl::StatusOr<int64_t> PositiveCount(const absl::Flag<int64_t>& flag) {
  const int64_t count = absl::GetFlag(flag);
  if (count < 1) return Invalid(absl::StrCat("--", CommandLineName(flag), " must be positive"));
  return count;
}

// A comma-separated list of numbers (empty items skipped); a bad item is named with its flag.
template <typename T>
absl::StatusOr<std::vector<T>> NumberList(const absl::Flag<std::string>& flag,
                                          absl::string_view what) {
  std::vector<T> numbers;
  for (absl::string_view item : absl::StrSplit(absl::GetFlag(flag), ',', absl::SkipEmpty())) {
    T number{};
    if (!absl::SimpleAtoi(item, &number) || (std::is_signed_v<T> && number < T{0})) {
      return Invalid(absl::StrCat("--", CommandLineName(flag), ": \"", item, "\" is not ", what));
    }
    numbers.push_back(number);
  }
  return numbers;
}

std::vector<std::string> NameList(const absl::Flag<std::string>& flag) {
  return absl::StrSplit(absl::GetFlag(flag), ',', absl::SkipEmpty());
}

absl::Status ReadNodeAndAddresses(DaemonConfig& c) {
  c.node = absl::GetFlag(FLAGS_node);
  if (c.node < 0) return Invalid("--node must be >= 0");
  c.coordinator_node = absl::GetFlag(FLAGS_coordinator_node);
  if (c.coordinator_node < -1) return Invalid("--coordinator-node must be a node index, or -1");
  c.coordinator = absl::GetFlag(FLAGS_coordinator);
  c.listen = absl::GetFlag(FLAGS_listen);
  c.data_listen = absl::GetFlag(FLAGS_data_listen);
  c.worker_socket = absl::GetFlag(FLAGS_worker_socket);
  if (c.worker_socket.empty()) c.worker_socket = absl::StrCat("/tmp/refitd-", c.node, ".sock");
  const std::string state_file = absl::GetFlag(FLAGS_state_file);
  c.state_file = state_file == absl::GetFlagReflectionHandle(FLAGS_state_file).DefaultValue()
                     ? c.worker_socket + ".state"
                     : state_file;
  c.address_file = absl::GetFlag(FLAGS_address_file);
  c.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  c.health_listen = absl::GetFlag(FLAGS_health_listen);
  c.worker_listen = absl::GetFlag(FLAGS_worker_listen);
  return absl::OkStatus();
}

absl::Status ReadCudaSettings(DaemonConfig& c) {
  c.staging_bytes = absl::GetFlag(FLAGS_staging_bytes);
  if (c.staging_bytes < (int64_t{1} << 20))
    return Invalid("--staging-bytes must be at least 1048576");
  c.zero_copy_min_bytes = absl::GetFlag(FLAGS_zero_copy_min_bytes);
  if (c.zero_copy_min_bytes < 1) return Invalid("--zero-copy-min-bytes must be positive");
  c.arm_rounds = absl::GetFlag(FLAGS_arm_rounds);
  if (c.arm_rounds != "never" && c.arm_rounds != "auto" && c.arm_rounds != "always") {
    return Invalid(
        absl::StrCat("--arm-rounds must be never, auto or always, not \"", c.arm_rounds, "\""));
  }
  c.nccl_register = absl::GetFlag(FLAGS_nccl_register);
  c.nccl_stream_priority = absl::GetFlag(FLAGS_nccl_stream_priority);
  c.aligned_copy_kernel = absl::GetFlag(FLAGS_aligned_copy_kernel);
  REFIT_ASSIGN_OR_RETURN(c.gpus, NumberList<int32_t>(FLAGS_gpus, "a GPU index"));
  return absl::OkStatus();
}

absl::Status ReadDataPlane(DaemonConfig& c) {
  c.backend = absl::GetFlag(FLAGS_backend);
  REFIT_RETURN_IF_ERROR(CheckBackendName(c.backend));
  c.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (c.max_message_bytes < 4096 || c.max_message_bytes > (int64_t{1} << 31)) {
    return Invalid("--max-message-bytes must be in [4096, 2^31]");
  }
  c.routing = absl::GetFlag(FLAGS_routing);
  c.max_relay_depth = absl::GetFlag(FLAGS_max_relay_depth);
  if (c.max_relay_depth < 0 || c.max_relay_depth > kMaxStages - 2) {
    return Invalid(absl::StrCat("--max-relay-depth must be in [0, ", kMaxStages - 2, "]"));
  }
  REFIT_ASSIGN_OR_RETURN(c.data_first_byte_timeout, PositiveSeconds(FLAGS_data_first_byte_timeout));
  REFIT_ASSIGN_OR_RETURN(c.data_idle_timeout, PositiveSeconds(FLAGS_data_idle_timeout));
  return ReadCudaSettings(c);
}

absl::Status ReadTimeouts(DaemonConfig& c) {
  REFIT_ASSIGN_OR_RETURN(c.prepare_timeout, PositiveSeconds(FLAGS_prepare_timeout));
  REFIT_ASSIGN_OR_RETURN(c.transfer_timeout, PositiveSeconds(FLAGS_transfer_timeout));
  REFIT_ASSIGN_OR_RETURN(c.commit_timeout, PositiveSeconds(FLAGS_commit_timeout));
  REFIT_ASSIGN_OR_RETURN(c.peer_timeout, PositiveSeconds(FLAGS_peer_timeout));
  REFIT_ASSIGN_OR_RETURN(c.rpc_keepalive, PositiveSeconds(FLAGS_rpc_keepalive));
  REFIT_ASSIGN_OR_RETURN(c.heartbeat, PositiveSeconds(FLAGS_heartbeat));
  c.heartbeats_missed = std::max(1, absl::GetFlag(FLAGS_heartbeats_missed));
  REFIT_ASSIGN_OR_RETURN(c.forget_dead_after, PositiveSeconds(FLAGS_forget_dead_after));
  REFIT_ASSIGN_OR_RETURN(c.drain_timeout, NonNegativeSeconds(FLAGS_drain_timeout));
  REFIT_ASSIGN_OR_RETURN(c.join_timeout, NonNegativeSeconds(FLAGS_join_timeout));
  REFIT_ASSIGN_OR_RETURN(c.worker_attach_timeout, PositiveSeconds(FLAGS_worker_attach_timeout));
  return absl::OkStatus();
}

absl::Status ReadLimits(DaemonConfig& c) {
  REFIT_ASSIGN_OR_RETURN(c.max_nodes, PositiveCount(FLAGS_max_nodes));
  c.fanout_threads = absl::GetFlag(FLAGS_fanout_threads);
  if (c.fanout_threads < 0 || c.fanout_threads > 16) {
    return Invalid(absl::StrCat("--fanout-threads must be in [0, 16] (0: from the cores), not ",
                                c.fanout_threads));
  }
  c.max_rpc_bytes = absl::GetFlag(FLAGS_max_rpc_bytes);
  if (c.max_rpc_bytes < 1024 || c.max_rpc_bytes > (int64_t{2} << 30) - 1) {
    return Invalid("--max-rpc-bytes must be in [1024, 2^31)");
  }
  REFIT_ASSIGN_OR_RETURN(c.limits.max_pieces, PositiveCount(FLAGS_max_registration_pieces));
  REFIT_ASSIGN_OR_RETURN(c.limits.max_buffers, PositiveCount(FLAGS_max_registration_buffers));
  REFIT_ASSIGN_OR_RETURN(c.limits.max_tensors, PositiveCount(FLAGS_max_registration_tensors));
  REFIT_ASSIGN_OR_RETURN(c.limits.max_bytes, PositiveCount(FLAGS_max_registration_bytes));
  REFIT_ASSIGN_OR_RETURN(c.group_limits.max_workers, PositiveCount(FLAGS_max_group_workers));
  REFIT_ASSIGN_OR_RETURN(c.group_limits.max_buffers, PositiveCount(FLAGS_max_group_buffers));
  REFIT_ASSIGN_OR_RETURN(c.group_limits.max_tensors, PositiveCount(FLAGS_max_group_tensors));
  REFIT_ASSIGN_OR_RETURN(c.group_limits.max_pieces, PositiveCount(FLAGS_max_group_pieces));
  REFIT_ASSIGN_OR_RETURN(c.group_limits.max_bytes, PositiveCount(FLAGS_max_group_bytes));
  return absl::OkStatus();
}

absl::Status ReadLogging(DaemonConfig& c) {
  static const std::set<std::string> kLevels = {"trace", "debug",    "info", "warn",
                                                "error", "critical", "off"};
  c.log_level = absl::GetFlag(FLAGS_log_level);
  if (!kLevels.contains(c.log_level)) {
    return Invalid(absl::StrCat("--log-level \"", c.log_level,
                                "\" is not one of trace, debug, info, warn, error, critical, off"));
  }
  c.log_format = absl::GetFlag(FLAGS_log_format);
  if (c.log_format != "text" && c.log_format != "json") {
    return Invalid(absl::StrCat("--log-format \"", c.log_format, "\" is not text or json"));
  }
  return absl::OkStatus();
}

// The three TLS files: all or none, each readable, and the certificate this node's (what every
// peer would refuse later, round after round, is refused now, by name).
absl::Status ReadTlsFiles(DaemonConfig& c) {
  c.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  c.tls.key = absl::GetFlag(FLAGS_tls_key);
  c.tls.ca = absl::GetFlag(FLAGS_tls_ca);
  if (c.tls.cert.empty() != c.tls.key.empty() || c.tls.cert.empty() != c.tls.ca.empty()) {
    return Invalid("--tls-cert, --tls-key and --tls-ca go together: give all three, or none");
  }
  for (const std::string* file : {&c.tls.cert, &c.tls.key, &c.tls.ca}) {
    if (!file->empty() && !ReadFile(*file).ok()) {
      return Invalid(absl::StrCat("cannot read TLS file ", *file));
    }
  }
  if (!c.tls.enabled()) return absl::OkStatus();
  if (absl::Status s = CheckDaemonCertificate(c.tls, c.node); !s.ok()) {
    return Invalid(s.message());
  }
  return absl::OkStatus();
}

absl::Status ReadSecurity(DaemonConfig& c) {
  REFIT_RETURN_IF_ERROR(ReadTlsFiles(c));
  REFIT_ASSIGN_OR_RETURN(c.tls.reload, PositiveSeconds(FLAGS_tls_reload_interval));
  c.tls.operators = NameList(FLAGS_tls_operators);
  c.tls.viewers = NameList(FLAGS_tls_viewers);
  c.tls.workers = NameList(FLAGS_tls_workers);
  c.insecure_listen = absl::GetFlag(FLAGS_insecure_listen);
  REFIT_ASSIGN_OR_RETURN(c.worker_uids, NumberList<uint32_t>(FLAGS_worker_uids, "a uid"));
  return absl::OkStatus();
}

// Without TLS every listener that can steer or read the weights must be loopback, unless
// --insecure-listen accepts the risk. (--metrics-listen is exempt: metrics say nothing of the
// weights and steer nothing.)
absl::Status CheckListenersAllowed(const DaemonConfig& c) {
  if (c.tls.enabled() || c.insecure_listen) return absl::OkStatus();
  for (const auto& [flag, address] : {std::pair<std::string, std::string>{"--listen", c.listen},
                                      {"--data-listen", c.data_listen},
                                      {"--worker-listen", c.worker_listen}}) {
    if (!address.empty() && !IsLoopbackAddress(address)) {
      return Invalid(absl::StrCat(
          flag, " ", address,
          " is not a loopback address and no TLS is configured: give --tls-cert, --tls-key and "
          "--tls-ca (docs/SECURITY.md), or --insecure-listen to accept that anyone who reaches "
          "it can steer and read the weights"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DaemonConfig> ReadDaemonConfig() {
  DaemonConfig c;
  REFIT_RETURN_IF_ERROR(ReadNodeAndAddresses(c));
  REFIT_RETURN_IF_ERROR(ReadDataPlane(c));
  REFIT_RETURN_IF_ERROR(ReadLogging(c));
  REFIT_RETURN_IF_ERROR(ReadTimeouts(c));
  REFIT_RETURN_IF_ERROR(ReadLimits(c));
  REFIT_RETURN_IF_ERROR(ReadSecurity(c));
  REFIT_RETURN_IF_ERROR(CheckListenersAllowed(c));
  return c;
}

// Sets the flags from the defaults, then the config file, then the command line in order.
absl::StatusOr<CommandLine> SetDaemonFlags(int argc, const char* const* argv) {
  const FlagSet& flags = DaemonFlags();
  REFIT_ASSIGN_OR_RETURN(CommandLine line, flags.Split(argc, argv));
  REFIT_RETURN_IF_ERROR(flags.ResetToDefaults());
  if (const std::string path = ConfigFileOf(line); !path.empty()) {
    REFIT_RETURN_IF_ERROR(ApplyConfigFile(path));
  }
  REFIT_RETURN_IF_ERROR(flags.Apply(line.flags));
  return line;
}

}  // namespace

absl::StatusOr<DaemonInvocation> ParseDaemonFlags(int argc, const char* const* argv) {
  REFIT_ASSIGN_OR_RETURN(const CommandLine line, SetDaemonFlags(argc, argv));
  DaemonInvocation invocation;
  if (line.help) {
    invocation.action = DaemonInvocation::Action::kPrintHelp;
    return invocation;
  }
  if (!line.positional.empty()) {
    return Invalid(absl::StrCat("unexpected argument \"", line.positional[0], "\""));
  }
  REFIT_ASSIGN_OR_RETURN(invocation.config, ReadDaemonConfig());
  if (absl::GetFlag(FLAGS_check_config)) invocation.action = DaemonInvocation::Action::kCheckConfig;
  return invocation;
}

std::string DaemonFlagsHelp() { return DaemonFlags().Help(); }

std::vector<std::string> ConfigWarnings(const DaemonConfig& c) {
  std::vector<std::string> warnings;
  // An idle gRPC C-core client reads its connection only when its backup poller runs, every 5 s:
  // a ping it must answer sooner closes its connection, and a call sent as it closes fails.
  if (c.rpc_keepalive < absl::Seconds(8)) {
    warnings.push_back(absl::StrCat(
        "--rpc-keepalive ", absl::FormatDuration(c.rpc_keepalive),
        " is below 8s: an idle gRPC client answers pings only every 5s, so its connection will "
        "be closed and a call made as it closes will fail"));
  }
  return warnings;
}

std::string DescribeConfig(const DaemonConfig& c) {
  const std::string role =
      c.is_coordinator() ? "coordinator" : absl::StrCat("coordinator at ", c.coordinator);
  const std::string security =
      c.tls.enabled()     ? absl::StrCat("TLS: certificate ", c.tls.cert, ", CA ", c.tls.ca)
      : c.insecure_listen ? "no TLS, and --insecure-listen: anyone who reaches it can steer"
                          : "no TLS (loopback only)";
  return absl::StrCat("refitd: the configuration is valid: node ", c.node, ", ", role, ", listen ",
                      c.listen, ", data ", c.data_listen, ", ", security);
}

}  // namespace refit
