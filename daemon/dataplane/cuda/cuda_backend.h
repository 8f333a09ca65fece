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
// Three streams per group and GPU: compute (pack, unpack), comm (NCCL), direct (copies inside
// the node). A group's schedule, items, staging and events are built once per plan and buffer
// addresses, and dropped after any failure.
//
// Ownership: every CUDA and NCCL handle has one RAII owner in daemon/cuda/ (streams, events,
// device memory, staging, IPC imports, VMM handles/reservations/maps, NCCL ranks and
// registrations, a device guard, mapped host words); this class only composes them, and its
// destructor is the members' own, in declaration order, after calling off armed rounds and
// joining the threads that arm them and bound them.
//
// Armed rounds (--arm-rounds, by default where MPS shares the GPUs: ArmRounds): a round copied
// within the node is launched while its workers prepare, by a thread of this backend's own, held
// on the GPU by a stream wait for a host word, and let go by its TRANSFER with one host store:
// the launches (cold API calls: 0.05 ms) leave the transfer phase, and PREPARE's answer does not
// wait for them. Anything else calls it off (the gated copies then write nothing): an abort,
// another round's transfer, a rebuilt schedule, any memory released (ArmsHeldOff), the backend's
// end, 100 ms after the workers' answer, or the PREPARE's deadline.
//
// Threads and locks: one mutex, mu_, guards the tables shared between threads (the imports by
// handle and address, the groups' states, the rounds transferring and cancelled). It is held
// only to look up and update those tables, never across a CUDA or NCCL call that can block.
// Concurrent groups are kept apart by leasing: a Transfer takes its group's state (its streams,
// communicator, prepared schedule and staging) out of groups_ under mu_ and works on it alone,
// without the lock; it gives it back when it ends. A second Transfer of the same group while one
// runs is refused. Two groups never share a stream, so one group's NCCL kernels never queue
// behind another group's (which could deadlock across nodes that queued them in other orders).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/dataplane/backend.h"
#include "daemon/dataplane/gpu_ids.h"

namespace refit {

class CudaDriver;
class DeviceGuard;
class NodeCommunicator;
class VmmHandle;

// Whether rounds copied within the node are armed (RoundPreparing): kAuto when every GPU served
// is shared through MPS (one context for all processes). Without MPS, armed work waiting on the
// GPU lets the GPU switch back to the workers' contexts, and being let go costs a switch again:
// on one H200, colocated 1 GB, 0.673 -> 0.746 ms armed without MPS. With MPS the transfer phase
// fell 0.628 -> 0.584 ms (0.80-0.85 of the copy ceiling over four calls), but armed before the
// PREPARE answer the launches grew PREPARE by 0.03-0.28 ms (docs/BENCHMARKS.md). Made
// on a thread of their own while the workers prepare, both phases are shorter armed than not
// under MPS (docs/BENCHMARKS.md): kAuto is refitd's default.
enum class ArmRounds { kAuto, kAlways, kNever };

class CudaBackend : public DataBackend {
 public:
  // `gpus`: the local GPU indices this daemon serves (peer access is enabled among them).
  // `staging_bytes`: the most staging one group's rounds hold on each GPU.
  // `nccl_stream_priority`: NCCL's stream gets the GPU's highest priority, so that its kernels'
  // blocks are scheduled ahead of pending pack and unpack blocks (which slow NCCL by 17% while
  // they run beside it, docs/BENCHMARKS.md). Not yet measured end to end.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Start(
      const std::vector<int32_t>& gpus, int64_t staging_bytes, bool nccl_stream_priority = false,
      bool aligned_copy_kernel = true, ArmRounds arm_rounds = ArmRounds::kNever);
  // Every MappedBuffer it returned must be gone first, and no Transfer running.
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
  // Device memory on the worker's GPU, reachable by that GPU's kernels only (the block rule
  // gathers into and quantizes from it on that GPU alone).
  absl::StatusOr<std::unique_ptr<MappedBuffer>> AllocateScratch(const Worker& worker,
                                                                int64_t bytes) override;
  absl::StatusOr<int32_t> GpuIndex(const std::string& name) override;
  absl::StatusOr<TransferStats> Transfer(const TransferJob& job) override;
  void RoundPreparing(TransferJob job) override;
  bool ArmsRounds() const override { return arm_rounds_; }
  void WorkersPrepared(const std::string& group, int64_t round_id) override;
  // Whether `group`'s work for `round` is armed now (launched, waiting to be let go).
  bool Armed(const std::string& group, int64_t round) ABSL_LOCKS_EXCLUDED(armed_mu_);
  void Cancel(const std::string& group, int64_t round_id, const std::string& reason) override;
  absl::StatusOr<std::string> NewCommunicatorId() override;
  CommunicatorCounts Communicators() const override {
    return {comms_built_.load(), comms_aborted_.load()};
  }

