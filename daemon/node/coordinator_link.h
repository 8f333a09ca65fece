// A non-coordinator daemon's link to its coordinator: join (retried until the coordinator
// answers), a heartbeat every `--heartbeat` (the whole worker list again when the coordinator
// asks: it restarted, or declared this node dead; it asks in every answer until a list
// arrives, so a lost or late answer costs a heartbeat, not the node's workers), ordered worker
// syncs (one that failed is sent again, with a back-off, on a thread of its own so that
// heartbeats never wait for a large list), and the forwarding of operator calls. Its
// channels reconnect within a second (back-off 100 ms to 1 s), and a heartbeat waits for the
// connection (within --peer-timeout), so a restarted coordinator is joined again at its next
// heartbeat.
//
// Where the coordinator is: a gRPC target ("10.0.0.1:7070", or "dns:///refit-coordinator:7070",
// which gRPC resolves again when the connection fails: a restarted pod behind a Kubernetes
// Service), or "file:PATH": the target written in PATH, read again whenever a heartbeat fails,
// so that a coordinator restarted at a new address is joined once the file names it (within a
// heartbeat or two of the rewrite).
//
// Syncs are numbered (SyncWorkersRequest.sequence), and each carries how many answers asked this
// node to resync (resyncs_seen, also in every heartbeat): the coordinator ignores a list older
// than one it applied, and refuses one taken before the node heard that it was admitted again
// (declared dead, then revived), whatever order the network delivers them in.
//
// A registration or a worker leaving sends only that change (`delta`), onto the list of the last
// sync that succeeded: registering n workers costs the coordinator their sizes, not n^2/2 of them.
// A resync is an empty change first: a coordinator that declared this node dead kept its list
// aside and takes it back. When the coordinator holds another list (it restarted, or a sync failed
// here but was applied there), it refuses the change (ABORTED) and the whole list follows in the
// same call. Syncs travel on a connection of their own, and a sync's deadline grows with its
// size: --peer-timeout plus one second per kSyncBytesPerSecond.
//
// Locks: `mu_` guards the stop flag, the stubs, whether a sync is owed and the resyncs seen.
// `sync_order_` orders syncs, each numbered, taken and sent under it, so that the outcome of the
// last sync is what the coordinator holds (`sync_owed_` and the base of a change stay exact). It is
// the one lock held across an RPC (bounded by the sync's deadline).
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/base/grpc_status.h"
#include "daemon/security/authority.h"
#include "daemon/security/grpc_caller.h"
#include "proto/refit.grpc.pb.h"

namespace refit {

struct CoordinatorLinkOptions {
  std::string coordinator;  // its target, or "file:PATH" (above)
  int32_t node = 0;
  int64_t incarnation = 0;
  absl::Duration heartbeat = absl::Milliseconds(500);
  absl::Duration peer_timeout = absl::Seconds(5);
  int64_t max_rpc_bytes = 256 << 20;
  // Join waits this long for the coordinator at most; zero: until it answers, or Stop().
  absl::Duration join_timeout = absl::ZeroDuration();
  // This node's workers as the coordinator must know them.
  std::function<std::vector<v1::RegisterWorkerRequest>()> snapshot;
  // A heartbeat was answered (called with no lock held, before a resync's SyncWorkers).
  // `resync`: the coordinator does not know this node's incarnation (it restarted, or declared
  // this node dead), so no round of its is open here any more; else the rounds it still runs
  // (`running_rounds`) have their leases renewed.
  std::function<void(const v1::JoinResponse& answer)> on_answer;
  // Workers the coordinator refused in a list the link sent of its own accord (a resync after a
  // rejoin: e.g. a tensor declared otherwise, or the name taken, on another node meanwhile).
  // Called with no lock held; the daemon drops them, as it would have refused them at
  // registration, rather than keep workers registered here that their group does not count.
  std::function<void(const std::vector<v1::WorkerRefusal>& refused)> on_refused;
  // Channel credentials (TLS or not); null: insecure. Outlives the link.
  const GrpcTls* tls = nullptr;
  // The coordinator's node index (--coordinator-node); -1: whichever node answers, as long as its
  // certificate is the node it says it is.
  int32_t coordinator_node = -1;
};

class CoordinatorLink {
 public:
  static constexpr absl::Duration kFirstSyncRetry = absl::Milliseconds(100);
  static constexpr absl::Duration kLastSyncRetry = absl::Seconds(5);
  // The slowest a sync's bytes are expected to be sent and applied (a coordinator on a busy core
  // applies about 25 MB/s of pieces): beyond --peer-timeout, its deadline grows by a second for
  // each of these.
  static constexpr double kSyncBytesPerSecond = 8e6;

  explicit CoordinatorLink(CoordinatorLinkOptions options);
  ~CoordinatorLink();  // Stop()

