// refitd's configuration: one struct with documented defaults, from flags and an optional JSON
// config file whose keys are the flags' names (flags given on the command line win).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/tls_config.h"
#include "daemon/worker/registration_limits.h"

namespace refit {

struct DaemonConfig {
  int32_t node = 0;                    // this node's index in the cluster (--node)
  std::string listen = "127.0.0.1:0";  // gRPC for peers and operators (--listen)
  std::string worker_socket;           // Unix socket for local workers (--worker-socket);
                                       // default /tmp/refitd-<node>.sock
  std::string coordinator;             // the coordinator's --listen address; empty: this is it
  int32_t coordinator_node = -1;  // --coordinator-node: the coordinator's index, pinned (-1: any)
  std::string data_listen = "127.0.0.1:0";  // host data plane (--data-listen)
  // Host data plane: a new connection's first frame must begin within this
  // (--data-first-byte-timeout), and a connection idle between frames longer is closed
  // (--data-idle-timeout): idle connections cannot hold the node's places (host_backend.h).
  absl::Duration data_first_byte_timeout = absl::Seconds(10);
  absl::Duration data_idle_timeout = absl::Seconds(120);
  std::string backend = "host";          // host | cuda (--backend)
  std::vector<int32_t> gpus;             // local GPU indices this daemon serves (--gpus 0,1);
                                         // empty: any. A worker on another GPU is refused.
  int64_t max_message_bytes = 16 << 20;  // staging chunk per connection (--max-message-bytes)
  bool routing = true;  // coordinator: topology routing in plans (--norouting: off)
  // Coordinator: relays between destination nodes. Off by default: both data planes run a plan
  // stage by stage, so a relay stage adds its whole time (predicted 1.4-2x slower at frontier
  // scale, docs/BENCHMARKS.md) while saving no network bytes there.
  int32_t max_relay_depth = 0;
  int64_t staging_bytes = int64_t{256} << 20;  // cuda: staging per GPU per group (--staging-bytes)
  // Coordinator, cuda (--zero-copy-min-bytes): NCCL moves 1-4 MiB operations at 80-200 GB/s against
  // 355 GB/s from 64 MiB (2 x H200), so smaller descriptors are packed (docs/BENCHMARKS.md).
  int64_t zero_copy_min_bytes = int64_t{16} << 20;
  // Coordinator, cuda: staging registered with NCCL (--nccl-register), shipped with the plan.
  bool nccl_register = false;
  // cuda: NCCL's stream at the GPU's highest priority (--nccl-stream-priority); local to a daemon.
  bool nccl_stream_priority = false;
  // cuda: the aligned copy kernel for aligned work (--aligned-copy-kernel); local to a daemon.
  bool aligned_copy_kernel = true;
  // cuda: arm rounds copied within the node (--arm-rounds): "never", "auto" (when MPS shares the
  // GPUs) or "always"; local to a daemon.
  std::string arm_rounds = "auto";
  absl::Duration prepare_timeout = absl::Seconds(10);
  absl::Duration transfer_timeout = absl::Seconds(60);
  absl::Duration commit_timeout = absl::Seconds(10);
  absl::Duration peer_timeout = absl::Seconds(5);  // one control RPC between daemons
  // gRPC servers (--rpc-keepalive): a connection quiet this long is pinged and closed unless the
  // ping is answered within as long again. gRPC gives connections it is handed (the worker
  // socket's) no handshake deadline: one that sent a byte and went silent would be held for good.
  // Not below ~8 s: an idle gRPC C-core client answers pings only when its backup poller runs
  // (every 5 s), so a shorter one closes idle callers' connections.
  absl::Duration rpc_keepalive = absl::Seconds(30);
  absl::Duration heartbeat = absl::Milliseconds(500);
  int heartbeats_missed = 4;  // a peer silent this many heartbeats is dead
  int64_t max_nodes = 4096;   // coordinator: most nodes listed, itself included
  int fanout_threads = 0;     // coordinator: threads starting a phase's calls (0: from the cores)
  absl::Duration forget_dead_after =
      absl::Minutes(1);               // coordinator: a dead node is listed this long
  int64_t max_rpc_bytes = 256 << 20;  // largest gRPC message accepted (--max-rpc-bytes)
  std::string log_level = "info";
  std::string log_format = "text";                   // or "json"
  absl::Duration drain_timeout = absl::Seconds(20);  // SIGTERM: how long running rounds may finish
  absl::Duration join_timeout =
      absl::ZeroDuration();    // waiting for the coordinator at start; 0: forever
  RegistrationLimits limits;   // --max-registration-pieces, -buffers, -tensors, -bytes
  GroupLimits group_limits;    // coordinator: --max-group-workers, -pieces, -bytes
  std::string address_file;    // write "<listen> <worker socket>" here once serving
  std::string metrics_listen;  // host:port serving Prometheus' /metrics; empty: none
  // Coordinator: round ids and committed versions kept across restarts (--state-file); the flag's
  // default is "<worker socket>.state"; empty: in memory only (a restart forgets them).
  std::string state_file;

  // Transport security (docs/SECURITY.md). Without it every listener must be loopback, unless
  // --insecure-listen says otherwise (logged as a warning at start).
  TlsConfig tls;
  bool insecure_listen = false;
  // Workers: the uids whose processes may register (--worker-uids; empty: this daemon's own uid
  // and root), read from the registering process' handle-socket credentials (SO_PEERCRED).
  std::vector<uint32_t> worker_uids;
  // A registration whose session has not attached this long after Register is dropped as a
  // worker that left (--worker-attach-timeout): its name, mappings and place in the group are
  // freed.
  absl::Duration worker_attach_timeout = absl::Seconds(10);
  // The worker service over TCP as well as the unix socket (--worker-listen; empty: unix only).
  // Only for workers in another network namespace; they are then identified by token alone.
  std::string worker_listen;
  // Plaintext gRPC health only (--health-listen; empty: none): for probes that present no
  // certificate (Kubernetes' grpc probes). The health service also answers on --listen.
  std::string health_listen;

  bool is_coordinator() const { return coordinator.empty(); }
};

// "127.0.0.1:7070", "[::1]:0", "localhost:1": reachable from this host only.
bool IsLoopbackAddress(const std::string& address);

// What refitd's command line asks for.
struct DaemonInvocation {
  enum class Action { kRun, kPrintHelp, kCheckConfig };
  Action action = Action::kRun;
  DaemonConfig config;  // checked, for kRun and kCheckConfig
};

// Parses argv: --config FILE's values first, the command line's over them, in order up to --help;
// then checks the configuration as refitd would at start (TLS files and certificate, listeners).
// An error names the flag, or the file and key, at fault: INVALID_ARGUMENT, or ReadFile's error
// for a config file that cannot be read. The flags are absl
// flags, which are process-wide: one parse at a time.
absl::StatusOr<DaemonInvocation> ParseDaemonFlags(int argc, const char* const* argv);

// --help's text: the usage line and every flag with its help text and default.
std::string DaemonFlagsHelp();

// --check-config's line: what would run.
std::string DescribeConfig(const DaemonConfig& config);

// Settings that are valid but known to misbehave, one sentence each naming the flag: logged as
// warnings at start and printed by --check-config. Empty for the defaults.
std::vector<std::string> ConfigWarnings(const DaemonConfig& config);

}  // namespace refit
