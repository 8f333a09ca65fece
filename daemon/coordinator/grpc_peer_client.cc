#include "daemon/coordinator/grpc_peer_client.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/base/culprit.h"
#include "daemon/base/grpc_status.h"
#include "daemon/base/log_later.h"
#include "daemon/base/logging.h"
#include "daemon/base/round_protocol.h"

namespace refit {

struct GrpcPeerClient::Call {
  int32_t node = 0;
  grpc::ClientContext context;
  v1::PhaseRequest phase;
  std::shared_ptr<const v1::InstallPlanRequest> install;
  v1::InstallPlanResponse install_out;
};

namespace {

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoNanoseconds(d);
}

}  // namespace

GrpcPeerClient::GrpcPeerClient(GrpcPeerClientOptions options)
    : options_(std::move(options)), local_(options_.local_threads) {}

GrpcPeerClient::~GrpcPeerClient() {
  local_.Stop();
  absl::MutexLock lock(&mu_);
  for (auto& [node, call] : in_flight_) call->context.TryCancel();
  // Cancelled calls finish promptly; every call has a deadline besides.
  while (!in_flight_.empty()) idle_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
}

v1::RefitPeer::Stub* GrpcPeerClient::Stub(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto& stub = stubs_[address];
  if (!stub) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(static_cast<int>(options_.max_rpc_bytes));
    args.SetMaxSendMessageSize(static_cast<int>(options_.max_rpc_bytes));
    // A node restarted on its address is reached again within a second: with gRPC's default
    // back-off (up to 120 s) rounds failed for seconds with "failed to connect to all addresses".
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    stub = v1::RefitPeer::NewStub(
        options_.tls != nullptr
            ? options_.tls->Channel(address, args)
            : grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  return stub.get();
}

GrpcPeerClient::Call* GrpcPeerClient::Begin(int32_t node, absl::Duration deadline,
                                            bool wait_for_ready) {
  auto* call = new Call;
  call->node = node;
  call->context.set_deadline(Deadline(deadline));
  call->context.set_wait_for_ready(wait_for_ready);
  call->context.AddMetadata(kCoordinatorIncarnationKey, absl::StrCat(options_.incarnation));
  absl::MutexLock lock(&mu_);
  in_flight_.emplace(node, call);
  return call;
}

void GrpcPeerClient::End(Call* call) {
  {
    absl::MutexLock lock(&mu_);
    for (auto [it, end] = in_flight_.equal_range(call->node); it != end; ++it) {
      if (it->second == call) {
        in_flight_.erase(it);
        break;
      }
    }
    if (in_flight_.empty()) idle_.SignalAll();
  }
  delete call;
}

void GrpcPeerClient::CancelNode(int32_t node) {
  absl::MutexLock lock(&mu_);
  for (auto [call, end] = in_flight_.equal_range(node); call != end; ++call)
    call->second->context.TryCancel();
}

void GrpcPeerClient::RunPhase(int32_t node, const v1::PhaseRequest& request, absl::Duration timeout,
                              v1::PhaseResponse* response, Done done) {
  if (node == options_.self) {
    // ABORT returns at once (it cancels and queues events); it must not queue behind the phases
    // it ends.
    if (request.phase() == v1::PhaseRequest::ABORT) {
      done(options_.local_phase(request, response));
      return;
    }
    // TRANSFER on the caller's thread: the round driver calls its own node last, after every
    // peer's call went out, and waits for them all anyway. The two thread hand-offs (to the
    // executor and back) took 0.08-0.13 ms of a colocated refit's transfer phase on a GPU
    // machine's VM, 0.02 ms without them (docs/BENCHMARKS.md). The phase is bounded by
    // its own deadline, and an ABORT (run at once, above) cancels it from another thread.
    if (request.phase() == v1::PhaseRequest::TRANSFER) {
      done(WithCulpritIfNone(options_.local_phase(request, response),
                             NodeCulprit(options_.self, "", PhaseName(request.phase()))));
      return;
    }
    auto run = [this, request, response, done] {
      // This node's own failure: blamed on it unless it names a culprit (a worker of its).
      done(WithCulpritIfNone(options_.local_phase(request, response),
                             NodeCulprit(options_.self, "", PhaseName(request.phase()))));
    };
    if (!local_.Submit(run)) done(absl::UnavailableError("daemon shutting down"));
    return;
  }
  auto address = options_.address(node);
  if (!address.ok()) {
    done(WithCulprit(address.status(), NodeCulprit(node, "", PhaseName(request.phase()))));
    return;
  }
  v1::RefitPeer::Stub* stub = Stub(*address);
  Call* call = Begin(node, timeout + options_.peer_timeout, /*wait_for_ready=*/false);
  call->phase = request;
  if (request.phase() == v1::PhaseRequest::TRANSFER) {  // to compare with the peer's arrival time
    // Written later, in UTC like the peer's "request arrived at" (the round waits on this call:
    // the local zone took 16 us, writing the line more).
    LogLater("round", spdlog::level::info, "group \"{}\" round {}: TRANSFER sent to node {} at {}",
             request.group(), request.round_id(), node, UtcTimeOfDay(absl::Now()));
  }
  stub->async()->RunPhase(
      &call->context, &call->phase, response,
      [this, call, node, address = *address, done](grpc::Status status) {
        absl::Status s = FromGrpc(status);
        // The answer counts only from node `node`'s own certificate.
        if (s.ok() && options_.tls != nullptr)
          s = CheckServerNode(*options_.tls, call->context, node);
        const v1::PhaseRequest::Phase phase = call->phase.phase();
        if (!s.ok()) {
          const v1::Culprit blamed = NodeCulprit(node, address, PhaseName(phase));
          if (auto why = options_.death_reason(node); why.has_value()) {
            // Died: the node is the culprit, whatever its call said.
            s = WithCulprit(
                absl::UnavailableError(absl::StrCat("node ", node, " (", address, ") died during ",
                                                    PhaseName(phase), ": ", *why)),
                blamed);
          } else {
            // The node's own failure may name a culprit of its (a worker): kept.
            if (!absl::StartsWith(s.message(), absl::StrCat("node ", node))) {  // wording only
              s = Rewrap(s, s.code(),
                         absl::StrCat("node ", node, " (", address, ") failed ", PhaseName(phase),
                                      ": ", s.message()));
            }
            s = WithCulpritIfNone(std::move(s), blamed);
          }
        }
        done(s);
        End(call);  // after `done`: the destructor waits for it
      });
}

void GrpcPeerClient::InstallPlan(int32_t node,
                                 std::shared_ptr<const v1::InstallPlanRequest> request,
                                 absl::Duration timeout, Done done) {
  if (node == options_.self) {
    auto run = [this, request, done] { done(options_.local_install(*request)); };
    if (!local_.Submit(run)) done(absl::UnavailableError("daemon shutting down"));
    return;
  }
  auto address = options_.address(node);
  if (!address.ok()) {
    done(address.status());
    return;
  }
  v1::RefitPeer::Stub* stub = Stub(*address);
  // A round's first call to a node: one that just (re)joined may have its channel between
  // connection attempts; the call waits for the connection within its deadline instead of
  // failing at once. A node that is gone is declared dead by its heartbeats, which cancels the
  // call (CancelNode). Phases fail fast: an ABORT must not wait for a dead node.
  Call* call = Begin(node, timeout, /*wait_for_ready=*/true);
  call->install = std::move(request);
  stub->async()->InstallPlan(
      &call->context, call->install.get(), &call->install_out,
      [this, call, node, address = *address, done](grpc::Status status) {
        absl::Status s = FromGrpc(status);
        if (s.ok() && options_.tls != nullptr) {
          s = CheckServerNode(*options_.tls, call->context, node);
        }
        if (!s.ok()) {
          s = WithCulpritIfNone(Rewrap(s, s.code(),
                                       absl::StrCat("node ", node, " (", address,
                                                    ") could not install the plan: ", s.message())),
                                NodeCulprit(node, address, "INSTALL"));
        }
        done(s);
        End(call);
      });
}

}  // namespace refit
