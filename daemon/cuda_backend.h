// The cuda data plane: workers' buffers reached through CUDA IPC handles, each allocation opened
// once per GPU that touches it and cached until its last buffer is released; or, for CUDA VMM
// memory (cuMemCreate), through its physical allocations' file descriptors: each VMM range is
// imported and mapped once, at one address valid on every GPU served. Messages inside a
// node are copied straight from source to destination by the copy kernels on the receiving GPU,
// reading the sender's memory over NVLink. Messages between nodes are packed on the sending GPU,
// moved by NCCL send/recv on a communicator per group and membership (one rank per local GPU;
// nonblocking init; aborted on failure, deadline or cancel, then rebuilt), and unpacked, pipelined
// in steps (kernels/network_schedule.h): pack step k+1 while step k is on the wire and step k-1
// is unpacked, in staging bounded per GPU; descriptors contiguous at both ends go zero-copy.
// Three streams per GPU: compute (pack, unpack), comm (NCCL), direct (copies inside the node).
// A group's schedule, items, staging and events are built once per plan and buffer addresses,
// and dropped after any failure.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "absl/time/time.h"
#include "daemon/backend.h"
#include "daemon/gpu_ids.h"

namespace refit {

class CudaBackend : public DataBackend {
 public:
  // `gpus`: the local GPU indices this daemon serves (peer access is enabled among them).
  // `staging_bytes`: the most staging one group's rounds hold on each GPU.
  // `nccl_stream_priority`: NCCL's stream gets the GPU's highest priority, so that its kernels'
  // blocks are scheduled ahead of pending pack and unpack blocks (which slow NCCL by 17% while
  // they run beside it, docs/BENCHMARKS.md). Not yet measured end to end.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Start(const std::vector<int32_t>& gpus,
                                                          int64_t staging_bytes, bool nccl_stream_priority = false);
  ~CudaBackend() override;

  std::string name() const override { return "cuda"; }
  std::string data_address() const override { return ""; }
  absl::StatusOr<std::unique_ptr<MappedBuffer>> Map(const v1::BufferMemory& memory,
                                                    int64_t bytes) override;
  // CUDA IPC buffers through Map; CUDA VMM buffers (BufferMemory.cuda_vmm) through their range,
  // each range imported from its descriptors and mapped once for all of its buffers.
  absl::StatusOr<std::vector<std::unique_ptr<MappedBuffer>>> MapBuffers(
      const v1::RegisterWorkerRequest& request, std::span<const int64_t> buffer_bytes,
      std::span<const Fd> fds) override;
  absl::StatusOr<int32_t> GpuIndex(const std::string& name) override;
  absl::StatusOr<TransferStats> Transfer(const TransferJob& job) override;
  void Cancel(const std::string& group, int64_t round_id, const std::string& reason) override;
  absl::StatusOr<std::string> NewCommunicatorId() override;

  struct Allocation;  // an opened IPC handle
  struct VmmMapping;  // an imported and mapped VMM range
  struct Prepared;    // a group's schedule on this node, ready to run

 private:
  CudaBackend() = default;
  // `address` (in its owner GPU's import) as GPU `gpu`'s kernels must use it. VMM memory is
  // mapped for every GPU at one address: returned unchanged.
  absl::StatusOr<uint64_t> AddressOn(int32_t gpu, uint64_t address);
  void Forget(Allocation* a);
  void ForgetVmm(uint64_t base);
  absl::StatusOr<std::shared_ptr<VmmMapping>> MapVmmRange(const v1::RegisterWorkerRequest& request, int range,
                                                          std::span<const Fd> fds);
  std::map<uint64_t, Allocation*> by_base_;  // owner-context base -> allocation
  std::map<uint64_t, uint64_t> vmm_by_base_;  // VMM range base -> its bytes (guarded by mu_)
  std::vector<int32_t> gpus_;
  std::vector<GpuName> names_;  // of gpus_, for GpuIndex
  std::mutex mu_;
  std::map<std::string, std::weak_ptr<Allocation>> opened_;  // by handle bytes
  std::set<std::pair<std::string, int64_t>> active_;  // rounds transferring now
  std::map<std::pair<std::string, int64_t>, std::string> cancelled_;
  struct GpuStreams {
    void* compute = nullptr;  // cudaStream_t
    void* comm = nullptr;
    void* direct = nullptr;
  };
  std::map<int32_t, GpuStreams> streams_;
  int64_t staging_bytes_ = 0;
  std::map<std::string, std::unique_ptr<Prepared>> prepared_;  // by group
  absl::StatusOr<Prepared*> PreparedFor(const TransferJob& job, const std::vector<uint64_t>& src,
                                        const std::vector<uint64_t>& dst);
  void DropPrepared(const std::string& group);
  void SyncStreams(int32_t gpu);
  // ABORTED once the round is cancelled, DEADLINE_EXCEEDED past its deadline, else OK.
  absl::Status Interrupted(const TransferJob& job);

  // One NCCL communicator per (group, id) over every GPU of the plan (rank = the plan's GPU
  // index), one rank per local GPU in this process. Built at the first transfer that needs it
  // (all daemons do so in the same round), aborted on any failure and rebuilt with a new id.
  struct Communicator;
  absl::StatusOr<Communicator*> CommunicatorFor(const TransferJob& job);
  void DropCommunicator(const std::string& group);
  std::map<std::string, std::unique_ptr<Communicator>> comms_;  // by group
};

}  // namespace refit