  struct Allocation;  // an opened IPC handle, with its imports on other GPUs
  struct VmmMapping;  // an imported and mapped VMM range
  struct Prepared;    // a group's schedule on this node, ready to run

 private:
  // Start's step for GPU `g` (current): its names, its stream priorities, the kernels loaded.
  absl::Status SetUpGpu(int32_t g);
  struct Group;  // a group's streams, communicator and prepared schedule
  class GroupLease;
  CudaBackend() = default;
  // `address` (in its owner GPU's import) as GPU `gpu`'s kernels must use it. VMM memory is
  // mapped for every GPU at one address: returned unchanged.
  absl::StatusOr<uint64_t> AddressOn(int32_t gpu, uint64_t address) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes a released import from the tables (the deleters of Allocation and VmmMapping).
  void Forget(const std::string& handle, uint64_t base) ABSL_LOCKS_EXCLUDED(mu_);
  void ForgetVmm(uint64_t base) ABSL_LOCKS_EXCLUDED(mu_);
  // Calls off every group's armed work: before work is launched that could queue behind an
  // armed wait.
  void DisarmAll() ABSL_LOCKS_EXCLUDED(armed_mu_);
  // While one lives nothing is armed: every armed round is called off when it is made, and Arm
  // refuses. Held across releasing memory and aborting NCCL, which may wait for the whole GPU
  // (cudaFree does), and so would wait for armed work.
  class ArmsHeldOff {
   public:
    explicit ArmsHeldOff(CudaBackend* b) ABSL_LOCKS_EXCLUDED(b->armed_mu_);
    ~ArmsHeldOff();
    ArmsHeldOff(const ArmsHeldOff&) = delete;
    ArmsHeldOff& operator=(const ArmsHeldOff&) = delete;

