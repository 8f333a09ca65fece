// refitd's Prometheus metrics (daemon/README.md, "Metrics"): one job, owning the registry and,
// with --metrics-listen, the exposer that serves it as /metrics (prometheus-cpp's civetweb-based
// pull library). The rest of the daemon holds a Metrics* and calls its typed handles; nothing
// here calls back into another component except the scrape-time callback (SetClusterView),
// which runs on the exposer's thread with no lock of this component held.
//
// Fed with as little coupling as possible:
//   rounds          RoundEnded(), a RoundLog listener (the coordinator's)
//   transfers       TransferEnded(), from a DataBackend wrapper (daemon/ops/metered_backend.h)
//   nodes declared dead, RPC errors by code: NodesDeclaredDead() (the failure detector),
//                   RpcError() (an observer of grpc_status.h's ToGrpc)
//   groups, workers, plans: read at scrape time through SetClusterView's callback
//
// Thread safety: every handle may be called from any thread at once (prometheus-cpp's metrics
// are atomic; its families lock themselves). The cluster collector's own mutex guards only its
// callback, and is not held while the callback runs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/dataplane/backend.h"
#include "proto/refit.pb.h"

namespace prometheus {
class Counter;
class Exposer;
class Gauge;
class Histogram;
class Registry;
template <typename T>
class Family;
}  // namespace prometheus

namespace refit {

// One model group as the coordinator sees it at scrape time.
struct GroupView {
  std::string name;
  int trainers = 0, inference = 0;  // live workers by role
  bool ready = false;               // its current epoch has a plan
  int64_t membership_epoch = 0;
  int64_t plan_epoch = -1;                              // the epoch its current plan was made for
  absl::Duration planning_time = absl::ZeroDuration();  // of that plan
};

struct ClusterView {
  bool coordinator = false;  // groups, plannings and membership events are the coordinator's
  std::vector<GroupView> groups;
  int64_t plannings = 0;  // plannings run since start (one per group and epoch)
  // Membership events since start: worker lists refused as stale, changes to a list other than
  // the one held, nodes forgotten, Joins refused over --max-nodes.
  int64_t stale_syncs = 0, rebased_syncs = 0, forgotten_nodes = 0, refused_joins = 0;
  int64_t synced_bytes = 0;  // worker registrations received in nodes' syncs
  // This node's data connections: event -> count since start (DataBackend::ConnectionEvents).
  std::vector<std::pair<std::string, int64_t>> data_connections;
};

class Metrics {
 public:
  // `listen`: host:port for /metrics (port 0: any free one); empty: no exposer (the registry is
  // still fed and Scrape() reads it). An address that cannot be bound is UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<Metrics>> Start(const std::string& listen);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Where /metrics is served ("host:port"); empty without an exposer.
  const std::string& address() const { return address_; }
  // The text exposition, exactly as /metrics serves it (tests).
  std::string Scrape() const;
  // Stops serving and forgets the cluster view's callback: after it returns, the callback is
  // never called again. Idempotent; the destructor calls it.
  void Stop();

  // A round's state change as the RoundLog publishes it; only COMMITTED and ABORTED count.
  void RoundEnded(const v1::RoundStats& stats);
  // This node's part of a round through the backend: data-plane time and what it moved.
  struct Transfer {
    std::string group;
    bool ok = false;
    absl::Duration elapsed;
    int64_t bytes_sent = 0, bytes_received = 0, bytes_local = 0;
    int64_t bytes_nvlink = 0;  // of bytes_received: from another GPU of this node
  };
  void TransferEnded(const Transfer& transfer);
  // The backend's NCCL communicator counts since start: counted by what grew since the last call.
  void Communicators(const DataBackend::CommunicatorCounts& counts);
  // The failure detector declared `n` nodes dead (no heartbeat within the verdict).
  void NodesDeclaredDead(int n);
  // A failure converted to a gRPC status (OK is not counted).
  void RpcError(absl::StatusCode code);
  // Read at every scrape (on the exposer's thread, no lock of this component held).
  void SetClusterView(std::function<ClusterView()> view);

 private:
  Metrics();
  class ClusterCollector;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<ClusterCollector> cluster_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string address_;
  int observer_ = -1;  // grpc_status.h's RpcErrorObserver

  prometheus::Family<prometheus::Counter>* rounds_;
  prometheus::Family<prometheus::Histogram>* round_seconds_;
  prometheus::Family<prometheus::Histogram>* phase_seconds_;
  prometheus::Family<prometheus::Counter>* round_bytes_;
  prometheus::Family<prometheus::Counter>* transfers_;
  prometheus::Family<prometheus::Histogram>* transfer_seconds_;
  prometheus::Family<prometheus::Gauge>* wire_rate_;
  prometheus::Family<prometheus::Counter>* transfer_bytes_;
  prometheus::Counter* nodes_dead_;
  prometheus::Family<prometheus::Counter>* rpc_errors_;
  prometheus::Family<prometheus::Counter>* communicators_;
  absl::Mutex counts_mu_;
  DataBackend::CommunicatorCounts counted_
      ABSL_GUARDED_BY(counts_mu_);  // already in communicators_
};

// Histogram buckets for durations from 1 ms to 120 s (seconds).
const std::vector<double>& DurationBuckets();

}  // namespace refit
