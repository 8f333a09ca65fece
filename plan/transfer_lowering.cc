#include "plan/transfer_lowering.h"

#include <utility>

namespace refit {
namespace {

// Transfers per batch: large enough that handing one over costs nothing next to lowering it,
// small enough that the worker starts early and a few batches in flight are a few MB.
constexpr size_t kBatchTransfers = 16384;
// Batches queued before the router waits for the worker: bounds the memory in flight.
constexpr size_t kMaxQueuedBatches = 8;

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
                                 int64_t max_message_bytes, std::vector<CopyDescriptor>& out,
                                 bool threaded)
    : src_(source), dst_(destination), max_message_bytes_(max_message_bytes), out_(out) {
  if (threaded) worker_ = std::thread([this] { Work(); });
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
  absl::MutexLock lock(&mu_);
  // Waits only when the worker has fallen behind by several batches: bounds the memory in flight.
  // No deadline here or below: both sides are this planner's own threads doing CPU work on
  // batches of bounded size, with no I/O and no other process, so each wait ends when the other
  // side finishes its batch.
  mu_.Await(absl::Condition(
      +[](std::deque<Batch>* q) { return q->size() < kMaxQueuedBatches; }, &queue_));
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
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](TransferLowerer* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
          return self->queue_.empty() && !self->busy_;
        },
        this));
  }
  return status_;
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
    const Box& box = batch.boxes[t.box];
    const Layout& from_layout = t.from_destination ? dst_ : src_;
    const Piece& from = from_layout.pieces[t.from_piece];
    const Piece& to = dst_.pieces[t.to_piece];
    const CopyEnd from_end{&from_layout.tensor_box(from), ViewOfPiece(from_layout, t.from_piece, 0),
                           from.buffer, from_layout.buffers[from.buffer].dtype};
    const CopyEnd to_end{&dst_.tensor_box(to), ViewOfPiece(dst_, t.to_piece, 1), to.buffer,
                         dst_.buffers[to.buffer].dtype};
    if (t.op == CopyOp::kCopy || t.from_destination) {
      // Forwarding copies what an earlier stage landed: codes and scales are already made.
      // Lowered in place: a descriptor too large for a message is rare, and cut afterwards.
      const size_t first = out_.size();
      LowerCopy(box, from_end, to_end, t.from_destination, out_);
      bool too_large = false;
      for (size_t i = first; i < out_.size(); ++i) {
        out_[i].message = t.group;
        too_large |= out_[i].WireBytes() > max_message_bytes_;
      }
      if (too_large) {
        lowered_.assign(out_.begin() + static_cast<ptrdiff_t>(first), out_.end());
        out_.resize(first);
        for (const CopyDescriptor& d : lowered_) SplitDescriptor(d, max_message_bytes_, out_);
      }
      continue;
    }
    lowered_.clear();
    absl::Status lowered =
        LowerQuantize(t.op, box, *t.quant, from_end, to_end, false, max_message_bytes_, lowered_);
    if (!lowered.ok() && status_.ok()) status_ = std::move(lowered);
    for (CopyDescriptor& d : lowered_) {
      d.message = t.group;
      out_.push_back(d);  // quantizing ops were cut at block boundaries already
    }
  }
}

}  // namespace refit
