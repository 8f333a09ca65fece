#include "daemon/services.h"

#include "absl/strings/str_cat.h"
#include "common/version.h"
#include "common/watch_protocol.h"
#include "daemon/base/executor.h"
#include "daemon/base/grpc_raw.h"
#include "daemon/base/grpc_status.h"
#include "daemon/coordinator/group_planner.h"
#include "daemon/coordinator/membership.h"
#include "daemon/coordinator/round_driver.h"
#include "daemon/coordinator/round_log.h"
#include "daemon/node/coordinator_link.h"
#include "daemon/node/node_agent.h"
#include "daemon/node/watch_hub.h"
#include "daemon/security/grpc_caller.h"
#include "daemon/worker/encoded_registration.h"
#include "daemon/worker/registration_decoder.h"
#include "daemon/worker/registration_limits.h"
#include "daemon/worker/worker_registry.h"
#include "daemon/worker/worker_session.h"
#include "plan/status_macros.h"
#include "proto/layout_codec.h"

namespace refit {
namespace {

// On the callback API (the Session reactor needs it, and one service is either sync or
// callback), doing what it did on the sync API. What may block (registering and dropping a
// worker wait on the coordinator, a sync RPC bounded by peer_timeout, on nodes that are not the
// coordinator) runs on a small executor of its own, never on gRPC's callback threads, which
// every session's reads and writes need: a coordinator that is gone must not stall the ABORTs.
// Register and Unregister take their request as bytes: a registration is checked on its encoding
// before it is decoded (daemon/worker/encoded_registration.h), and a request that cannot be
// decoded is refused naming why.
using WorkerServiceBase =
    v1::RefitWorker::WithRawCallbackMethod_Register<v1::RefitWorker::WithCallbackMethod_Session<
        v1::RefitWorker::WithRawCallbackMethod_Unregister<v1::RefitWorker::Service>>>;

class WorkerService : public WorkerServiceBase {
 public:
  explicit WorkerService(const ServiceParts* p)
      : p_(p), sessions_(p->registry, [this](const std::string& id, const std::string& reason) {
          // Dropped inline only once the service is going (the executor stopped).
          if (!blocking_.Submit([this, id, reason] { p_->drop_worker(id, reason); }))
            p_->drop_worker(id, reason);
        }) {}
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* c,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override {
    grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
    // "unix:..." or, with --worker-listen, "ipv4:..."/"ipv6:...": only the unix socket's
    // registrations are uid-checked (worker_admission.h).
    const WorkerTransport transport = TransportOfPeer(c->peer());
    if (auto s = p_->authority->CheckWorker(CallerOf(*c)); !s.ok()) {
      reactor->Finish(ToGrpc(s));
      return reactor;
    }
    // `request` and `response` live until Finish. Checked and decoded off gRPC's threads: the
    // registry reads the worker's pieces from its encoding one at a time (registration_decoder.h).
    if (!blocking_.Submit([this, reactor, request, response, transport] {
          absl::StatusOr<v1::RegisterWorkerRequest> r =
              DecodeRegistrationRequest(TakeRequestBytes(request), p_->config->limits);
          v1::RegisterWorkerResponse out;
          absl::Status s = r.ok() ? p_->register_worker(*r, transport, &out) : r.status();
          if (s.ok()) s = SetResponse(out, response);
          reactor->Finish(ToGrpc(s));
        })) {
      reactor->Finish(ToGrpc(absl::UnavailableError("the daemon is shutting down")));
    }
    return reactor;
  }
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::RoundEvent>* Session(
      grpc::CallbackServerContext* c) override {
    return sessions_.Start(c);
  }
  grpc::ServerUnaryReactor* Unregister(grpc::CallbackServerContext* c,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override {
    grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
    v1::UnregisterWorkerRequest r;
    if (auto s = ParseRequest("unregister", TakeRequestBytes(request), &r); !s.ok()) {
      reactor->Finish(ToGrpc(s));
      return reactor;
    }
    // Only its registration may unregister a worker (NOT_FOUND, PERMISSION_DENIED: it stays).
    if (auto s = p_->registry->CheckKey(r.worker_id(), r.session_key()); !s.ok()) {
      reactor->Finish(ToGrpc(s));
      return reactor;
    }
    if (!blocking_.Submit([this, reactor, response, id = r.worker_id()] {
          p_->drop_worker(id, "unregistered");
          reactor->Finish(ToGrpc(SetResponse(v1::UnregisterWorkerResponse(), response)));
        })) {
      reactor->Finish(ToGrpc(absl::UnavailableError("the daemon is shutting down")));
    }
    return reactor;
  }

 private:
  const ServiceParts* const p_;
  // Declared before sessions_: stopped (running what is queued: drops of lost workers) after the
  // sessions are all done. Both go after the server, before the registry.
  Executor blocking_{4};
  WorkerSessions sessions_;
};

class ControlService : public v1::RefitControl::Service {
 public:
  explicit ControlService(const ServiceParts* p) : p_(p) {}

