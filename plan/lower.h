// Phase 5 of planning: turning "copy this box from that piece to this piece" into copy
// descriptors (a contiguous inner run repeated over strided outer loops), and cutting
// descriptors to fit bounded messages.
#pragma once

#include <vector>

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
// merge; a copy with more than kMaxOuterDims + 1 dimensions left becomes several descriptors.
void LowerCopy(const Box& region, const CopyEnd& src, const CopyEnd& dst, bool src_is_destination,
               std::vector<CopyDescriptor>& out);

// Appends `d` cut along its outermost dimension (or its inner run) into parts of at most
// `max_wire_bytes` each (at least one element each).
void SplitDescriptor(const CopyDescriptor& d, int64_t max_wire_bytes,
                     std::vector<CopyDescriptor>& out);

}  // namespace refit
