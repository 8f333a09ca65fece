// Lowering routed transfers into copy descriptors, apart from routing them, so that the two can run
// on two threads: routing is a sequential greedy walk (each choice depends on the bytes every
// earlier one put on each link), lowering depends on nothing but the transfer itself. Batches
// are lowered in the order they were made, so the descriptors (and the plan) are the same whether
// the lowering runs on a thread of its own or on the caller's.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "plan/layout.h"
#include "plan/lower.h"
#include "plan/message_cutter.h"
#include "plan/plan.h"

namespace refit {

// "Copy box `box` from piece `from_piece` to destination piece `to_piece`", as routing chose it.
struct RoutedTransfer {
  int32_t box = 0;         // index into its batch's boxes: a fan-out shares one
  int32_t from_piece = 0;  // of the source layout, or of the destination layout (from_destination)
  int32_t to_piece = 0;    // of the destination layout
  int32_t group = 0;  // the (stage, sending GPU, receiving GPU) group: the descriptors' `message`
  CopyOp op = CopyOp::kCopy;  // kQuantize, kScale: quantized in the sender's pack step
  bool from_destination = false;
  const Quantization* quant = nullptr;  // op != kCopy
};

// Fields two threads write apart are kept this far apart.
inline constexpr size_t kCacheLineBytes = 64;

class TransferLowerer {
 public:
  // Appends to `out`, which the caller must not touch until Drain() returns, each descriptor's
  // `message` the id `cutter` gives it (which the caller likewise leaves alone until then).
  // `threaded`: lower on a thread of its own (else on the caller's, as batches fill).
  TransferLowerer(const Layout& source, const Layout& destination, int64_t max_message_bytes,
                  DescriptorTable& out, MessageCutter& cutter, bool threaded);
  ~TransferLowerer();  // drains
  TransferLowerer(const TransferLowerer&) = delete;
  TransferLowerer& operator=(const TransferLowerer&) = delete;

  // Hands the batch being filled over when it is full. Box indices are a batch's own: call it
  // only where no index from AddBox is still to be used.
  void SubmitIfFull();
  // The index by which transfers of the current batch name `box`. `key` >= 0 is the caller's
  // name for it (equal keys, equal boxes, until ForgetBoxKeys()): a box that several transfers
  // share (a region several nodes need) is then stored once per batch, not once per transfer.
  int32_t AddBox(const Box& box, int32_t key = -1) {
    if (key < 0) return Push(box);
    if (static_cast<size_t>(key) >= box_keys_.size()) box_keys_.resize(key + 1);
    BoxKey& k = box_keys_[key];
    if (k.generation != box_generation_) k = {box_generation_, Push(box)};
    return k.index;
  }
  // Keys name other boxes from now on.
  void ForgetBoxKeys() { ++box_generation_; }
  void Add(const RoutedTransfer& transfer) { filling_.transfers.push_back(transfer); }

  // Returns once every transfer added so far is in `out`: the first lowering error, if any.
  absl::Status Drain();

 private:
  struct Batch {
    std::vector<Box> boxes;
    std::vector<RoutedTransfer> transfers;
  };
  int32_t Push(const Box& box) {
    filling_.boxes.push_back(box);
    return static_cast<int32_t>(filling_.boxes.size() - 1);
  }
  void Submit();
  // Until `done` (under mu_) holds, pre-faults the pages the worker will write next; blocks once
  // there are none. The caller's, threaded only.
  void WaitPrefaulting(bool (*done)(TransferLowerer*));
  bool PrefaultAhead();
  void Lower(const Batch& batch);  // on one thread at a time: the worker, or the caller
  void Work();
  const PieceView& ViewOfPiece(const Layout& layout, int32_t piece, int side);

  const Layout& src_;
  const Layout& dst_;
  const int64_t max_message_bytes_;
  DescriptorTable& out_;
  MessageCutter& cutter_;

  // The caller's, written for every transfer: apart from the fields above, which the worker reads
  // for every descriptor.
  alignas(kCacheLineBytes) Batch filling_;
  // The caller's: the index in `filling_` of each key's box, valid while its generation is the
  // current one (a new batch, or ForgetBoxKeys(), starts another).
  struct BoxKey {
    uint64_t generation = 0;
    int32_t index = 0;
  };
  std::vector<BoxKey> box_keys_;
  uint64_t box_generation_ = 1;
  // Lowering state: the worker's while it runs, else the caller's. On cache lines of its own: the
  // worker writes it for every descriptor and the caller its batch for every transfer, and sharing
  // a line made each core wait for the other's writes.
  alignas(kCacheLineBytes) absl::Status status_;
  std::vector<CopyDescriptor> lowered_, split_;  // one transfer's, before they are packed
  struct CachedView {
    const Layout* layout = nullptr;
    int32_t piece = -1;
    PieceView view;
  };
  CachedView view_cache_[2];

  // Writing the descriptors into fresh memory costs a page fault per 4 KiB, about half of the
  // worker's time. While the caller would wait for the worker, it faults in the pages of the
  // descriptors already routed (MADV_POPULATE_WRITE: the kernel's work; contents unchanged).
  // Only inside `out_`'s reserve: the worker stops it before `out_` could outgrow the reserve.
  void ArmPrefaulting();   // the caller's, while the worker is idle
  void StopPrefaulting();  // the worker's
  // The caller's: Drain() returned, no batch handed over since. On a line apart from the
  // lowering state above.
  alignas(kCacheLineBytes) bool drained_ = false;
  uintptr_t out_storage_ = 0;                       // out_.data() when made
  uintptr_t prefault_next_ = 0, prefault_end_ = 0;  // the caller's: next page, the reserve's end
  const uintptr_t page_ = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uintptr_t PageUp(uintptr_t a) const { return (a + page_ - 1) & ~(page_ - 1); }
  uintptr_t PageDown(uintptr_t a) const { return a & ~(page_ - 1); }
  size_t routed_ = 0;                    // the caller's: out_.size() + transfers handed over
  std::atomic<size_t> lowered_size_{0};  // out_.size() after the worker's last batch
  absl::Mutex prefault_mu_;              // held while pre-faulting
  bool prefault_stopped_ ABSL_GUARDED_BY(prefault_mu_) = false;
  bool prefault_stopping_ = false;  // the worker's copy

  absl::Mutex mu_;
  std::deque<Batch> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<Batch> spare_ ABSL_GUARDED_BY(mu_);  // emptied batches, their storage reused
  bool busy_ ABSL_GUARDED_BY(mu_) = false;         // the worker holds a batch
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;
};

}  // namespace refit
