#include "daemon/dataplane/cuda/cuda_round_log.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/base/log_later.h"
#include "daemon/base/logging.h"
#include "daemon/dataplane/cuda/cuda_backend_state.h"
#include "daemon/dataplane/cuda/event.h"

namespace refit {

// Where a round's time went on each GPU that used the network, from the events of its steps
// (read after the round, when all of them have completed): time on the wire and its rate, the
// wire's idle time between steps (waiting for a pack, or for the host), the pipeline's fill and
// drain. One info line per GPU, one debug line per step. Read here, written after the node
// answered (LogLater): the round's events are reused by the next round.
void LogNetworkTimeline(const TransferJob& job, const CudaBackend::Prepared& p) {
  // Events carry their context: no device to switch to (a cold cudaSetDevice and its undoing
  // cost the node's work after its data plane microseconds).
  for (const auto& [gpu, on] : p.gpus) {
    if (!on.start) continue;
    auto at = [&, start = on.start.get()](
                  const Event& e) {  // clang 14 cannot capture a structured binding
      float ms = 0;
      return cudaEventElapsedTime(&ms, start, e.get()) == cudaSuccess ? double{ms} : -1.0;
    };
    int steps = 0;
    int64_t bytes = 0;
    double wire = 0, idle = 0, first = -1, last = 0;
    std::vector<double> rates;
    for (int stage = 0; stage < kMaxStages; ++stage) {
      auto it = p.schedule.stages[stage].steps.find(gpu);
      if (it == p.schedule.stages[stage].steps.end()) continue;
      for (size_t k = 0; k < it->second.size(); ++k) {
        int64_t step_bytes = 0;
        for (const NetworkOp& op : it->second[k].ops) step_bytes += op.bytes;
        const double packed = at(on.packed[stage][k]), begin = at(on.wire_begin[stage][k]),
                     end = at(on.moved[stage][k]), unpacked = at(on.unpacked[stage][k]);
        if (begin < 0 || end < 0) return;  // an event never recorded: nothing to say
        ++steps;
        bytes += step_bytes;
        wire += end - begin;
        if (k > 0) idle += std::max(0.0, begin - at(on.moved[stage][k - 1]));
        if (first < 0) first = begin;
        last = std::max(last, unpacked);
        if (end > begin) rates.push_back(step_bytes / 1e6 / (end - begin));
        LogLater("data", spdlog::level::debug,
                 "round {} GPU {} stage {} step {}: {} bytes in {} operations; packed at {:.3f} "
                 "ms, on the "
                 "wire {:.3f}-{:.3f} ms, unpacked at {:.3f} ms",
                 job.round_id, gpu, stage, k, step_bytes, it->second[k].ops.size(), packed, begin,
                 end, unpacked);
      }
    }
    if (steps == 0) continue;
    std::sort(rates.begin(), rates.end());
    LogLater("data", spdlog::level::info,
             "group \"{}\" round {} GPU {} timeline: {} steps, {} bytes; on the wire {:.3f} ms "
             "({:.1f} GB/s; "
             "steps {:.0f}-{:.0f} GB/s), wire idle between steps {:.3f} ms, first step on the wire "
             "at {:.3f} ms, "
             "last unpacked at {:.3f} ms",
             job.group, job.round_id, gpu, steps, bytes, wire, wire > 0 ? bytes / 1e6 / wire : 0.0,
             rates.empty() ? 0.0 : rates.front(), rates.empty() ? 0.0 : rates.back(), idle, first,
             last);
  }
}

// The round's own line: how long the data plane took and when it began after the request (into
// `stats`), the host's side (let go, or launched, and when it saw the work done), and when each
// GPU's copies within the node were done (their events read now: the next round reuses them).
// One line, made by the log's writer thread: on the thread that answers TRANSFER, after a round's
// sleep, each line logged cost microseconds of cold caches (a 1 GB colocated round spent 17-23 us
// on the three lines before this one).
void LogRound(const TransferJob& job, const CudaBackend::Prepared& p, const HostTimes& host,
              TransferStats* stats) {
  stats->data_plane_ms = absl::ToDoubleMilliseconds(absl::Now() - host.started);
  const bool from_request = job.requested != absl::InfinitePast();  // not so in tests and tools
  if (from_request)
    stats->started_after_request_ms = absl::ToDoubleMilliseconds(host.started - job.requested);
  if (!LogLaterEnabled("data", spdlog::level::info)) return;
  struct Direct {
    int32_t gpu;
    int stage;
    int64_t units;
    double ms;
  };
  std::vector<Direct> direct;
  for (const auto& [gpu, on] : p.gpus) {
    if (!on.start) continue;
    for (size_t stage = 0; stage < on.direct_done.size() && stage < on.direct.size(); ++stage) {
      int64_t units = 0;
      for (const auto& d : on.direct[stage]) units += d.total_units;
      if (units == 0) continue;
      float ms = 0;
      const bool read =
          cudaEventElapsedTime(&ms, on.start.get(), on.direct_done[stage].get()) == cudaSuccess;
      direct.push_back({gpu, static_cast<int>(stage), units, read ? double{ms} : -1.0});
    }
  }
  LogLaterMade(
      "data", spdlog::level::info,
      [group = job.group, round = job.round_id, host, stats = *stats, from_request,
       requested = job.requested, direct = std::move(direct)] {
        std::string line = fmt::format("group \"{}\" round {}: ", group, round);
        const double done = absl::ToDoubleMilliseconds(host.done - host.started);
        if (host.armed) {
          absl::StrAppend(
              &line,
              fmt::format("host let go the work launched at PREPARE, saw it done at {:.3f} ms",
                          done));
        } else {
          absl::StrAppend(
              &line,
              fmt::format(
                  "host launched the work {:.3f} ms after starting, saw it done at {:.3f} ms",
                  absl::ToDoubleMilliseconds(host.launched - host.started), done));
        }
        absl::StrAppend(&line, fmt::format("; moved in {:.3f} ms", stats.data_plane_ms));
        if (from_request) {
          absl::StrAppend(&line,
                          fmt::format(", started {:.3f} ms after the request arrived at {} (the "
                                      "group's lease taken at {:.3f} ms)",
                                      stats.started_after_request_ms, UtcTimeOfDay(requested),
                                      absl::ToDoubleMilliseconds(host.leased - requested)));
        }
        for (const Direct& d : direct) {
          absl::StrAppend(
              &line,
              fmt::format("; GPU {} stage {}: direct copies of {} units done {:.3f} ms after the "
                          "round's first work",
                          d.gpu, d.stage, d.units, d.ms));
        }
        return line;
      });
}

}  // namespace refit