   private:
    CudaBackend* b_;
  };
  // A registration's VMM range `range` imported, mapped at one address readable and writable by
  // every GPU served, and recorded (vmm_by_base_) until its last buffer is gone.
  absl::StatusOr<std::shared_ptr<VmmMapping>> MapVmmRange(const v1::RegisterWorkerRequest& request,
                                                          int range, std::span<const Fd> fds)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The GPU a VMM range lives on: its own gpu_uuid, else the worker's; one this daemon serves.
  absl::StatusOr<int32_t> VmmRangeDevice(const v1::RegisterWorkerRequest& request,
                                         const v1::VmmRange& range, const std::string& what);
  // An address range reserved for the imported chunks, each mapped in order, access granted.
  absl::StatusOr<std::unique_ptr<VmmMapping>> ReserveAndMap(
      const CudaDriver& driver, int32_t device, const v1::VmmRange& range,
      const std::vector<VmmHandle>& handles, size_t alignment, const std::string& what) const;
  bool Serves(int32_t gpu) const;
  // The group's streams on every GPU served, made at its first transfer.
  absl::Status EnsureStreams(Group& g);
  // The group's schedule for the job's plan and these buffer addresses: the one prepared before
  // where it still fits, else a new one (the old one dropped: DropPrepared).
  absl::StatusOr<Prepared*> PreparedFor(Group& g, const TransferJob& job,
                                        const std::vector<uint64_t>& src,
                                        const std::vector<uint64_t>& dst) ABSL_LOCKS_EXCLUDED(mu_);
  // PreparedFor's first step: the node's schedule, with each GPU's staging allocated.
  absl::Status BuildSchedule(Prepared& p, const TransferJob& job, const std::vector<uint64_t>& src,
                             const std::vector<uint64_t>& dst) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for the group's streams, deregisters its staging from NCCL, frees its schedule.
  void DropPrepared(Group& g) ABSL_LOCKS_EXCLUDED(mu_, armed_mu_);
  // The group's state for ArmAhead or WorkersPrepared to launch on (leased, and warming_: its
  // Transfer waits for it), or null before its first round (no streams, no schedule yet) or while
  // a transfer of it runs. `released`: released_ as it was then. GiveBackWarmed returns it.
  std::unique_ptr<Group> TakeToWarm(const std::string& group, uint64_t* released = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  void GiveBackWarmed(const std::string& group, std::unique_ptr<Group> g) ABSL_LOCKS_EXCLUDED(mu_);
  // Arms the rounds RoundPreparing queued, one at a time, until the backend goes.
  void ArmLoop() ABSL_LOCKS_EXCLUDED(armed_mu_);
  // Takes the group (as a Transfer would, marked warming_: its Transfer waits) and arms `job`'s
  // round where its prepared schedule fits it; the group is given back either way.
  void ArmAhead(const TransferJob& job) ABSL_LOCKS_EXCLUDED(mu_, armed_mu_);
  // Launches the group's prepared round (ArmableStage) for `job`'s round behind a wait for the
  // group's host word (its ArmGate): Fire lets it go; CallOff, DisarmAll and DisarmLoop call it
  // off. CANCELLED where the round was called off before it was armed.
  absl::Status Arm(Group& g, const TransferJob& job) ABSL_LOCKS_EXCLUDED(armed_mu_);
  // Lets `group`'s work armed for `round` go (true), or finds none armed for it (false).
  bool Fire(const std::string& group, int64_t round, uint32_t* go) ABSL_LOCKS_EXCLUDED(armed_mu_);
  // Calls off `group`'s armed work (of `round` only, when given); given a round, also its arm still
  // queued or under way (it then arms nothing).
  void CallOff(const std::string& group, std::optional<int64_t> round)
      ABSL_LOCKS_EXCLUDED(armed_mu_);
  // The GPUs among `gpus` whose gate did not let `group`'s work go (go): "" when all did.
  std::string GatesMissed(const std::string& group, const std::set<int32_t>& gpus, uint32_t go)
      ABSL_LOCKS_EXCLUDED(armed_mu_);
  // Calls off armed rounds past their bound (ArmGate::until); runs while arm_rounds_, until the
  // backend goes.
  void DisarmLoop() ABSL_LOCKS_EXCLUDED(armed_mu_);
  // One NCCL communicator per (group, id) over every GPU of the plan (rank = the plan's GPU
  // index), one rank per local GPU in this process. Built at the first transfer that needs it
  // (all daemons do so in the same round), aborted on any failure and rebuilt with a new id.
  absl::Status CommunicatorFor(Group& g, const TransferJob& job);
  void DropCommunicator(const std::string& group, Group& g);
  // The steps of Transfer, in its order. Those given `guard` switch GPUs through Transfer's own
  // guard, which restores the caller's device once, when the transfer ends.
  // Registers each GPU's staging with NCCL (--nccl-register) and waits until NCCL is done.
  absl::Status RegisterStaging(const TransferJob& job, const Prepared& p, NodeCommunicator& comm)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Transfer once its schedule and communicator are ready: the round's work let go at its start
  // (`fired`, with the gates' `go`) or launched stage by stage, waited for, and logged.
  absl::StatusOr<TransferStats> RunPrepared(const TransferJob& job, const Group& g,
                                            const Prepared& p, NodeCommunicator* comm, bool fired,
                                            uint32_t go, absl::Time leased, absl::Time started,
                                            DeviceGuard& guard) ABSL_LOCKS_EXCLUDED(mu_, armed_mu_);
  // Waits for the round's work armed at PREPARE, now let go; false where some GPU's gate did not
  // let it go (the round is then launched as usual).
  absl::StatusOr<bool> ArmedWorkRan(const TransferJob& job, const Group& g, const Prepared& p,
                                    uint32_t go) ABSL_LOCKS_EXCLUDED(mu_, armed_mu_);
  // Marks the round's start on each GPU's compute stream (the round's log times from it).
  absl::Status RecordStarts(const Group& g, const Prepared& p, DeviceGuard& guard);
  // Launches one stage: the first packs, the copies inside the node, then every network step.
  // Returns the GPUs that work on it.
  absl::StatusOr<std::set<int32_t>> LaunchStage(const TransferJob& job, const Group& g,
                                                const Prepared& p, int stage,
                                                NodeCommunicator* comm, DeviceGuard& guard)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The packs of the steps that fit in staging at once (depth), on the compute streams.
  absl::Status PackFirstSteps(const Group& g, const Prepared& p, int stage, DeviceGuard& guard,
                              std::set<int32_t>& busy);
  // The stage's copies inside the node, on the direct streams.
  absl::Status LaunchDirectCopies(const Group& g, const Prepared& p, int stage, DeviceGuard& guard,
                                  std::set<int32_t>& busy);
  // Network step k: sends after their pack, the NCCL operations, the wait for them, the unpack.
  absl::Status RunNetworkStep(const TransferJob& job, const Group& g, const Prepared& p, int stage,
                              int32_t k, NodeCommunicator* comm, DeviceGuard& guard)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Step k's sends and receives of every local GPU, in one NCCL group.
  absl::Status PostNetworkOps(const Group& g, const Prepared& p, int stage, int32_t k,
                              NodeCommunicator* comm, DeviceGuard& guard);
  // Step k's unpack once off the wire, and the pack of step k + depth into the staging it freed.
  absl::Status UnpackAndPackNext(const Group& g, const Prepared& p, int stage, int32_t k,
                                 DeviceGuard& guard);
  // Until every stream `busy` GPUs ran the stage on is idle, or the round is interrupted (the
  // deadline, Cancel, an NCCL error).
  absl::Status WaitForStage(const TransferJob& job, const Group& g, const std::set<int32_t>& busy,
                            int stage, NodeCommunicator* comm) ABSL_LOCKS_EXCLUDED(mu_);
  // ABORTED once the round is cancelled, DEADLINE_EXCEEDED past its deadline, else OK.
  absl::Status Interrupted(const TransferJob& job) ABSL_LOCKS_EXCLUDED(mu_);

  // Set by Start, read-only afterwards (no lock).
  std::vector<int32_t> gpus_;
  std::vector<GpuName> names_;                         // of gpus_, for GpuIndex
  std::map<int32_t, std::pair<int, int>> priorities_;  // GPU -> (least, greatest) stream priority
  bool nccl_stream_priority_ = false;
  bool aligned_copy_kernel_ = true;
  bool arm_rounds_ = false;  // ArmRounds resolved at Start
  int64_t staging_bytes_ = 0;

  std::atomic<int64_t> comms_built_{0}, comms_aborted_{0};  // for Communicators()
  absl::Mutex mu_;
  std::map<std::string, std::weak_ptr<Allocation>> opened_ ABSL_GUARDED_BY(mu_);  // by handle bytes
  std::map<uint64_t, std::weak_ptr<Allocation>> by_base_
      ABSL_GUARDED_BY(mu_);                                        // owner-context base
  std::map<uint64_t, uint64_t> vmm_by_base_ ABSL_GUARDED_BY(mu_);  // VMM range base -> its bytes
  // Plan scratch: base -> (bytes, GPU). Other GPUs get address 0 for it (no descriptor of theirs
  // names it).
  std::map<uint64_t, std::pair<uint64_t, int32_t>> scratch_by_base_ ABSL_GUARDED_BY(mu_);
  void ForgetScratch(uint64_t base) ABSL_LOCKS_EXCLUDED(mu_);
  // Releases of memory so far (Forget, ForgetVmm, ForgetScratch): a schedule prepared before one
  // may hold another GPU's import of memory that is gone, at a home address now someone else's
  // (Prepared::released).
  uint64_t released_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::pair<std::string, int64_t>> active_
      ABSL_GUARDED_BY(mu_);  // rounds transferring now
  std::map<std::pair<std::string, int64_t>, std::string> cancelled_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> leased_ ABSL_GUARDED_BY(mu_);  // groups whose state a Transfer holds
  // Groups whose state ArmAhead or WorkersPrepared holds while it launches (also in leased_): a
  // Transfer waits for them rather than fail as if another transfer ran.
  std::set<std::string> warming_ ABSL_GUARDED_BY(mu_);
  // Armed rounds, by group (ArmGate): apart from the groups' leases, so that any thread can call
  // them off, a group leased or not. Taken after mu_ where both are held; nothing else under it.
  // Declared before groups_: destroyed after them (the groups' fences wait for streams whose
  // armed work reads these words until called off, which the destructor does first).
  // An armed round not let go within kArmedAtMost of its workers' answer (WorkersPrepared), or
  // by its PREPARE's deadline while they prepare, is called off (DisarmLoop): its TRANSFER, late,
  // launches the round itself.
  static constexpr absl::Duration kArmedAtMost = absl::Milliseconds(100);
  struct ArmGate;
  absl::Mutex armed_mu_ ABSL_ACQUIRED_AFTER(mu_);
  absl::CondVar armed_changed_;
  std::map<std::string, std::unique_ptr<ArmGate>> armed_ ABSL_GUARDED_BY(armed_mu_);
  // Rounds RoundPreparing queued for ArmLoop: one per group (a newer PREPARE replaces an older).
  std::map<std::string, TransferJob> to_arm_ ABSL_GUARDED_BY(armed_mu_);
  absl::CondVar arm_queued_;
  int held_off_ ABSL_GUARDED_BY(armed_mu_) = 0;  // ArmsHeldOff alive
  bool stopping_ ABSL_GUARDED_BY(armed_mu_) = false;
  // By group (absent or null while leased: GroupLease).
  std::map<std::string, std::unique_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  std::thread disarmer_;  // DisarmLoop; last: joined by the destructor before anything goes
  std::thread armer_;     // ArmLoop; likewise
};

}  // namespace refit
