// Phase 5 of planning: turning "copy this box from that piece to this piece" into copy
// descriptors (a contiguous inner run repeated over strided outer loops), and cutting
// descriptors to fit bounded messages.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "plan/layout.h"
#include "plan/plan.h"

namespace refit {

// One side of a copy: a piece's tensor box, its view into its buffer, the buffer and its dtype.
struct CopyEnd {
  const Box* tensor_box;
  PieceView view;
  int32_t buffer;
  DType dtype;
};

// Appends the descriptors that copy `region` (in tensor coordinates, inside both ends' tensor
// boxes) from `src` to `dst`. Dimensions of extent 1 vanish, dimensions contiguous on both sides
// merge; a copy with more than kMaxOuterDims + 1 dimensions left becomes several descriptors,
// each carried by `message`.
void LowerCopy(const Box& region, const CopyEnd& src, const CopyEnd& dst, bool src_is_destination,
               std::vector<CopyDescriptor>& out, int32_t message = 0);

// Appends the descriptors of a quantizing op (kQuantize or kScale) for `region`, whole blocks of
// block_rows x block_cols of a 2-D tensor quantized as `q` (origin on a block corner, end on a
// block edge or the tensor's end), in the element coordinates of `src`'s tensor box. kQuantize
// writes the region's codes to `dst` (a piece of the quantized tensor); kScale writes its blocks'
// scales to `dst` (a piece of the scale tensor, in block coordinates). Parts carry at most
// `max_wire_bytes` each, cut at block boundaries (at least one block each). INVALID_ARGUMENT when
// a side's columns are not contiguous in its buffer (quantized pieces are row-major boxes).
absl::Status LowerQuantize(CopyOp op, const Box& region, const Quantization& q, const CopyEnd& src,
                           const CopyEnd& dst, bool src_is_destination, int64_t max_wire_bytes,
                           std::vector<CopyDescriptor>& out);

// Appends `d` cut along its outermost dimension (or its inner run) into parts of at most
// `max_wire_bytes` each (at least one element each).
void SplitDescriptor(const CopyDescriptor& d, int64_t max_wire_bytes,
                     std::vector<CopyDescriptor>& out);

}  // namespace refit
