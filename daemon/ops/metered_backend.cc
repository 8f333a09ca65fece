#include "daemon/ops/metered_backend.h"

#include <utility>

namespace refit {
namespace {

class MeteredBackend : public DataBackend {
 public:
  MeteredBackend(std::unique_ptr<DataBackend> inner, Metrics* metrics)
      : inner_(std::move(inner)), metrics_(metrics) {}

  std::string name() const override { return inner_->name(); }
  std::string data_address() const override { return inner_->data_address(); }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> Map(const v1::BufferMemory& memory,
                                                    int64_t bytes) override {
    return inner_->Map(memory, bytes);
  }
  absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> MapBuffers(
      const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes,
      std::span<const Fd> fds) override {
    return inner_->MapBuffers(request, buffer_bytes, fds);
  }
  absl::StatusOr<int32_t> GpuIndex(const std::string& name) override {
    return inner_->GpuIndex(name);
  }
  // The inner backend's memory (device memory for cuda): the default would be host memory.
  absl::StatusOr<std::unique_ptr<MappedBuffer>> AllocateScratch(const Worker& worker,
                                                                int64_t bytes) override {
    return inner_->AllocateScratch(worker, bytes);
  }
  absl::StatusOr<TransferStats> Transfer(const TransferJob& job) override {
    const absl::Time started = absl::Now();
    absl::StatusOr<TransferStats> stats = inner_->Transfer(job);
    Metrics::Transfer t;
    t.group = job.group;
    t.ok = stats.ok();
    t.elapsed = absl::Now() - started;
    if (stats.ok()) {
      t.bytes_sent = stats->bytes_sent;
      t.bytes_received = stats->bytes_received;
      t.bytes_local = stats->bytes_local;
      t.bytes_nvlink = stats->bytes_nvlink;
    }
    metrics_->TransferEnded(t);
    metrics_->Communicators(inner_->Communicators());
    return stats;
  }
  void RoundPreparing(TransferJob job) override { inner_->RoundPreparing(std::move(job)); }
  void WorkersPrepared(const std::string& group, int64_t round_id) override {
    inner_->WorkersPrepared(group, round_id);
  }
  bool ArmsRounds() const override { return inner_->ArmsRounds(); }
  void Cancel(const std::string& group, int64_t round_id, const std::string& reason) override {
    inner_->Cancel(group, round_id, reason);
    metrics_->Communicators(inner_->Communicators());  // a cancel may abort one
  }
  CommunicatorCounts Communicators() const override { return inner_->Communicators(); }
  std::vector<std::pair<std::string, int64_t>> ConnectionEvents() const override {
    return inner_->ConnectionEvents();
  }
  absl::StatusOr<std::string> NewCommunicatorId() override { return inner_->NewCommunicatorId(); }

 private:
  const std::unique_ptr<DataBackend> inner_;
  Metrics* const metrics_;
};

}  // namespace

std::unique_ptr<DataBackend> MeterBackend(std::unique_ptr<DataBackend> backend, Metrics* metrics) {
  return std::make_unique<MeteredBackend>(std::move(backend), metrics);
}

}  // namespace refit
