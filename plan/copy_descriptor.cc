#include "plan/copy_descriptor.h"

namespace refit {

int64_t CopyDescriptor::NumElements() const {
  int64_t n = inner;
  for (int d = 0; d < outer_rank; ++d) n *= count[d];
  return n;
}

int64_t CopyDescriptor::WireElements() const {
  if (op != CopyOp::kScale) return NumElements();
  const int64_t rows = outer_rank > 0 ? count[0] : 1;
  return ((rows + block_rows - 1) / block_rows) * ((inner + block_cols - 1) / block_cols);
}

DType CopyDescriptor::WireDType() const {
  if (op != CopyOp::kCopy) return dst_dtype;
  return DTypeSize(src_dtype) <= DTypeSize(dst_dtype) ? src_dtype : dst_dtype;
}

int64_t CopyDescriptor::WireBytes() const { return WireElements() * DTypeSize(WireDType()); }

}  // namespace refit
