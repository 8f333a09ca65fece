#include "daemon/coordinator/plan_slices.h"

#include <algorithm>
#include <atomic>
#include <thread>

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

std::map<int32_t, std::shared_ptr<const v1::InstallPlanRequest>> SliceRequests(
    const v1::InstallPlanRequest& base, const GroupPlan& plan, const std::vector<int32_t>& nodes,
    int64_t keep_remote_min_bytes, int threads) {
  std::vector<std::shared_ptr<const v1::InstallPlanRequest>> made(nodes.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < nodes.size(); i = next++) {
      made[i] = SliceRequest(base, plan, nodes[i], keep_remote_min_bytes);
    }
  };
  std::vector<std::thread> helpers;
  const size_t extra =
      std::min<size_t>(nodes.size(), static_cast<size_t>(std::max(threads, 1))) - 1;
  for (size_t t = 0; t < extra && nodes.size() > 1; ++t) helpers.emplace_back(work);
  work();
  for (std::thread& t : helpers) t.join();
  std::map<int32_t, std::shared_ptr<const v1::InstallPlanRequest>> out;
  for (size_t i = 0; i < nodes.size(); ++i) out[nodes[i]] = std::move(made[i]);
  return out;
}

}  // namespace refit
