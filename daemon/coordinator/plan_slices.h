// What the coordinator sends each node of a group: the InstallPlanRequest with that node's slice
// of the plan (plan/plan_slice.h), instead of the layouts every node would plan again.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "daemon/coordinator/group_planner.h"
#include "proto/refit.pb.h"

namespace refit {

// `base` (group, epoch, options, addresses, communicator) with `node`'s slice of `plan`, the
// plan's digest and the slice's. Other nodes' network descriptors of at least
// `keep_remote_min_bytes` stay in the slice (the cuda backend's zero-copy threshold: it cuts
// every node's steps by them).
std::shared_ptr<const v1::InstallPlanRequest> SliceRequest(const v1::InstallPlanRequest& base,
                                                           const GroupPlan& plan, int32_t node,
                                                           int64_t keep_remote_min_bytes);

// SliceRequest for each of `nodes`, on up to `threads` threads at once (tens of milliseconds per
// node for a frontier plan), joined before it returns.
std::map<int32_t, std::shared_ptr<const v1::InstallPlanRequest>> SliceRequests(
    const v1::InstallPlanRequest& base, const GroupPlan& plan, const std::vector<int32_t>& nodes,
    int64_t keep_remote_min_bytes, int threads);

}  // namespace refit
