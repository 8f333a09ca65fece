#include "plan/transfer_lowering.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

namespace refit {
namespace {

// Transfers per batch: large enough that handing one over costs nothing next to lowering it,
// small enough that the worker starts early and a few batches in flight are a few MB.
constexpr size_t kBatchTransfers = 16384;
// Batches queued before the router waits for the worker: bounds the memory in flight.
constexpr size_t kMaxQueuedBatches = 8;
// Pre-faulted at a time: a fraction of a millisecond, so the caller sees a batch's room soon.
constexpr uintptr_t kPrefaultBytes = uintptr_t{1} << 20;
// Room left in the descriptors' reserve, in descriptors, below which pre-faulting stops: the
// lowering may then move them, and pre-faulting must touch only their memory.
constexpr size_t kPrefaultMargin = 4096;
// Bytes of one descriptor in the plan's storage.
constexpr uintptr_t kBytes = DescriptorTable::kBytesPerDescriptor;

// ViewOf's common case, inline: a non-empty piece whose tensor box has the shape of its buffer box
// (less leading dimensions of extent 1: an expert's matrix in a stacked [experts, rows, cols]
// buffer) is the buffer's row-major strides from the buffer box's origin. One per destination
// piece, millions of them, where ViewOf's general walk and its status cost more than lowering
// the copy.
bool SameShapeView(const Box& tensor_box, const Box& buffer_box, const Dims& buffer_shape,
                   PieceView& view) {
  const int rank = buffer_box.rank, extra = buffer_box.rank - tensor_box.rank;
  if (buffer_shape.rank != rank || extra < 0) return false;
  for (int d = 0; d < extra; ++d) {
    if (buffer_box.shape[d] != 1) return false;
  }
  for (int d = 0; d < tensor_box.rank; ++d) {
    if (tensor_box.shape[d] != buffer_box.shape[extra + d] || tensor_box.shape[d] == 0) {
      return false;
    }
  }
  int64_t stride = 1, offset = 0;
  view.strides.rank = tensor_box.rank;
  for (int d = rank - 1; d >= 0; --d) {
    if (d >= extra) view.strides.v[d - extra] = stride;
    offset += buffer_box.origin[d] * stride;
    stride *= buffer_shape.v[d];
  }
  view.offset = offset;
  return true;
}

}  // namespace

TransferLowerer::TransferLowerer(const Layout& source, const Layout& destination,
                                 int64_t max_message_bytes, DescriptorTable& out,
                                 MessageCutter& cutter, bool threaded)
    : src_(source),
      dst_(destination),
      max_message_bytes_(max_message_bytes),
      out_(out),
      cutter_(cutter) {
  if (threaded) {
    ArmPrefaulting();
    worker_ = std::thread([this] { Work(); });
  }
}

void TransferLowerer::ArmPrefaulting() {
  out_storage_ = reinterpret_cast<uintptr_t>(out_.data());
  routed_ = out_.size();
  lowered_size_.store(out_.size(), std::memory_order_relaxed);
  prefault_next_ = PageUp(out_storage_ + out_.size() * kBytes);
  prefault_end_ = PageDown(out_storage_ + out_.capacity() * kBytes);
  prefault_stopping_ = false;
  absl::MutexLock lock(&prefault_mu_);
  prefault_stopped_ = false;
}

TransferLowerer::~TransferLowerer() {
  (void)Drain();
  if (worker_.joinable()) {
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
    }
    worker_.join();
  }
}

void TransferLowerer::SubmitIfFull() {
  if (filling_.transfers.size() >= kBatchTransfers) Submit();
}

void TransferLowerer::Submit() {
  ++box_generation_;  // the boxes stay with the batch
  if (filling_.transfers.empty()) {
    filling_.boxes.clear();
    return;
  }
  if (!worker_.joinable()) {
    Lower(filling_);
    filling_.boxes.clear();
    filling_.transfers.clear();
    return;
  }
  // The worker is idle since Drain(), after which the caller may have added to `out_` itself.
  if (drained_) ArmPrefaulting();
  drained_ = false;
  // Waits only when the worker has fallen behind by several batches: bounds the memory in flight.
  // No deadline here or below: both sides are this planner's own threads doing CPU work on
  // batches of bounded size, with no I/O and no other process, so each wait ends when the other
  // side finishes its batch.
  WaitPrefaulting(+[](TransferLowerer* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
    return self->queue_.size() < kMaxQueuedBatches;
  });
  // Each transfer is at least one descriptor: their pages will be written.
  routed_ += filling_.transfers.size();
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(filling_));
  if (!spare_.empty()) {
    filling_ = std::move(spare_.back());
    spare_.pop_back();
  } else {
    filling_ = Batch();
  }
}

absl::Status TransferLowerer::Drain() {
  Submit();
  if (worker_.joinable()) {
    WaitPrefaulting(+[](TransferLowerer* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
      return self->queue_.empty() && !self->busy_;
    });
    drained_ = true;
  }
  return status_;
}

