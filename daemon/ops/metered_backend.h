// A DataBackend that forwards every call to the backend it wraps and reports each Transfer to
// Metrics (data-plane time, bytes by link class: what TransferStats gives). The NodeAgent and
// the backends stay unaware of metrics; the daemon wraps its backend only with --metrics-listen.
#pragma once

#include <memory>

#include "daemon/dataplane/backend.h"
#include "daemon/ops/metrics.h"

namespace refit {

// `metrics` must outlive the result.
std::unique_ptr<DataBackend> MeterBackend(std::unique_ptr<DataBackend> backend, Metrics* metrics);

}  // namespace refit
