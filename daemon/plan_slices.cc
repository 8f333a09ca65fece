#include "daemon/plan_slices.h"

#include "plan/plan_slice.h"
#include "proto/plan_codec.h"

namespace refit {

std::shared_ptr<const v1::InstallPlanRequest> SliceRequest(const v1::InstallPlanRequest& base,
                                                           const GroupPlan& plan, int32_t node,
                                                           int64_t keep_remote_min_bytes) {
  auto request = std::make_shared<v1::InstallPlanRequest>(base);
  request->clear_source();
  request->clear_destination();
  request->set_plan_digest(plan.digest);
  request->set_slice(SliceToWire(SliceOfPlan(*plan.plan, node, keep_remote_min_bytes), node,
                                 *plan.src_layout, *plan.dst_layout));
  request->set_slice_digest(Sha256(request->slice()));
  return request;
}

}  // namespace refit
