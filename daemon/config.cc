#include "daemon/config.h"

#include <cstdio>
#include <cstdlib>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cli_flags.h"
#include "daemon/certificate_check.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "plan/plan.h"
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

DaemonConfig ParseDaemonFlags(int argc, char** argv) {
  DaemonConfig c;
  std::string config_file;
  int64_t node = c.node, max_message = c.max_message_bytes, missed = c.heartbeats_missed,
          max_rpc = c.max_rpc_bytes, staging = c.staging_bytes, zero_copy = c.zero_copy_min_bytes,
          relay_depth = c.max_relay_depth;
  double prepare_s = absl::ToDoubleSeconds(c.prepare_timeout),
         transfer_s = absl::ToDoubleSeconds(c.transfer_timeout),
         commit_s = absl::ToDoubleSeconds(c.commit_timeout),
         peer_s = absl::ToDoubleSeconds(c.peer_timeout),
         heartbeat_s = absl::ToDoubleSeconds(c.heartbeat);
  CliFlags flags("refitd", "[--config FILE] [flags]");
  flags.String("config", &config_file,
               "JSON file of flag values, e.g. {\"node\": 1, \"coordinator\": \"10.0.0.1:7070\"}");
  flags.Int("node", &node, "this node's index in the cluster");
  flags.String("listen", &c.listen,
               "gRPC address for peers and operators (host:port; port 0 picks one)");
  flags.String("worker-socket", &c.worker_socket,
               "Unix socket for local workers (default /tmp/refitd-<node>.sock)");
  flags.String(
      "coordinator", &c.coordinator,
      "the coordinator's --listen address (a gRPC target, e.g. dns:///name:port), or file:PATH "
      "naming it (read again when it stops answering); empty: this daemon coordinates");
  int64_t coordinator_node = c.coordinator_node;
  flags.Int("coordinator-node", &coordinator_node,
            "the coordinator's --node: obey only that node's certificate as the coordinator (-1: "
            "whichever node answers as itself)");
  flags.String("data-listen", &c.data_listen, "host data plane address peers send messages to");
  double data_first_byte_s = absl::ToDoubleSeconds(c.data_first_byte_timeout),
         data_idle_s = absl::ToDoubleSeconds(c.data_idle_timeout);
  flags.Double("data-first-byte-timeout", &data_first_byte_s,
               "host data plane: seconds within which a new connection's first frame must begin "
               "(after its TLS handshake, with TLS)");
  flags.Double("data-idle-timeout", &data_idle_s,
               "host data plane: seconds a connection may idle between frames before the receiver "
               "closes it (the sender dials again)");
  flags.String("backend", &c.backend, "data plane: host (shared memory + TCP) or cuda");
  std::string gpus;
  flags.String("gpus", &gpus, "comma-separated local GPU indices this daemon serves (empty: any)");
  flags.Int("max-message-bytes", &max_message,
            "staging bound: one message's bytes, per connection");
  flags.Bool("routing", &c.routing,
             "coordinator: topology routing, network once per node then NVLink (--norouting: off)");
  flags.Int("staging-bytes", &staging,
            "cuda backend: staging memory per GPU per group (pipelined network steps)");
  flags.Int("max-relay-depth", &relay_depth,
            "coordinator: longest chain of relays between destination nodes (0: none)");
  flags.Bool("nccl-register", &c.nccl_register,
             "coordinator, cuda: staging allocated by NCCL and registered with the communicator "
             "(NCCL moves it buffer to buffer)");
  flags.Bool("aligned-copy-kernel", &c.aligned_copy_kernel,
             "cuda: copy work whose every unit is 16-byte aligned through the aligned kernel "
             "(inlined loops, no spills; =false: the general kernel for all work)");
  flags.String("arm-rounds", &c.arm_rounds,
               "cuda: launch a round copied within the node while its workers prepare, let go at "
               "TRANSFER by a host store: auto (default: when MPS shares the GPUs; on one H200 "
               "under MPS the transfer phase 0.02-0.08 ms shorter and PREPARE no longer), always "
               "(without MPS being let go costs a context switch: slower), never");
  flags.Bool("nccl-stream-priority", &c.nccl_stream_priority,
             "cuda: NCCL's stream at the GPU's highest priority, ahead of pack and unpack kernels "
             "(not yet measured end to end)");
  flags.Int("zero-copy-min-bytes", &zero_copy,
            "coordinator, cuda: smallest descriptor sent without staging (larger: fewer NCCL "
            "operations, more packing)");
  flags.Double("prepare-timeout", &prepare_s, "seconds for every worker to confirm PREPARE");
  flags.Double("transfer-timeout", &transfer_s, "seconds for a round's transfer");
  flags.Double("commit-timeout", &commit_s, "seconds for every worker to confirm COMMIT");
  flags.Double("peer-timeout", &peer_s, "seconds for one control call between daemons");
  flags.Double("heartbeat", &heartbeat_s,
               "seconds between a daemon's heartbeats to the coordinator");
  double join_s = absl::ToDoubleSeconds(c.join_timeout);
  flags.Double("join-timeout", &join_s,
               "seconds to wait for the coordinator at start (0: until it answers)");
  double drain_s = absl::ToDoubleSeconds(c.drain_timeout);
  flags.Double("drain-timeout", &drain_s,
               "seconds SIGTERM waits for running rounds before aborting them (then exit 0)");
  flags.Int("heartbeats-missed", &missed,
            "a daemon silent for this many heartbeats is declared dead");
  flags.Int("max-nodes", &c.max_nodes,
            "coordinator: most nodes it lists, itself included; a new node past it is refused "
            "unless a dead one can be forgotten to make room");
  double forget_s = absl::ToDoubleSeconds(c.forget_dead_after);
  flags.Double("forget-dead-after", &forget_s,
               "coordinator: seconds a node declared dead stays listed (refitctl status) before it "
               "is forgotten; it may join again");
  flags.Int("max-rpc-bytes", &max_rpc,
            "largest gRPC message accepted (layouts of big models are large)");
  flags.Int("max-registration-pieces", &c.limits.max_pieces,
            "most pieces one worker's registration may hold");
  flags.Int("max-registration-buffers", &c.limits.max_buffers,
            "most buffers one worker's registration may hold");
  flags.Int("max-registration-tensors", &c.limits.max_tensors,
            "most tensors one worker's registration may name");
  flags.Int("max-registration-bytes", &c.limits.max_bytes, "largest registration, as encoded");
  flags.Int("max-group-workers", &c.group_limits.max_workers,
            "coordinator: most workers one model group may hold");
  flags.Int("max-group-buffers", &c.group_limits.max_buffers,
            "coordinator: most buffers one model group's workers may hold in all");
  flags.Int("max-group-tensors", &c.group_limits.max_tensors,
            "coordinator: most tensor specs one model group's workers may declare in all");
  flags.Int("max-group-pieces", &c.group_limits.max_pieces,
            "coordinator: most pieces one model group's workers may hold in all");
  flags.Int(
      "max-group-bytes", &c.group_limits.max_bytes,
      "coordinator: most bytes of registrations (as encoded) one model group may hold in all");
  flags.String("log-level", &c.log_level, "trace, debug, info, warn, error, critical, off");
  flags.String("log-format", &c.log_format,
               "text (dated lines) or json (one object a line: time, level, logger, node, group, "
               "round, message)");
  flags.String("address-file", &c.address_file,
               "write \"<listen address> <worker socket>\" here once serving");
  flags.String("metrics-listen", &c.metrics_listen,
               "host:port serving Prometheus metrics at /metrics (empty: none)");
  const std::string unset = "<worker socket>.state";
  std::string state_file = unset;
  flags.String("state-file", &state_file,
               "coordinator: the file where round ids and committed versions survive a restart "
               "(empty: in memory only)");
  flags.String("tls-cert", &c.tls.cert,
               "PEM certificate chain of this daemon (CN or DNS SAN refit-node-<node>, DNS SAN "
               "refitd); with --tls-key and --tls-ca: mutual TLS (docs/SECURITY.md)");
  flags.String("tls-key", &c.tls.key, "PEM private key of --tls-cert");
  flags.String("tls-ca", &c.tls.ca, "PEM CA bundle that signs every certificate of the cluster");
  double reload_s = absl::ToDoubleSeconds(c.tls.reload);
  flags.Double("tls-reload-interval", &reload_s,
               "seconds between checks of the TLS files for a rotated certificate");
  std::string operators = absl::StrJoin(c.tls.operators, ","),
              viewers = absl::StrJoin(c.tls.viewers, ",");
  flags.String("tls-operators", &operators,
               "comma-separated certificate names (CN or DNS SAN) allowed to start refits");
  std::string tls_workers = absl::StrJoin(c.tls.workers, ",");
  flags.String(
      "tls-workers", &tls_workers,
      "comma-separated certificate names allowed to register workers over --worker-listen");
  flags.String(
      "tls-viewers", &viewers,
      "comma-separated certificate names allowed to read status, plans, workers and rounds");
  flags.Bool("insecure-listen", &c.insecure_listen,
             "without TLS, listen on a non-loopback address all the same (anyone who reaches it "
             "can steer and read the weights)");
  std::string worker_uids;
  flags.String("worker-uids", &worker_uids,
               "comma-separated uids whose processes may register workers (empty: this daemon's "
               "uid and root)");
  double attach_s = absl::ToDoubleSeconds(c.worker_attach_timeout);
  flags.Double("worker-attach-timeout", &attach_s,
               "seconds a registered worker has to open its session before it is dropped");
  bool check_config = false;
  flags.Bool("check-config", &check_config,
             "check the flags and the config file (TLS files readable, listeners allowed), print "
             "what would run, exit 0; exit 2 naming what is wrong");
  flags.String("health-listen", &c.health_listen,
               "plaintext gRPC health service only, for probes without a certificate (host:port; "
               "empty: none)");
  flags.String("worker-listen", &c.worker_listen,
               "also serve workers over TCP here (host:port; empty: the unix socket only)");
  // Config file first, then the command line over it.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) config_file = argv[i + 1];
    if (a.rfind("--config=", 0) == 0) config_file = a.substr(9);
  }
  if (!config_file.empty()) {
    auto text = ReadFile(config_file);
    if (!text.ok()) flags.Fail(std::string(text.status().message()));
    google::protobuf::Struct s;
    if (!google::protobuf::util::JsonStringToMessage(*text, &s).ok()) {
      flags.Fail(absl::StrCat(config_file, ": not a JSON object"));
    }
    std::vector<std::string> args = {"refitd"};
    for (const auto& [key, value] : s.fields()) {
      if (key == "config" || !flags.Has(key)) {
        flags.Fail(absl::StrCat(config_file, ": unknown key \"", key,
                                "\" (keys are refitd's flags without \"--\": refitd --help)"));
      }
      std::string v;
      switch (value.kind_case()) {
        case google::protobuf::Value::kStringValue:
          v = value.string_value();
          break;
        case google::protobuf::Value::kNumberValue:
          v = absl::StrCat(value.number_value());
          break;
        case google::protobuf::Value::kBoolValue:
          v = value.bool_value() ? "true" : "false";
          break;
        default:
          flags.Fail(
              absl::StrCat(config_file, ": \"", key, "\" must be a string, number or boolean"));
      }
      args.push_back(absl::StrCat("--", key, "=", v));
    }
    std::vector<char*> ptrs;
    for (auto& a : args) ptrs.push_back(a.data());
    flags.SetErrorContext(config_file);  // a bad value names the file it came from
    flags.Parse(static_cast<int>(ptrs.size()), ptrs.data());
    flags.SetErrorContext("");
  }
  const auto positional = flags.Parse(argc, argv);
  if (!positional.empty()) flags.Fail(absl::StrCat("unexpected argument \"", positional[0], "\""));
  if (node < 0) flags.Fail("--node must be >= 0");
  if (coordinator_node < -1 || coordinator_node > INT32_MAX)
    flags.Fail("--coordinator-node must be a node index, or -1");
  c.coordinator_node = static_cast<int32_t>(coordinator_node);
  if (max_message < 4096 || max_message > (int64_t{1} << 31)) {
    flags.Fail("--max-message-bytes must be in [4096, 2^31]");
  }
  if (staging < (int64_t{1} << 20)) flags.Fail("--staging-bytes must be at least 1048576");
  c.staging_bytes = staging;
  if (zero_copy < 1) flags.Fail("--zero-copy-min-bytes must be positive");
  if (c.arm_rounds != "never" && c.arm_rounds != "auto" && c.arm_rounds != "always") {
    flags.Fail(
        absl::StrCat("--arm-rounds must be never, auto or always, not \"", c.arm_rounds, "\""));
  }
  c.zero_copy_min_bytes = zero_copy;
  if (relay_depth < 0 || relay_depth > kMaxStages - 2)
    flags.Fail(absl::StrCat("--max-relay-depth must be in [0, ", kMaxStages - 2, "]"));
  c.max_relay_depth = static_cast<int32_t>(relay_depth);
  if (c.backend != "host" && c.backend != "cuda") flags.Fail("--backend must be host or cuda");
  static const std::set<std::string> kLevels = {"trace", "debug",    "info", "warn",
                                                "error", "critical", "off"};
  if (!kLevels.contains(c.log_level)) {
    flags.Fail(absl::StrCat("--log-level \"", c.log_level,
                            "\" is not one of trace, debug, info, warn, error, critical, off"));
  }
  if (c.log_format != "text" && c.log_format != "json") {
    flags.Fail(absl::StrCat("--log-format \"", c.log_format, "\" is not text or json"));
  }
  for (absl::string_view part : absl::StrSplit(gpus, ',', absl::SkipEmpty())) {
    int32_t gpu = -1;
    if (!absl::SimpleAtoi(part, &gpu) || gpu < 0)
      flags.Fail(absl::StrCat("--gpus: \"", part, "\" is not a GPU index"));
    c.gpus.push_back(gpu);
  }
  for (double v : {prepare_s, transfer_s, commit_s, peer_s, heartbeat_s}) {
    if (v <= 0) flags.Fail("every timeout and the heartbeat must be positive");
  }
  if (max_rpc < 1024 || max_rpc > (int64_t{2} << 30) - 1)
    flags.Fail("--max-rpc-bytes must be in [1024, 2^31)");
  c.max_rpc_bytes = max_rpc;
  c.node = static_cast<int32_t>(node);
  c.max_message_bytes = max_message;
  c.heartbeats_missed = static_cast<int>(std::max<int64_t>(1, missed));
  if (c.max_nodes < 1) flags.Fail("--max-nodes must be positive");
  if (forget_s <= 0) flags.Fail("--forget-dead-after must be positive");
  c.forget_dead_after = absl::Seconds(forget_s);
  c.prepare_timeout = absl::Seconds(prepare_s);
  c.transfer_timeout = absl::Seconds(transfer_s);
  c.commit_timeout = absl::Seconds(commit_s);
  c.peer_timeout = absl::Seconds(peer_s);
  c.heartbeat = absl::Seconds(heartbeat_s);
  if (drain_s < 0) flags.Fail("--drain-timeout must be >= 0");
  if (!(data_first_byte_s > 0)) flags.Fail("--data-first-byte-timeout must be positive");
  if (!(data_idle_s > 0)) flags.Fail("--data-idle-timeout must be positive");
  c.data_first_byte_timeout = absl::Seconds(data_first_byte_s);
  c.data_idle_timeout = absl::Seconds(data_idle_s);
  for (int64_t limit :
       {c.limits.max_pieces, c.limits.max_buffers, c.limits.max_tensors, c.limits.max_bytes}) {
    if (limit < 1)
      flags.Fail("--max-registration-pieces, -buffers, -tensors and -bytes must be positive");
  }
  for (int64_t limit :
       {c.group_limits.max_workers, c.group_limits.max_buffers, c.group_limits.max_tensors,
        c.group_limits.max_pieces, c.group_limits.max_bytes}) {
    if (limit < 1)
      flags.Fail("--max-group-workers, -buffers, -tensors, -pieces and -bytes must be positive");
  }
  if (join_s < 0) flags.Fail("--join-timeout must be >= 0");
  c.join_timeout = absl::Seconds(join_s);
  c.drain_timeout = absl::Seconds(drain_s);
  if (c.tls.cert.empty() != c.tls.key.empty() || c.tls.cert.empty() != c.tls.ca.empty()) {
    flags.Fail("--tls-cert, --tls-key and --tls-ca go together: give all three, or none");
  }
  for (const std::string* file : {&c.tls.cert, &c.tls.key, &c.tls.ca}) {
    if (!file->empty() && !ReadFile(*file).ok())
      flags.Fail(absl::StrCat("cannot read TLS file ", *file));
  }
  if (c.tls.enabled()) {
    // What every peer would refuse later, round after round, is refused now, by name.
    if (absl::Status s = CheckDaemonCertificate(c.tls, c.node); !s.ok())
      flags.Fail(std::string(s.message()));
  }
  if (reload_s <= 0) flags.Fail("--tls-reload-interval must be positive");
  c.tls.reload = absl::Seconds(reload_s);
  c.tls.operators = absl::StrSplit(operators, ',', absl::SkipEmpty());
  c.tls.viewers = absl::StrSplit(viewers, ',', absl::SkipEmpty());
  c.tls.workers = absl::StrSplit(tls_workers, ',', absl::SkipEmpty());
  if (!(attach_s > 0)) flags.Fail("--worker-attach-timeout must be positive");
  c.worker_attach_timeout = absl::Seconds(attach_s);
  for (absl::string_view part : absl::StrSplit(worker_uids, ',', absl::SkipEmpty())) {
    uint32_t uid = 0;
    if (!absl::SimpleAtoi(part, &uid))
      flags.Fail(absl::StrCat("--worker-uids: \"", part, "\" is not a uid"));
    c.worker_uids.push_back(uid);
  }
  if (!c.tls.enabled() && !c.insecure_listen) {
    for (const auto& [flag, address] : {std::pair<std::string, std::string>{"--listen", c.listen},
                                        {"--data-listen", c.data_listen},
                                        {"--worker-listen", c.worker_listen}}) {
      // (--metrics-listen is exempt: metrics say nothing of the weights and steer nothing.)
      if (!address.empty() && !IsLoopbackAddress(address)) {
        flags.Fail(
            absl::StrCat(flag, " ", address,
                         " is not a loopback address and no TLS is configured: give --tls-cert, "
                         "--tls-key and --tls-ca (docs/SECURITY.md), or --insecure-listen to "
                         "accept that anyone who reaches it can steer and read the weights"));
      }
    }
  }
  if (c.worker_socket.empty()) c.worker_socket = absl::StrCat("/tmp/refitd-", c.node, ".sock");
  c.state_file = state_file == unset ? c.worker_socket + ".state" : state_file;
  if (check_config) {
    std::printf("refitd: the configuration is valid: node %d, %s, listen %s, data %s, %s\n", c.node,
                c.is_coordinator() ? "coordinator" : ("coordinator at " + c.coordinator).c_str(),
                c.listen.c_str(), c.data_listen.c_str(),
                c.tls.enabled() ? ("TLS: certificate " + c.tls.cert + ", CA " + c.tls.ca).c_str()
                : c.insecure_listen
                    ? "no TLS, and --insecure-listen: anyone who reaches it can steer"
                    : "no TLS (loopback only)");
    std::exit(0);
  }
  return c;
}

}  // namespace refit