void TransferLowerer::WaitPrefaulting(bool (*done)(TransferLowerer*)) {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (done(this)) return;
    }
    if (!PrefaultAhead()) break;
  }
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(done, this));
}

void TransferLowerer::StopPrefaulting() {
  prefault_stopping_ = true;
  absl::MutexLock lock(&prefault_mu_);  // waits out a pre-fault in progress
  prefault_stopped_ = true;
}

bool TransferLowerer::PrefaultAhead() {
  absl::MutexLock lock(&prefault_mu_);
  if (prefault_stopped_) return false;
  const uintptr_t lowered = out_storage_ + lowered_size_.load(std::memory_order_acquire) * kBytes;
  // Whole pages only, so that the next start stays page-aligned (madvise refuses another); the
  // reserve's end is a page boundary, so rounding up stays inside it.
  const uintptr_t routed = std::min(prefault_end_, PageUp(out_storage_ + routed_ * kBytes));
  // Pages below the worker's last batch are written already.
  while (prefault_next_ + kPrefaultBytes <= lowered) prefault_next_ += kPrefaultBytes;
  if (prefault_next_ >= routed) return false;
  const uintptr_t length = std::min(kPrefaultBytes, routed - prefault_next_);
  if (madvise(reinterpret_cast<void*>(prefault_next_), length, MADV_POPULATE_WRITE) != 0) {
    prefault_end_ = 0;  // not supported here: the worker faults its pages itself
    return false;
  }
  prefault_next_ += length;
  return true;
}

void TransferLowerer::Work() {
  while (true) {
    Batch batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TransferLowerer* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return !self->queue_.empty() || self->closing_;
          },
          this));
      if (queue_.empty()) return;  // closing, nothing left
      batch = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    Lower(batch);
    lowered_size_.store(out_.size(), std::memory_order_release);
    batch.boxes.clear();
    batch.transfers.clear();
    absl::MutexLock lock(&mu_);
    spare_.push_back(std::move(batch));
    busy_ = false;
  }
}

const PieceView& TransferLowerer::ViewOfPiece(const Layout& layout, int32_t piece, int side) {
  CachedView& c = view_cache_[side];
  if (c.layout != &layout || c.piece != piece) {
    const Piece& p = layout.pieces[piece];
    c.layout = &layout;
    c.piece = piece;
    const Box& tensor_box = layout.tensor_box(p);
    const Box& buffer_box = layout.buffer_box(p);
    const Dims& buffer_shape = layout.buffers[p.buffer].shape;
    if (!SameShapeView(tensor_box, buffer_box, buffer_shape, c.view)) {
      // Validated layouts: every piece has a view.
      c.view = *ViewOf(tensor_box, buffer_box, buffer_shape);
    }
  }
  return c.view;
}

void TransferLowerer::Lower(const Batch& batch) {
  for (const RoutedTransfer& t : batch.transfers) {
    // A transfer is one descriptor or a few; many more only for a copy of more than
    // kMaxOuterDims + 1 dimensions or larger than kPrefaultMargin messages.
    if (!prefault_stopping_ && out_.capacity() - out_.size() < kPrefaultMargin) StopPrefaulting();
    const Box& box = batch.boxes[t.box];
    const Layout& from_layout = t.from_destination ? dst_ : src_;
    const Piece& from = from_layout.pieces[t.from_piece];
    const Piece& to = dst_.pieces[t.to_piece];
    const CopyEnd from_end{&from_layout.tensor_box(from), ViewOfPiece(from_layout, t.from_piece, 0),
                           from.buffer, from_layout.buffers[from.buffer].dtype};
    const CopyEnd to_end{&dst_.tensor_box(to), ViewOfPiece(dst_, t.to_piece, 1), to.buffer,
                         dst_.buffers[to.buffer].dtype};
    lowered_.clear();
    if (t.op == CopyOp::kCopy || t.from_destination) {
      // Forwarding copies what an earlier stage landed: codes and scales are already made.
      LowerCopy(box, from_end, to_end, t.from_destination, lowered_, t.group);
      // No descriptor carries more than the whole box: only a box too large for one message
      // needs its descriptors looked at.
      const int64_t wire_size = std::min(DTypeSize(from_end.dtype), DTypeSize(to_end.dtype));
      if (box.NumElements() * wire_size > max_message_bytes_) {
        bool too_large = false;
        for (const CopyDescriptor& d : lowered_) too_large |= d.WireBytes() > max_message_bytes_;
        if (too_large) {
          split_.clear();
          for (const CopyDescriptor& d : lowered_) SplitDescriptor(d, max_message_bytes_, split_);
          lowered_.swap(split_);
        }
      }
    } else {
      absl::Status lowered =
          LowerQuantize(t.op, box, *t.quant, from_end, to_end, false, max_message_bytes_, lowered_);
      if (!lowered.ok() && status_.ok()) status_ = std::move(lowered);
      // Quantizing ops were cut at block boundaries already.
      for (CopyDescriptor& d : lowered_) d.message = t.group;
    }
    cutter_.CutInto(lowered_, out_);  // into messages while the descriptors are in cache
  }
}

}  // namespace refit