  grpc::Status Refit(grpc::ServerContext* context, const v1::RefitRequest* r,
                     v1::RoundStats* out) override {
    if (auto s = Check(context, Access::kOperate, "Refit"); !s.ok()) return s;
    if (p_->link != nullptr) {
      const DaemonConfig& c = *p_->config;
      const absl::Duration round_timeout =
          c.prepare_timeout + c.transfer_timeout + c.commit_timeout + c.peer_timeout * 6;
      return ToGrpc(p_->link->Forward(&v1::RefitControl::Stub::Refit, *r, out, round_timeout));
    }
    return ToGrpc(p_->driver->Refit(*r, out));
  }
  grpc::Status StartRefit(grpc::ServerContext* c, const v1::RefitRequest* r,
                          v1::StartRefitResponse* out) override {
    if (auto s = Check(c, Access::kOperate, "StartRefit"); !s.ok()) return s;
    if (p_->link != nullptr) {
      return ToGrpc(p_->link->Forward(&v1::RefitControl::Stub::StartRefit, *r, out,
                                      p_->config->peer_timeout));
    }
    auto id = p_->driver->StartRefit(*r);
    if (!id.ok()) return ToGrpc(id.status());
    out->set_round_id(*id);
    return grpc::Status::OK;
  }
  grpc::Status WatchRounds(grpc::ServerContext* c, const v1::WatchRoundsRequest* r,
                           grpc::ServerWriter<v1::RoundStats>* w) override {
    if (auto s = Check(c, Access::kView, "WatchRounds"); !s.ok()) return s;
    // Held until the stream ends.
    absl::StatusOr<WatchSlots::Slot> slot = p_->watch_slots.Acquire(WatchCallerOf(CallerOf(*c)));
    if (!slot.ok()) return ToGrpc(slot.status());
    auto cancelled = [c] { return c->IsCancelled(); };
    auto write = [w](const v1::RoundStats& s) { return w->Write(s); };
    auto opened = [c, w] {
      c->AddInitialMetadata(kWatchOpenKey, kWatchOpenValue);
      w->SendInitialMetadata();
    };
    if (p_->watch_hub != nullptr)
      return ToGrpc(p_->watch_hub->Watch(r->group(), cancelled, write, opened));
    p_->log->Watch(r->group(), cancelled, write, opened);
    return grpc::Status::OK;
  }
  grpc::Status Status(grpc::ServerContext* c, const v1::StatusRequest* r,
                      v1::StatusResponse* out) override {
    if (auto s = Check(c, Access::kView, "Status"); !s.ok()) return s;
    if (p_->link != nullptr) {
      return ToGrpc(
          p_->link->Forward(&v1::RefitControl::Stub::Status, *r, out, p_->config->peer_timeout));
    }
    out->set_coordinator(p_->address);
    out->set_version(kRefitVersion);
    p_->membership->NodeStatuses(out);
    for (const std::string& name : p_->membership->GroupNames()) {
      // Cached per membership epoch; planned outside any lock when the membership changed.
      const std::shared_ptr<const GroupPlan> plan = p_->planner->Get(name);
      v1::GroupStatus* g = out->add_groups();
      g->set_name(name);
      g->set_ready(plan->status.ok());
      if (!plan->status.ok()) g->set_not_ready_reason(std::string(plan->status.message()));
      g->set_trainers(plan->trainers);
      g->set_inference_workers(plan->inference);
      g->set_version(p_->driver->CommittedVersion(name));
      if (plan->status.ok()) *g->mutable_plan() = SummaryToProto(plan->plan->stats, false);
      g->set_planned_at_membership(plan->epoch);
      // The replicas of the plan's epoch, with the versions committed to them since.
      const std::map<std::string, int64_t> versions = p_->membership->ReplicaVersions(name);
      int32_t complete = 0;
      for (const ReplicaView& r : plan->replicas) {
        v1::ReplicaStatus* out = g->add_replicas();
        out->set_name(r.name);
        out->set_size(r.size);
        for (const std::string& w : r.workers) out->add_workers(w);
        for (int32_t m : r.missing) out->add_missing_ranks(m);
        out->set_complete(r.complete);
        out->set_problem(r.problem);
        auto v = versions.find(r.name);
        out->set_version(v != versions.end() ? v->second : r.version);
        if (r.complete && out->version() < g->version()) {
          out->set_problem(absl::StrCat("replica \"", r.name, "\" holds ",
                                        out->version() == 0
                                            ? std::string("no version")
                                            : absl::StrCat("version ", out->version()),
                                        ", the group is at ", g->version(),
                                        ": it missed versions; the next round refits it"));
        }
        complete += r.complete;
      }
      g->set_complete_replicas(complete);
      // The trainer side by declared rank, as it is now (absent when no trainer declares one).
      if (const TrainerRanksView t = p_->membership->TrainerRanks(name); t.world_size != 0) {
        v1::TrainerRanksStatus* out = g->mutable_trainer_ranks();
        out->set_world_size(t.world_size);
        for (const std::string& w : t.workers) out->add_workers(w);
        for (int32_t m : t.missing) out->add_missing_ranks(m);
        out->set_complete(t.complete());
        out->set_problem(t.problem);
      }
    }
    return grpc::Status::OK;
  }
  grpc::Status ListWorkers(grpc::ServerContext* c, const v1::ListWorkersRequest* r,
                           v1::ListWorkersResponse* out) override {
    if (auto s = Check(c, Access::kView, "ListWorkers"); !s.ok()) return s;
    if (p_->link != nullptr) {
      return ToGrpc(p_->link->Forward(&v1::RefitControl::Stub::ListWorkers, *r, out,
                                      p_->config->peer_timeout));
    }
    p_->membership->ListWorkers(*r, out);
    return grpc::Status::OK;
  }
  grpc::Status ListRounds(grpc::ServerContext* c, const v1::ListRoundsRequest* r,
                          v1::ListRoundsResponse* out) override {
    if (auto s = Check(c, Access::kView, "ListRounds"); !s.ok()) return s;
    if (p_->link != nullptr) {
      return ToGrpc(p_->link->Forward(&v1::RefitControl::Stub::ListRounds, *r, out,
                                      p_->config->peer_timeout));
    }
    if (r->limit() < 0) return ToGrpc(absl::InvalidArgumentError("ListRounds: limit must be >= 0"));
    for (v1::RoundStats& s :
         p_->log->Recent(r->group(), r->limit() == 0 ? 100 : static_cast<size_t>(r->limit()))) {
      *out->add_rounds() = std::move(s);
    }
    return grpc::Status::OK;
  }
  grpc::Status GetPlan(grpc::ServerContext* c, const v1::GetPlanRequest* r,
                       v1::PlanSummary* out) override {
    if (auto s = Check(c, Access::kView, "GetPlan"); !s.ok()) return s;
    if (p_->link != nullptr) {
      return ToGrpc(
          p_->link->Forward(&v1::RefitControl::Stub::GetPlan, *r, out, p_->config->peer_timeout));
    }
    const std::vector<std::string> known = p_->membership->GroupNames();
    if (std::find(known.begin(), known.end(), r->group()) == known.end()) {
      return ToGrpc(absl::NotFoundError(absl::StrCat("no model group \"", r->group(), "\"")));
    }
    const std::shared_ptr<const GroupPlan> plan = p_->planner->Get(r->group());
    if (!plan->status.ok()) return ToGrpc(plan->status);
    *out = SummaryToProto(plan->plan->stats, false);
    return grpc::Status::OK;
  }

