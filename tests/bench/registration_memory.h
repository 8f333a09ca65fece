// What registrations cost the daemons: `workers` workers of `pieces` pieces each register at once
// (one thread each) on a node of a two-daemon cluster (a coordinator and a node, refitd processes
// on loopback; the node syncs each worker to the coordinator before Register answers), then
// unregister. Measured: one RegisterWorkerRequest's size on the wire, the registrations' wall time,
// and each daemon's resident memory (/proc/PID/status VmRSS and RssAnon) before, after registering
// and after unregistering, and its peak while registering (VmHWM: the daemons are fresh, so
// their peak before is their start's).
// Shared by tests/bench:registration_memory_benchmark and tests/load:registration_memory_test.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "plan/layout.h"

namespace refit {

struct RegistrationMemoryOptions {
  std::string refitd = "daemon/refitd";  // the binary
  int64_t pieces = 1000000;              // per worker
  int64_t workers = 1;                   // registering at once
  int64_t rows_per_tensor = 1000;        // pieces per tensor (and per buffer): one row each
  double settle_seconds = 3.0;  // before each reading (daemon/ops/memory_trim.h trims every second)
};

struct DaemonMemory {
  int64_t rss_before = 0, rss_registered = 0, rss_unregistered = 0;     // bytes, VmRSS
  int64_t anon_before = 0, anon_registered = 0, anon_unregistered = 0;  // bytes, RssAnon
  int64_t hwm_registered = 0;  // bytes, VmHWM once registered: the peak while registering
  int64_t growth() const { return rss_registered - rss_before; }
  int64_t peak() const { return hwm_registered - rss_before; }
  int64_t retained() const { return rss_unregistered - rss_before; }  // after unregistering
};

struct RegistrationMemory {
  int64_t pieces = 0, tensors = 0, buffers = 0;
  int64_t workers = 1;
  int64_t wire_bytes =
      0;  // one RegisterWorkerRequest as the worker library sends it (all: x workers)
  double register_seconds = 0;
  DaemonMemory node, coordinator;
};

// The benchmark's worker: `pieces` rows of fp32 [rows_per_tensor, 4] tensors, each tensor in a
// buffer of its own, each piece one row (both boxes explicit, as a flat FSDP shard's are).
Layout RegistrationLayout(const RegistrationMemoryOptions& options,
                          const std::string& worker = "regmem-0");

// One measurement against fresh daemons (started and stopped here).
absl::StatusOr<RegistrationMemory> MeasureRegistration(const RegistrationMemoryOptions& options);

}  // namespace refit
