// A copy descriptor: one strided copy from a buffer region to a buffer region, the unit every
// data plane executes and every plan is made of.
#pragma once

#include <array>
#include <cstdint>

#include "plan/dtype.h"

namespace refit {

inline constexpr int kMaxOuterDims = 3;

// What a descriptor does with the elements it reads.
//   kCopy      element by element, cast from src_dtype to dst_dtype on whichever side of the
//              wire makes the message smaller.
//   kQuantize  e4m3 codes of a [count[0], inner] region of a 2-D weight (outer_rank 1) whose
//              origin is a block corner and whose end is a block edge or the tensor's end: the
//              region is whole blocks of block_rows x block_cols, and each block's scale is
//              computed from its own elements (plan/fp8_block.h). The codes travel; unpacking
//              copies them.
//   kScale     the scales of the same kind of region: it reads the region's elements (src side
//              as for kQuantize) and writes one scale per block, a [ceil(count[0] / block_rows),
//              ceil(inner / block_cols)] grid at dst_offset with row stride dst_stride[0].
// Both quantizing ops run where the whole block is: on the sending GPU's pack step, or on a
// destination GPU from a plan scratch buffer the block's parts were gathered into.
enum class CopyOp : uint8_t { kCopy, kQuantize, kScale };

// One strided copy: `inner` contiguous elements, repeated over up to kMaxOuterDims outer loops
// (count[0] outermost). Offsets and strides are in elements of the respective buffer. A copy with
// more dimensions than that is emitted as several descriptors, and so is one with a loop whose
// count or stride passes kMaxLoopValue: the loops are 32-bit, the offsets and the run 64-bit (a
// stacked expert buffer holds billions of elements; a stride past 2^31 is a rare 4-D layout).
inline constexpr int64_t kMaxLoopValue = INT32_MAX;
// Whether a count or stride fits a descriptor's 32-bit loop.
inline bool FitsLoop(int64_t v) { return v >= -kMaxLoopValue && v <= kMaxLoopValue; }
struct CopyDescriptor {
  int32_t src_buffer = 0;  // in the source layout, or in the destination layout when forwarding
  int32_t dst_buffer = 0;  // in the destination layout
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t inner = 0;
  std::array<int32_t, kMaxOuterDims> count{};
  std::array<int32_t, kMaxOuterDims> src_stride{};
  std::array<int32_t, kMaxOuterDims> dst_stride{};
  uint8_t outer_rank = 0;
  DType src_dtype = DType::kBF16;
  DType dst_dtype = DType::kBF16;
  bool src_is_destination = false;  // stage > 0: reads a destination buffer the round filled
  CopyOp op = CopyOp::kCopy;
  uint8_t quant_format = 0;  // QuantFormat (plan/layout.h) of kQuantize and kScale
  uint16_t block_rows = 0;   // kQuantize, kScale: the block
  uint16_t block_cols = 0;
  int32_t message = 0;  // index into Plan::messages of the message that carries it

  // Elements read: the region.
  int64_t NumElements() const;
  // Elements on the wire: the region's (kCopy, kQuantize), or its blocks' (kScale).
  int64_t WireElements() const;
  // Bytes this copy puts on a link: WireElements() at WireDType(): for kCopy the narrower of the
  // two dtypes (casts happen on whichever side makes the message smaller), else dst_dtype.
  int64_t WireBytes() const;
  DType WireDType() const;
  bool Quantizes() const { return op != CopyOp::kCopy; }
};
// The form every reader sees; a plan stores its millions of descriptors packed, the loops and
// dtypes that they share kept once (plan/descriptor_table.h).
static_assert(sizeof(CopyDescriptor) <= 88, "passed by value to every reader");

}  // namespace refit
