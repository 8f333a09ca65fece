// The cuda backend's state types, shared by its translation units (cuda_backend.cc: mapping,
// preparing, transferring; cuda_armed.cc: armed rounds). Private to //daemon:cuda_backend.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "daemon/dataplane/cuda/cuda_backend.h"
#include "daemon/dataplane/cuda/device_memory.h"
#include "daemon/dataplane/cuda/event.h"
#include "daemon/dataplane/cuda/host_word.h"
#include "daemon/dataplane/cuda/node_communicator.h"
#include "daemon/dataplane/cuda/staging.h"
#include "daemon/dataplane/cuda/stream.h"
#include "kernels/copy_items.h"
#include "kernels/copy_kernels.h"
#include "kernels/network_schedule.h"

namespace refit {

// The stage of a round that can be armed (launched at PREPARE, let go at TRANSFER): one stage of
// copies inside the node and nothing else (no network steps, which the host drives step by step,
// no later stage, which waits for this one on the host). -1 otherwise.
int ArmableStage(const NodeSchedule& schedule);

// A group's plan as this node executes it, built once per plan and buffer addresses and reused
// round after round: the schedule, its copy items uploaded to each GPU, the staging and the
// events that chain the pipeline.
struct CudaBackend::Prepared {
  struct DeviceWork {
    const CopyItem* items = nullptr;
    const int64_t* units = nullptr;
    int n = 0;
    int64_t total_units = 0;
    bool spread = false;   // LaunchCopyItems' unit order (direct work only: measured there)
    bool aligned = false;  // AlignedOnly: the aligned kernel runs it
    // QuantizingUnitsOf: its block fp8 units run in the quantizing kernel (a thread block per
    // block, read once), launched after the copy kernel: 23.1 -> 8.7 ms for Llama-3-8B bf16 ->
    // block fp8 on one H200 (local_copy_bench --quantizing auto,0); work without any, in the copy
    // kernel built without quantizing code.
    QuantizingUnits quantizing = QuantizingUnits::kNone;
  };
  struct OnGpu {
    DeviceMemory arrays;    // every item of this GPU, one allocation
    StagingBuffer staging;  // registered with NCCL by the group's communicator where asked
    // Per stage: one launch, or two where some items suit the aligned kernel and some do not
    // (the aligned ones through it, the rest through the general kernel: SplitAligned).
    std::vector<std::vector<DeviceWork>> direct;
    std::vector<Event> direct_done;                     // per stage: its direct work finished
    std::vector<std::vector<DeviceWork>> pack, unpack;  // per stage, per step
    // Per stage, per step, on the GPU's timeline (events with timing: the round's log says where
    // the time went): pack done (compute), on the wire (comm), off the wire (comm), unpacked.
    std::vector<std::vector<Event>> packed, wire_begin, moved, unpacked;
    Event start;  // the round's first work on this GPU
  };
  std::shared_ptr<const Plan> plan;
  BufferAddresses src, dst;  // home addresses (each buffer's owner GPU's)
  uint64_t released = 0;     // CudaBackend::released_ before its addresses were resolved
  NodeSchedule schedule;
  std::map<int32_t, OnGpu> gpus;
  // Last: waits for the group's streams before any memory or event above is released.
  StreamFence idle;
};

// One group's resources on this node, leased to one Transfer at a time. Members go in reverse:
// the communicator first (deregistering staging, then its ranks), then the prepared schedule
// (its fence waits for the streams, then staging and items are freed), the streams last.
struct CudaBackend::Group {
  struct Streams {
    Stream compute, comm, direct;
  };
  std::map<int32_t, Streams> streams;  // by GPU
  std::unique_ptr<Prepared> prepared;
  uint64_t generation =
      0;  // schedules prepared so far (PreparedFor): what an armed round was made on
  std::unique_ptr<NodeCommunicator> comm;
};

// A group's armed round (RoundPreparing, ArmAhead): its copies launched at PREPARE behind a stream
// wait for `word`; its TRANSFER stores `go` (Fire), anything else go + 1 (CallOff: the gated copies
// then do nothing); the next arm's go is go + 2. Kept in armed_, apart from the group's lease, so
// that any thread can call it off; created at a group's first arm, kept until the backend goes
// (a few words per group and GPU).
struct CudaBackend::ArmGate {
  HostWord word;                         // mapped for every GPU
  std::map<int32_t, DeviceMemory> gate;  // by GPU: what its gated copies read (LaunchGate)
  std::map<int32_t, HostWord> decided;   // by GPU: what its gate kernel set: go, or 0
  int64_t round = -1;
  int64_t pending = -1;  // the round queued to be armed (RoundPreparing), until armed or called off
  int64_t prepared = -1;  // the last round whose workers answered PREPARE here (WorkersPrepared)
  uint32_t go = 0;
  uint32_t next_go = 2;
  bool armed = false;
  absl::Time until;  // called off then (DisarmLoop) if not let go before: the PREPARE's deadline,
                     // then kArmedAtMost after the workers' answer

  void CallOff() {
    if (!armed) return;
    word.Store(go + 1);
    armed = false;
  }
};

}  // namespace refit
