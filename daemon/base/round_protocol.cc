#include "daemon/base/round_protocol.h"

#include <algorithm>

namespace refit {

PlanOptions PlanOptionsFor(const v1::InstallPlanRequest& request) {
  PlanOptions options;
  options.max_message_bytes = request.max_message_bytes();
  options.routing = !request.no_routing();
  options.max_relay_depth = request.max_relay_depth();
  int32_t gpus = 1;
  for (const v1::Layout* l : {&request.source(), &request.destination()}) {
    for (const v1::Worker& w : l->workers()) gpus = std::max(gpus, w.gpu() + 1);
  }
  options.topology.gpus_per_node = gpus;
  options.topology.nics_per_node = gpus;
  return options;
}

const char* PhaseName(v1::PhaseRequest::Phase p) {
  switch (p) {
    case v1::PhaseRequest::PREPARE:
      return "PREPARE";
    case v1::PhaseRequest::TRANSFER:
      return "TRANSFER";
    case v1::PhaseRequest::COMMIT:
      return "COMMIT";
    case v1::PhaseRequest::ABORT:
      return "ABORT";
    default:
      return "?";
  }
}

}  // namespace refit
