// refitd's gRPC services, thin: each method checks where it runs (coordinator or not), calls
// the component that does the work, and converts the status once (daemon/base/grpc_status.h).
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "daemon/config.h"
#include "daemon/security/authority.h"
#include "daemon/security/worker_admission.h"
#include "daemon/watch_slots.h"
#include "proto/refit.grpc.pb.h"

namespace refit {

class CoordinatorLink;
class GroupPlanner;
class Membership;
class NodeAgent;
class RoundDriver;
class RoundLog;
class WatchHub;
class WorkerRegistry;

// More WatchRounds at once are RESOURCE_EXHAUSTED: each holds a thread of the server (a node's
// share one stream to the coordinator: daemon/node/watch_hub.h); and one caller may hold at most
// kMaxWatchesPerCaller of them, so that no one local user or certificate takes every slot
// (watch_slots.h says who a caller is).
inline constexpr int kMaxWatches = 64;
inline constexpr int kMaxWatchesPerCaller = 8;

// What the services reach; null where this daemon has none (the coordinator has no link, the
// others no membership, planner, driver or log).
struct ServiceParts {
  const DaemonConfig* config = nullptr;
  const Authority* authority = nullptr;  // who may call what (docs/SECURITY.md)
  int64_t incarnation = 0;  // this daemon's (the coordinator's answers to Join name it)
  // WatchRounds streams open on this daemon, in all and per caller.
  mutable WatchSlots watch_slots{kMaxWatches, kMaxWatchesPerCaller};
  std::string address;  // this daemon's control address, once serving
  WorkerRegistry* registry = nullptr;
  NodeAgent* agent = nullptr;
  CoordinatorLink* link = nullptr;
  WatchHub* watch_hub = nullptr;  // with `link`: this node's watches, on one stream upstream
  Membership* membership = nullptr;
  GroupPlanner* planner = nullptr;
  RoundDriver* driver = nullptr;
  RoundLog* log = nullptr;
  // Registration and departure, wired by the Daemon: they also tell the coordinator and end a
  // transfer the worker was part of.
  // `transport`: how the registration arrived (worker_admission.h: the unix socket is uid-checked).
  std::function<absl::Status(const v1::RegisterWorkerRequest&, WorkerTransport transport,
                             v1::RegisterWorkerResponse*)>
      register_worker;
  std::function<void(const std::string& id, const std::string& reason)> drop_worker;
};

std::unique_ptr<grpc::Service> MakeWorkerService(const ServiceParts* parts);
std::unique_ptr<grpc::Service> MakeControlService(const ServiceParts* parts);
std::unique_ptr<grpc::Service> MakePeerService(const ServiceParts* parts);

}  // namespace refit
