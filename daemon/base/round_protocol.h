// What the coordinator and every node read the same way from the control protocol: the planner
// options an InstallPlan request carries, and a phase's name in errors and logs.
#pragma once

#include "plan/planner.h"
#include "proto/refit.pb.h"

namespace refit {

// The planner options every daemon derives from an InstallPlan request: identical everywhere,
// so every daemon computes the identical plan.
PlanOptions PlanOptionsFor(const v1::InstallPlanRequest& request);
const char* PhaseName(v1::PhaseRequest::Phase p);

}  // namespace refit
