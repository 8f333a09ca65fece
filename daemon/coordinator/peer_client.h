// How the coordinator's RoundDriver reaches the daemons of a round (itself included): a pure
// interface, so that the driver can be tested against a fake. Calls are asynchronous: `done`
// runs exactly once, on any thread, possibly before the call returns; the driver must not hold
// a lock of its own when it calls in, nor in `done` when it calls again.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "proto/refit.pb.h"

namespace refit {

class PeerClient {
 public:
  using Done = std::function<void(absl::Status)>;
  virtual ~PeerClient() = default;

  // Runs one phase on `node`. `timeout` is the phase's own; the call may take the peer allowance
  // on top. `*response` is written before `done` and must stay valid until then. A failure's
  // message names the node (and, for a node declared dead meanwhile, why).
  virtual void RunPhase(int32_t node, const v1::PhaseRequest& request, absl::Duration timeout,
                        v1::PhaseResponse* response, Done done) = 0;
  // `request` is shared by every node's call (a plan's layouts can be large). `timeout`: the
  // call's deadline (the node plans for itself: it grows with the plan).
  virtual void InstallPlan(int32_t node, std::shared_ptr<const v1::InstallPlanRequest> request,
                           absl::Duration timeout, Done done) = 0;
};

}  // namespace refit