 private:
  grpc::Status Check(grpc::ServerContext* c, Access access, absl::string_view method) const {
    return ToGrpc(p_->authority->CheckControl(CallerOf(*c), access, method));
  }
  const ServiceParts* const p_;
};

class PeerService : public v1::RefitPeer::Service {
 public:
  explicit PeerService(const ServiceParts* p) : p_(p) {}
  grpc::Status Join(grpc::ServerContext* context, const v1::JoinRequest* r,
                    v1::JoinResponse* out) override {
    const DaemonConfig& c = *p_->config;
    if (auto s = p_->authority->CheckNode(CallerOf(*context), r->node(), "Join"); !s.ok())
      return ToGrpc(s);
    if (p_->membership == nullptr) {
      return ToGrpc(absl::FailedPreconditionError(
          absl::StrCat("node ", c.node, " is not the coordinator; it is ", c.coordinator)));
    }
    if (r->node() == c.node) {
      return ToGrpc(absl::AlreadyExistsError(
          absl::StrCat("node ", r->node(), " is the coordinator's own index")));
    }
    if (!c.tls.enabled() && !c.insecure_listen) {
      // Without TLS every daemon listens on loopback: a node naming another address is not one.
      for (const std::string& a : {r->control_address(), r->data_address()}) {
        if (!a.empty() && !IsLoopbackAddress(a)) {
          return ToGrpc(absl::PermissionDeniedError(absl::StrCat(
              "Join of node ", r->node(), ": address ", a,
              " is not a loopback one, and without TLS every daemon "
              "listens on loopback (--insecure-listen on the coordinator admits others)")));
        }
      }
    }
    const absl::StatusOr<bool> resync = p_->membership->Admit(*r);
    if (!resync.ok()) return ToGrpc(resync.status());
    if (*resync) out->set_resync(true);
    out->set_coordinator_node(c.node);
    out->set_coordinator_incarnation(p_->incarnation);
    if (p_->driver != nullptr) {
      for (const auto& [group, round] : p_->driver->RunningRounds())
        (*out->mutable_running_rounds())[group] = round;
      out->set_lists_running_rounds(true);
    }
    return grpc::Status::OK;
  }
  grpc::Status SyncWorkers(grpc::ServerContext* context, const v1::SyncWorkersRequest* r,
                           v1::SyncWorkersResponse* out) override {
    if (auto s = p_->authority->CheckNode(CallerOf(*context), r->node(), "SyncWorkers"); !s.ok())
      return ToGrpc(s);
    // What a node says of its workers is checked as a registration is: each on that node, within
    // the limits, its names printable (a node's bug, or a node's stolen key, stops here).
    // Each worker is read from its encoding (worker_encoded), never decoded piece by piece.
    for (const v1::RegisterWorkerRequest& request : r->workers()) {
      absl::StatusOr<SplitRegistration> split = SplitRegistration::Of(request);
      if (!split.ok()) {
        return ToGrpc(absl::InvalidArgumentError(
            absl::StrCat("SyncWorkers from node ", r->node(), ": ", split.status().message())));
      }
      const v1::Worker& w = split->header().worker();
      if (w.node() != r->node()) {
        return ToGrpc(absl::InvalidArgumentError(absl::StrCat("SyncWorkers from node ", r->node(),
                                                              ": worker \"", w.name(),
                                                              "\" says it is on node ", w.node())));
      }
      if (auto s = CheckRegistration(*split, p_->config->limits); !s.ok()) {
        return ToGrpc(absl::Status(
            s.code(), absl::StrCat("SyncWorkers from node ", r->node(), ": ", s.message())));
      }
    }
    if (p_->membership == nullptr)
      return ToGrpc(absl::FailedPreconditionError("not the coordinator"));
    // Names another node holds are refused, listed in `out`; a node not joined is refused whole.
    return ToGrpc(p_->membership->ApplySync(*r, out));
  }
  grpc::Status InstallPlan(grpc::ServerContext* c, const v1::InstallPlanRequest* r,
                           v1::InstallPlanResponse*) override {
    if (auto s = FromCoordinator(c, "InstallPlan"); !s.ok()) return s;
    return ToGrpc(p_->agent->InstallPlan(*r));
  }
  grpc::Status RunPhase(grpc::ServerContext* c, const v1::PhaseRequest* r,
                        v1::PhaseResponse* out) override {
    if (auto s = FromCoordinator(c, "RunPhase"); !s.ok()) return s;
    return ToGrpc(p_->agent->RunPhase(*r, out));
  }

 private:
  // Phases and plans only from the coordinator this node joined (the coordinator runs its own
  // node's part in process, so over gRPC it takes none).
  grpc::Status FromCoordinator(grpc::ServerContext* c, absl::string_view method) const {
    const KnownCoordinator coordinator =
        p_->link != nullptr ? p_->link->Coordinator() : KnownCoordinator{};
    return ToGrpc(p_->authority->CheckCoordinator(CallerOf(*c), coordinator,
                                                  CoordinatorIncarnationOf(*c), method));
  }
  const ServiceParts* const p_;
};

}  // namespace

std::unique_ptr<grpc::Service> MakeWorkerService(const ServiceParts* parts) {
  return std::make_unique<WorkerService>(parts);
}
std::unique_ptr<grpc::Service> MakeControlService(const ServiceParts* parts) {
  return std::make_unique<ControlService>(parts);
}
std::unique_ptr<grpc::Service> MakePeerService(const ServiceParts* parts) {
  return std::make_unique<PeerService>(parts);
}

}  // namespace refit
