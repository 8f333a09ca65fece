#include "plan/descriptor_list.h"

#include <limits>

namespace refit {
namespace {

bool Fits32(int64_t v) {
  return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
}

}  // namespace

bool DescriptorList::Pack(const CopyDescriptor& d, Packed& p) {
  static_assert(kMaxOuterDims == 3, "Pack keeps two outer loops and sends a third to wide_");
  if (d.outer_rank > 2 || d.count[2] != 0 || d.src_stride[2] != 0 || d.dst_stride[2] != 0 ||
      d.quant_format >= 32 || static_cast<uint8_t>(d.op) >= 4 || !Fits32(d.inner)) {
    return false;
  }
  for (int k = 0; k < 2; ++k) {
    if (!Fits32(d.count[k]) || !Fits32(d.src_stride[k]) || !Fits32(d.dst_stride[k])) return false;
  }
  p.src_offset = d.src_offset;
  p.dst_offset = d.dst_offset;
  p.src_buffer = d.src_buffer;
  p.dst_buffer = d.dst_buffer;
  p.inner = static_cast<int32_t>(d.inner);
  p.message = d.message;
  for (int k = 0; k < 2; ++k) {
    p.count[k] = static_cast<int32_t>(d.count[k]);
    p.src_stride[k] = static_cast<int32_t>(d.src_stride[k]);
    p.dst_stride[k] = static_cast<int32_t>(d.dst_stride[k]);
  }
  p.outer_rank = d.outer_rank;
  p.src_dtype = d.src_dtype;
  p.dst_dtype = d.dst_dtype;
  p.flags = static_cast<uint8_t>((d.src_is_destination ? 1 : 0) |
                                 (static_cast<uint8_t>(d.op) << 1) | (d.quant_format << 3));
  p.block_rows = d.block_rows;
  p.block_cols = d.block_cols;
  return true;
}

DescriptorList::Packed DescriptorList::Wide(const CopyDescriptor& d) {
  Packed p{};
  p.outer_rank = kWide;
  p.src_offset = static_cast<int64_t>(wide_.size());
  p.message = d.message;
  wide_.push_back(d);
  return p;
}

void DescriptorList::push_back(const CopyDescriptor& d) {
  Packed& p = packed_.emplace_back();
  if (!Pack(d, p)) p = Wide(d);
}

const CopyDescriptor DescriptorList::operator[](size_t i) const {
  const Packed& p = packed_[i];
  if (p.outer_rank == kWide) {
    CopyDescriptor d = wide_[static_cast<size_t>(p.src_offset)];
    d.message = p.message;
    return d;
  }
  CopyDescriptor d;
  d.src_buffer = p.src_buffer;
  d.dst_buffer = p.dst_buffer;
  d.src_offset = p.src_offset;
  d.dst_offset = p.dst_offset;
  d.inner = p.inner;
  for (int k = 0; k < 2; ++k) {
    d.count[k] = p.count[k];
    d.src_stride[k] = p.src_stride[k];
    d.dst_stride[k] = p.dst_stride[k];
  }
  d.outer_rank = p.outer_rank;
  d.src_dtype = p.src_dtype;
  d.dst_dtype = p.dst_dtype;
  d.src_is_destination = (p.flags & 1) != 0;
  d.op = static_cast<CopyOp>((p.flags >> 1) & 3);
  d.quant_format = static_cast<uint8_t>(p.flags >> 3);
  d.block_rows = p.block_rows;
  d.block_cols = p.block_cols;
  d.message = p.message;
  return d;
}

void DescriptorList::set(size_t i, const CopyDescriptor& d) {
  Packed& p = packed_[i];
  if (p.outer_rank == kWide) {
    // Its slot in wide_ is reused if it stays wide, else left unused.
    const int64_t slot = p.src_offset;
    if (!Pack(d, p)) {
      wide_[static_cast<size_t>(slot)] = d;
      p.message = d.message;
    }
    return;
  }
  Packed packed;
  p = Pack(d, packed) ? packed : Wide(d);
}

}  // namespace refit
