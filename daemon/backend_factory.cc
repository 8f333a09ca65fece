#include "daemon/backend_factory.h"

#include <algorithm>
#include <utility>

#include "daemon/backend_names.h"
#include "daemon/dataplane/cuda/cuda_backend.h"
#include "daemon/dataplane/host/host_backend.h"

namespace refit {
namespace {

absl::StatusOr<std::unique_ptr<DataBackend>> MakeCudaBackend(const DaemonConfig& config,
                                                             const BackendContext&) {
  const ArmRounds arm = config.arm_rounds == "always" ? ArmRounds::kAlways
                        : config.arm_rounds == "auto" ? ArmRounds::kAuto
                                                      : ArmRounds::kNever;
  auto backend = CudaBackend::Start(config.gpus, config.staging_bytes, config.nccl_stream_priority,
                                    config.aligned_copy_kernel, arm);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<DataBackend>(*std::move(backend));
}

absl::StatusOr<std::unique_ptr<DataBackend>> MakeHostBackend(const DaemonConfig& config,
                                                             const BackendContext& context) {
  auto backend = HostBackend::Start(
      config.data_listen, HostBackendOptions{.first_byte_timeout = config.data_first_byte_timeout,
                                             .idle_timeout = config.data_idle_timeout,
                                             .tls = config.tls,
                                             .local_users = context.local_users});
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<DataBackend>(*std::move(backend));
}

constexpr BackendEntry kBackends[] = {
    {kCudaBackend, "CUDA copies within the node and NCCL between nodes, on the GPUs of --gpus",
     &MakeCudaBackend},
    {kHostBackend, "shared memory and TCP (or TLS) streams on --data-listen; runs anywhere",
     &MakeHostBackend},
};

constexpr bool NamedAsConfigKnows() {
  if (std::size(kBackends) != kBackendNames.size()) return false;
  for (size_t i = 0; i < kBackendNames.size(); ++i) {
    if (kBackends[i].name != kBackendNames[i]) return false;
  }
  return true;
}
static_assert(NamedAsConfigKnows(),
              "one entry per name of kBackendNames (backend_names.h), in the same order");

}  // namespace

absl::Span<const BackendEntry> Backends() { return kBackends; }

const BackendEntry* FindBackend(absl::string_view name) {
  for (const BackendEntry& e : kBackends) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::StatusOr<std::unique_ptr<DataBackend>> MakeBackend(const DaemonConfig& config,
                                                         const BackendContext& context) {
  const BackendEntry* entry = FindBackend(config.backend);
  if (entry == nullptr) return CheckBackendName(config.backend);
  return entry->make(config, context);
}

}  // namespace refit
