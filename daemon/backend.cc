#include "daemon/backend.h"

#include "daemon/logging.h"

namespace refit {

void LogMoved(const TransferJob& job, absl::Time started) {
  if (job.requested == absl::InfinitePast()) {  // not from a phase request (tests, tools)
    Logger("data")->info("group \"{}\" round {}: moved in {:.3f} ms", job.group, job.round_id,
                         absl::ToDoubleMilliseconds(absl::Now() - started));
    return;
  }
  Logger("data")->info("group \"{}\" round {}: moved in {:.3f} ms; started {:.3f} ms after the request arrived at {}",
                       job.group, job.round_id, absl::ToDoubleMilliseconds(absl::Now() - started),
                       absl::ToDoubleMilliseconds(started - job.requested),
                       absl::FormatTime("%H:%M:%E6S", job.requested, absl::LocalTimeZone()));
}

}  // namespace refit
