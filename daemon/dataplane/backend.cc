#include "daemon/dataplane/backend.h"

#include "absl/strings/str_cat.h"
#include "daemon/base/log_later.h"
#include "daemon/base/logging.h"
#include "plan/status_macros.h"

namespace refit {

absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> DataBackend::MapBuffers(
    const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes,
    std::span<const Fd> fds) {
  std::vector<std::unique_ptr<MappedBuffer>> out;
  for (int b = 0; b < request.memory_size(); ++b) {
    const v1::BufferMemory& m = request.memory(b);
    const std::string what = absl::StrCat("buffer \"", request.worker().buffers(b).name(), "\"");
    if ((m.has_shm() && m.shm().fd() != 0) || m.has_cuda_vmm()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the ", name(), " backend cannot map memory handed over as descriptors"));
    }
    auto mapped = Map(m, buffer_bytes[b]);
    if (!mapped.ok()) return Annotate(mapped.status(), what);
    out.push_back(*std::move(mapped));
  }
  return out;
}

void LogMoved(const TransferJob& job, absl::Time started, TransferStats* stats) {
  stats->data_plane_ms = absl::ToDoubleMilliseconds(absl::Now() - started);
  if (job.requested == absl::InfinitePast()) {  // not from a phase request (tests, tools)
    LogLater("data", spdlog::level::info, "group \"{}\" round {}: moved in {:.3f} ms", job.group,
             job.round_id, stats->data_plane_ms);
    return;
  }
  stats->started_after_request_ms = absl::ToDoubleMilliseconds(started - job.requested);
  // Written after the node answered (daemon/base/log_later.h): the round waits for no disk. In UTC,
  // as every log line's time: the local zone cost 16 us a line (its file looked up each time),
  // absl::FormatTime in UTC 9 us.
  LogLater("data", spdlog::level::info,
           "group \"{}\" round {}: moved in {:.3f} ms; started {:.3f} ms after the request arrived "
           "at {}",
           job.group, job.round_id, stats->data_plane_ms, stats->started_after_request_ms,
           UtcTimeOfDay(job.requested));
}

}  // namespace refit
