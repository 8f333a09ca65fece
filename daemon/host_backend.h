// The host data plane: buffers in POSIX shared memory; messages between daemons over TCP, one
// message at a time per connection (staging bounded by the plan's max_message_bytes per
// connection), packed and unpacked with the CPU reference of plan/host_copy.h.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "client/shared_memory.h"
#include "daemon/backend.h"
#include "daemon/socket.h"

namespace refit {

class HostBackend : public DataBackend {
 public:
  // Listens for peers on `listen_address` ("host:0" picks a port).
  static absl::StatusOr<std::unique_ptr<HostBackend>> Start(const std::string& listen_address);
  ~HostBackend() override;

  std::string name() const override { return "host"; }
  std::string data_address() const override { return address_; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> Map(const v1::BufferMemory& memory,
                                                    int64_t bytes) override;
  // Shared memory by name (Map) or by descriptor (SharedMemory.fd): a descriptor's object is
  // mapped whole, as large as fstat says (never as the worker claims), once per object.
  absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> MapBuffers(
      const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes,
      std::span<const Fd> fds) override;
  absl::StatusOr<int32_t> GpuIndex(const std::string& name) override;
  absl::StatusOr<TransferStats> Transfer(const TransferJob& job) override;
  void Cancel(const std::string& group, int64_t round_id, const std::string& reason) override;

 private:
  struct Job;
  HostBackend() = default;
  void AcceptLoop();
  void ReadLoop(int connection);
  std::shared_ptr<Job> WaitForJob(const std::string& group, int64_t round_id, absl::Time deadline);
  absl::Status Send(Job& job, const Message& m, int64_t index, std::vector<std::byte>& staging);

  std::string address_;
  Fd listener_;
  std::thread acceptor_;

  std::mutex mu_;
  std::condition_variable jobs_changed_;
  absl::flat_hash_map<std::pair<std::string, int64_t>, std::shared_ptr<Job>> jobs_;
  std::vector<Fd> connections_;         // accepted, one reader thread each
  std::vector<std::thread> readers_;
  absl::flat_hash_map<std::string, Fd> outgoing_;  // cached connections to peers, by address
  // Shared-memory objects mapped once each, by (name, size), while any buffer maps them.
  std::mutex segments_mu_;
  std::map<std::pair<std::string, int64_t>, std::weak_ptr<SharedMemory>> segments_;
  size_t opens_since_prune_ = 0;
  // Objects handed over as descriptors, by (device, inode): one mapping per object, however
  // many descriptors of it arrive. A live mapping pins its inode, so the key cannot be reused.
  std::map<std::pair<dev_t, ino_t>, std::weak_ptr<SharedMemory>> fd_segments_;
  size_t fd_maps_since_prune_ = 0;
  bool stopping_ = false;
};

}  // namespace refit