  // Joins (waiting for the coordinator: join_timeout), then heartbeats until Stop().
  absl::Status Join(const std::string& control_address, const std::string& data_address);
  // Sends this node's whole worker list; `refused` (may be null) gets the workers the coordinator
  // did not admit (their name is held on another node). When it fails, the sync thread sends
  // the list again (back-off kFirstSyncRetry to kLastSyncRetry) until a sync succeeds.
  absl::Status Sync(std::vector<v1::WorkerRefusal>* refused = nullptr);
  // A worker registered here (its encoding, LocalWorker::Encoded): sent as a change, or as the
  // whole list when no base is known. `refused` as for Sync. Taken by value and moved into the
  // request: a copy would add the registration's size to the node's peak while it is sent.
  absl::Status SyncAdded(v1::RegisterWorkerRequest added,
                         std::vector<v1::WorkerRefusal>* refused = nullptr);
  // The worker `id` ("group/worker") left this node: as SyncAdded.
  absl::Status SyncRemoved(const std::string& id);
  // A sync's deadline: --peer-timeout, and a second per kSyncBytesPerSecond of its size.
  absl::Duration SyncTimeout(int64_t bytes) const;
  void Stop();
  // The coordinator as its last answer to Join named it (node -1 before the first). With TLS an
  // answer counts only from a certificate of the node it names.
  KnownCoordinator Coordinator();

  // Forwards a unary operator call to the coordinator within `timeout`.
  template <typename Request, typename Response, typename Method>
  absl::Status Forward(Method method, const Request& request, Response* response,
                       absl::Duration timeout) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout));
    std::shared_ptr<v1::RefitControl::Stub> stub = Control();
    return FromGrpc((stub.get()->*method)(&ctx, request, response));
  }
  // Relays the coordinator's WatchRounds stream until `write` fails or `cancelled()`; calls
  // `opened` once the coordinator said its stream is open (common/watch_protocol.h).
  // Its status: the coordinator's, when the coordinator ended the stream (e.g. refused it).
  absl::Status ForwardWatch(const v1::WatchRoundsRequest& request,
                            const std::function<bool()>& cancelled,
                            const std::function<bool(const v1::RoundStats&)>& write,
                            const std::function<void()>& opened);

 private:
  void HeartbeatLoop();
  void SyncLoop();  // sends the whole list when owed
  // A request numbered next, with the resyncs this node has acted on.
  v1::SyncWorkersRequest NumberedRequest() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sync_order_);
  // Sends `sync` and records its outcome (unless a change refused for its base: ABORTED).
  absl::Status Send(const v1::SyncWorkersRequest& sync, std::vector<v1::WorkerRefusal>* refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sync_order_);
  absl::Status SyncAllLocked(std::vector<v1::WorkerRefusal>* refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(sync_order_);
  // `added` (may be null; left empty, its contents moved or dropped before a whole list is taken)
  // and `removed` (may be empty) as a change when the coordinator's list is known to be that of
  // the last sync, else the whole list.
  absl::Status SyncChange(v1::RegisterWorkerRequest* added, const std::string& removed,
                          std::vector<v1::WorkerRefusal>* refused);
  // One heartbeat: the answer, or nullopt when unanswered (`lost` tracks the outage, logged
  // once).
  std::optional<v1::JoinResponse> Heartbeat(bool* lost);
  // The join or heartbeat to send now: join_ with the resyncs seen so far.
  v1::JoinRequest JoinRequestNow();
  // Records who answered a Join; an answer whose certificate is not the node it names is refused.
  absl::Status Answered(const grpc::ClientContext& ctx, const v1::JoinResponse& out);
  // The stubs of the current target; shared: a refresh may replace them while a call uses them.
  std::shared_ptr<grpc::Channel> NewChannel(bool own_connection) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<v1::RefitPeer::Stub> Peer();
  std::shared_ptr<v1::RefitPeer::Stub> SyncPeer();  // on a connection of its own
  std::shared_ptr<v1::RefitControl::Stub> Control();
  // "file:PATH": reads PATH again; a new target replaces the channels. No-op otherwise.
  void Refresh();
  std::string Target();

  const CoordinatorLinkOptions options_;
  v1::JoinRequest join_;  // set by Join, before the heartbeat thread starts
  std::thread heartbeat_;
  std::thread syncer_;
  absl::Mutex sync_order_;
  int64_t last_sequence_ ABSL_GUARDED_BY(sync_order_) = 0;
  // The last sync that succeeded (0: none, or a later one failed): the list the coordinator holds,
  // the base of a change.
  int64_t acked_sequence_ ABSL_GUARDED_BY(sync_order_) = 0;
  // Departures in changes the coordinator refused, unapplied, while this node was not joined: sent
  // with the next change onto acked_sequence_ (a whole list has them gone). At most one per worker.
  std::vector<std::string> unsent_removals_ ABSL_GUARDED_BY(sync_order_);

  absl::Mutex mu_;
  absl::CondVar stop_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The coordinator may lack this node's current worker list: the last sync failed, or an
  // answer asked for it (resync). Cleared by a sync that succeeds.
  bool sync_owed_ ABSL_GUARDED_BY(mu_) = false;
  // Answers that said `resync`, counted before anything acts on them (JoinRequest.resyncs_seen),
  // and those acted on (on_answer returned): a list carries the latter.
  int64_t resyncs_seen_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t resyncs_handled_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t answers_ ABSL_GUARDED_BY(mu_) = 0;  // heartbeats answered
  // An owed sync waits until this many heartbeats were answered (the one after its failure).
  int64_t sync_after_answers_ ABSL_GUARDED_BY(mu_) = 0;
  absl::CondVar sync_wake_;                  // a sync is owed, or stopping
  std::string target_ ABSL_GUARDED_BY(mu_);  // the coordinator's gRPC target now
  std::shared_ptr<v1::RefitPeer::Stub> peer_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<v1::RefitPeer::Stub> sync_peer_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<v1::RefitControl::Stub> control_ ABSL_GUARDED_BY(mu_);
  KnownCoordinator coordinator_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
