// Armed rounds (daemon/dataplane/cuda/cuda_backend.h): a round copied within the node launched
// while its workers prepare, on a thread of the backend's own (off the PREPARE answer's path), let
// go by its TRANSFER with one store to a host word, called off otherwise.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/base/log_later.h"
#include "daemon/base/logging.h"
#include "daemon/dataplane/cuda/cuda_backend.h"
#include "daemon/dataplane/cuda/cuda_backend_state.h"
#include "daemon/dataplane/cuda/cuda_driver.h"
#include "daemon/dataplane/cuda/cuda_status.h"
#include "daemon/dataplane/cuda/device_guard.h"
#include "kernels/copy_kernels.h"
#include "plan/status_macros.h"

namespace refit {

int ArmableStage(const NodeSchedule& schedule) {
  if (schedule.uses_network) return -1;
  int found = -1;
  for (int stage = 0; stage < kMaxStages; ++stage) {
    const StageSchedule& s = schedule.stages[stage];
    if (!s.steps.empty()) return -1;
    if (s.direct.empty()) continue;
    if (found >= 0) return -1;
    found = stage;
  }
  return found;
}

void CudaBackend::DisarmLoop() {
  absl::MutexLock lock(&armed_mu_);
  while (!stopping_) {
    const absl::Time now = absl::Now();
    absl::Time next = absl::InfiniteFuture();
    for (auto& [group, a] : armed_) {
      if (!a->armed) continue;
      if (a->until <= now) {
        a->CallOff();
        LogLater("data", spdlog::level::warn,
                 "group \"{}\" round {}: armed at PREPARE and not let go {}: called off (its "
                 "TRANSFER, if it comes, "
                 "launches the round itself)",
                 group, a->round,
                 a->prepared == a->round
                     ? absl::StrCat("within ", absl::ToInt64Milliseconds(kArmedAtMost),
                                    " ms of its workers' answer")
                     : std::string("by its PREPARE's deadline"));
      } else {
        next = std::min(next, a->until);
      }
    }
    armed_changed_.WaitWithDeadline(&armed_mu_, next);
  }
}

bool CudaBackend::Fire(const std::string& group, int64_t round, uint32_t* go) {
  absl::MutexLock lock(&armed_mu_);
  auto it = armed_.find(group);
  if (it == armed_.end() || !it->second->armed || it->second->round != round) return false;
  ArmGate& a = *it->second;
  *go = a.go;
  a.word.Store(a.go);
  a.armed = false;
  return true;
}

void CudaBackend::CallOff(const std::string& group, std::optional<int64_t> round) {
  absl::MutexLock lock(&armed_mu_);
  auto it = armed_.find(group);
  if (it == armed_.end()) return;
  ArmGate& a = *it->second;
  if (round.has_value() && a.pending == *round) a.pending = -1;
  if (!round.has_value() || a.round == *round) a.CallOff();
}

bool CudaBackend::Armed(const std::string& group, int64_t round) {
  absl::MutexLock lock(&armed_mu_);
  auto it = armed_.find(group);
  return it != armed_.end() && it->second->armed && it->second->round == round;
}

void CudaBackend::DisarmAll() {
  absl::MutexLock lock(&armed_mu_);
  for (auto& [group, a] : armed_) a->CallOff();
}

CudaBackend::ArmsHeldOff::ArmsHeldOff(CudaBackend* b) : b_(b) {
  // Called off, the armed work refers to no memory: what is freed meanwhile waits for nothing.
  absl::MutexLock lock(&b_->armed_mu_);
  ++b_->held_off_;
  for (auto& [group, a] : b_->armed_) a->CallOff();
}

CudaBackend::ArmsHeldOff::~ArmsHeldOff() {
  absl::MutexLock lock(&b_->armed_mu_);
  --b_->held_off_;
}

void CudaBackend::RoundPreparing(TransferJob job) {
  if (!arm_rounds_) return;
  const std::string group = job.group;
  std::optional<TransferJob>
      replaced;  // dropped after the lock: it may hold workers' last references
  absl::MutexLock lock(&armed_mu_);
  if (stopping_) return;
  std::unique_ptr<ArmGate>& slot = armed_[group];
  if (slot == nullptr) slot = std::make_unique<ArmGate>();
  slot->pending = job.round_id;
  slot->prepared =
      -1;  // its workers answer after this (WorkersPrepared): not an older round's answer
  if (auto it = to_arm_.find(group); it != to_arm_.end()) {
    replaced = std::exchange(it->second, std::move(job));
  } else {
    to_arm_.emplace(group, std::move(job));
  }
  arm_queued_.Signal();
}

void CudaBackend::ArmLoop() {
  for (;;) {
    std::optional<TransferJob> job;
    {
      absl::MutexLock lock(&armed_mu_);
      while (!stopping_ && to_arm_.empty()) arm_queued_.Wait(&armed_mu_);
      if (stopping_) break;
      job = std::move(to_arm_.begin()->second);
      to_arm_.erase(to_arm_.begin());
    }
    ArmAhead(*job);
  }
  std::map<std::string, TransferJob> left;  // released here, not under the lock
  absl::MutexLock lock(&armed_mu_);
  left.swap(to_arm_);
}

std::unique_ptr<CudaBackend::Group> CudaBackend::TakeToWarm(const std::string& group,
                                                            uint64_t* released) {
  absl::MutexLock lock(&mu_);
  if (released != nullptr) *released = released_;
  auto it = groups_.find(group);
  if (leased_.contains(group) || it == groups_.end() || it->second == nullptr ||
      it->second->prepared == nullptr) {
    return nullptr;
  }
  leased_.insert(group);
  warming_.insert(group);
  return std::move(it->second);
}

void CudaBackend::GiveBackWarmed(const std::string& group, std::unique_ptr<Group> g) {
  absl::MutexLock lock(&mu_);
  groups_[group] = std::move(g);
  leased_.erase(group);
  warming_.erase(group);
}

void CudaBackend::ArmAhead(const TransferJob& job) {
  uint64_t released = 0;
  std::unique_ptr<Group> g = TakeToWarm(job.group, &released);  // none: too early, or too late
  if (g == nullptr) {
    CallOff(job.group, job.round_id);  // nothing armed for it: no longer pending (WorkersPrepared)
    return;
  }
  CallOff(job.group, std::nullopt);  // armed for an earlier round that never transferred
  const Prepared& p = *g->prepared;
  absl::Status armed = absl::CancelledError("its schedule is not armable");
  if (p.plan == job.plan && p.released == released && ArmableStage(p.schedule) >= 0 &&
      p.src == AddressesOf(job.src) && p.dst == AddressesOf(job.dst)) {
    armed = Arm(*g, job);
  }
  if (!armed.ok()) {
    CallOff(job.group,
            job.round_id);  // what was launched does nothing; Transfer launches the round
    if (!absl::IsCancelled(armed)) {
      Logger("data")->warn(
          "group \"{}\" round {}: not made ready at PREPARE ({}); launched at TRANSFER instead",
          job.group, job.round_id, std::string(armed.message()));
    }
  }
  GiveBackWarmed(job.group, std::move(g));
}

void CudaBackend::WorkersPrepared(const std::string& group, int64_t round_id) {
  if (arm_rounds_) {
    absl::MutexLock lock(&armed_mu_);
    auto it = armed_.find(group);
    if (it != armed_.end()) {
      ArmGate& a = *it->second;
      a.prepared = round_id;
      if (a.armed && a.round == round_id) {
        a.until = std::min(a.until, absl::Now() + kArmedAtMost);
        armed_changed_.Signal();
        return;  // the GPU switches to this context when it is let go
      }
      if (a.pending == round_id) return;  // about to be armed (Arm bounds it from now)
    }
  }
  std::unique_ptr<Group> g = TakeToWarm(group);
  if (g == nullptr) return;
  // An empty kernel on each GPU the group's last round used, so that the GPU switches from the
  // workers' contexts to this one now (tests/bench/ipc_copy_bench,
  // "after_other_process_and_a_small_kernel"). Nothing to wait for; a failure to launch is left
  // to the transfer's own launches to report.
  {
    DeviceGuard guard;
    for (const auto& [gpu, on] : g->prepared->gpus) {
      if (!on.start || !g->streams.contains(gpu) || !guard.Set(gpu).ok()) continue;
      (void)LaunchNothing(g->streams.at(gpu).direct.get());
    }
  }
  GiveBackWarmed(group, std::move(g));
}

absl::Status CudaBackend::Arm(Group& g, const TransferJob& job) {
  auto driver = CudaDriver::Get();
  if (!driver.ok()) return driver.status();
  const Prepared& p = *g.prepared;
  const int stage = ArmableStage(p.schedule);
  ArmGate* a = nullptr;
  {
    absl::MutexLock lock(&armed_mu_);
    if (stopping_) return absl::CancelledError("the backend is stopping");
    std::unique_ptr<ArmGate>& slot = armed_[job.group];
    if (slot == nullptr) slot = std::make_unique<ArmGate>();
    a = slot.get();  // stable until the backend goes; its words and gates are made by this group's
                     // lease holder alone, while it is not armed
  }
  // The words and gates first (none is touched by others while the gate is not armed).
  for (const auto& [gpu, w] : p.schedule.stages[stage].direct) {
    if (!a->word) {
      auto word = HostWord::Create(gpu);
      if (!word.ok()) return word.status();
      a->word = *std::move(word);
    }
    if (!a->gate.contains(gpu)) {
      auto gate = DeviceMemory::Allocate(gpu, sizeof(uint32_t));
      if (!gate.ok()) return Annotate(gate.status(), "an armed round's gate");
      a->gate.emplace(gpu, *std::move(gate));
    }
    if (!a->decided.contains(gpu)) {
      auto decided = HostWord::Create(gpu);
      if (!decided.ok()) return decided.status();
      a->decided.emplace(gpu, *std::move(decided));
    }
  }
  uint32_t go = 0;
  {
    // Armed before anything is launched: whatever is launched below waits for this go, and is
    // called off by the caller if a launch fails part-way.
    absl::MutexLock lock(&armed_mu_);
    if (stopping_) return absl::CancelledError("the backend is stopping");
    if (a->pending != job.round_id) return absl::CancelledError("called off before it was armed");
    a->pending = -1;
    if (held_off_ > 0) return absl::CancelledError("memory is being released");
    go = a->next_go;
    a->next_go += 2;
    if (a->next_go == 0) a->next_go = 2;  // 0 is never a go (a gate set to 0 copies nothing)
    a->round = job.round_id;
    a->go = go;
    a->armed = true;
    // Armed while the workers prepare: bounded by the PREPARE's deadline (its failure or abort
    // calls it off sooner), and by kArmedAtMost once they answered (WorkersPrepared).
    a->until = a->prepared == job.round_id ? absl::Now() + kArmedAtMost : job.deadline;
    armed_changed_.Signal();
  }
  DeviceGuard guard;
  for (const auto& [gpu, w] : p.schedule.stages[stage].direct) {
    const Prepared::OnGpu& on = p.gpus.at(gpu);
    auto* gate = static_cast<uint32_t*>(a->gate.at(gpu).get());
    const cudaStream_t stream = g.streams.at(gpu).direct.get();
    REFIT_RETURN_IF_ERROR(guard.Set(gpu));
    REFIT_RETURN_IF_ERROR(driver.value()->Check(
        driver.value()->StreamWaitValue32(stream, reinterpret_cast<CUdeviceptr>(a->word.device()),
                                          go, CU_STREAM_WAIT_VALUE_GEQ),
        "cuStreamWaitValue32"));
    a->decided.at(gpu).Store(0);
    REFIT_CUDA_RETURN_IF_ERROR(
        LaunchGate(a->word.device(), go, gate, a->decided.at(gpu).device(), stream),
        "the armed round's gate");
    // The round's first work on this GPU: when it was let go.
    REFIT_CUDA_RETURN_IF_ERROR(cudaEventRecord(on.start.get(), stream), "cudaEventRecord");
    for (const auto& d : on.direct[stage]) {
      REFIT_CUDA_RETURN_IF_ERROR(LaunchCopyItems(d.items, d.units, d.n, d.total_units, stream,
                                                 d.spread, d.aligned, gate, go, d.quantizing),
                                 "copy (armed)");
    }
    REFIT_CUDA_RETURN_IF_ERROR(cudaEventRecord(on.direct_done[stage].get(), stream),
                               "cudaEventRecord");
  }
  return absl::OkStatus();
}

std::string CudaBackend::GatesMissed(const std::string& group, const std::set<int32_t>& gpus,
                                     uint32_t go) {
  ArmGate* a = nullptr;
  {
    absl::MutexLock lock(&armed_mu_);
    auto it = armed_.find(group);
    if (it == armed_.end()) return "(all: no gate)";
    a = it->second.get();
  }
  // Read without the lock: this group's lease holder (the caller) alone changes its gates.
  std::string missed;
  for (int32_t gpu : gpus) {
    auto d = a->decided.find(gpu);
    if (d == a->decided.end() || d->second.Load() != go)
      absl::StrAppend(&missed, missed.empty() ? "" : ", ", gpu);
  }
  return missed;
}

}  // namespace refit
