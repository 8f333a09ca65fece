// A round's log lines on the cuda backend (daemon/dataplane/cuda/cuda_backend.cc): its own line
// (how long it moved, the host's side, each GPU's copies within the node) and, where it used the
// network, each GPU's timeline. Read from the round's events at its end (the next round reuses
// them); the lines are written after the node answered (daemon/base/log_later.h).
#pragma once

#include "absl/time/time.h"
#include "daemon/dataplane/backend.h"
#include "daemon/dataplane/cuda/cuda_backend.h"

namespace refit {

// When the host had the group's lease (after any arming of it ended), began a round, had launched
// every stage's work, and saw it done.
struct HostTimes {
  absl::Time leased, started, launched, done;
  bool armed = false;  // launched at PREPARE, let go at `started`
};

// Sets stats->data_plane_ms (from host.started to now) and started_after_request_ms, and logs the
// round's line.
void LogRound(const TransferJob& job, const CudaBackend::Prepared& p, const HostTimes& host,
              TransferStats* stats);
// One info line per GPU that used the network (one debug line per step).
void LogNetworkTimeline(const TransferJob& job, const CudaBackend::Prepared& p);

}  // namespace refit
