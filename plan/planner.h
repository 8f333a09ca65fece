// The M -> N reshard planner: phases 2 to 6 of ../docs/PLANNING.md (validation is phase 1).
//
//   Match    per logical tensor, source regions (disjoint boxes with the replicas that hold
//            them) are indexed; each destination region is matched against the index.
//   Choose   among replicas: the same GPU, else the same node, else the one whose NIC has sent
//            the fewest bytes so far (greedy balancing of bytes per sending GPU and NIC).
//   Route    a region needed by several GPUs of one destination node crosses the network once,
//            lands on the needing GPU whose NIC has received the fewest bytes, and is forwarded
//            over NVLink to the others. A region several destination nodes need may be relayed
//            from a node that already received it, when that node's NIC has sent less than any
//            source's: sources that hold the only copy are not the bottleneck (NCCL M2N's ring of
//            domains, generalised). Each hop is one stage later than the one it reads from.
//   Lower    copy descriptors, grouped per (stage, sending GPU, receiving GPU) into messages of
//            bounded size, so thousands of small tensors travel as a few large messages.
//   Cost     bytes per link class and per GPU and NIC; the predicted time; the lower bound.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "plan/layout.h"
#include "plan/plan.h"
#include "plan/topology.h"

namespace refit {

struct PlanOptions {
  Topology topology;
  // Topology routing (network once per destination node, then NVLink). Off: every destination
  // GPU receives its own copy over the network.
  bool routing = true;
  // Upper bound on one message's bytes: the unit of staging and pipelining.
  int64_t max_message_bytes = int64_t{64} << 20;
  // Longest chain of network relays between destination nodes (0: every region crosses the
  // network from a source). Stages are 0 .. max_relay_depth + 1.
  int32_t max_relay_depth = 3;
  // Threads planning may use (0: as many as the machine has). With two or more, descriptors are
  // lowered on a second thread while the first routes. The plan is the same whatever the count.
  int32_t threads = 0;
};

// Plans the refit of `destination` from `source`. Both layouts must have passed ValidateLayout;
// the pair is checked here (ValidatePair) and so is coverage: a destination element that no
// source holds is an INVALID_ARGUMENT naming the tensor, the worker, the box and how much is
// missing.
absl::StatusOr<Plan> MakePlan(const Layout& source, const Layout& destination,
                              const PlanOptions& options);

}  // namespace refit
