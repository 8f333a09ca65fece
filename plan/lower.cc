#include "plan/lower.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace refit {

const char* LinkClassName(LinkClass link) {
  switch (link) {
    case LinkClass::kLocal:
      return "local";
    case LinkClass::kNvlink:
      return "nvlink";
    case LinkClass::kNetwork:
      return "network";
  }
  return "?";
}

void LowerCopy(const Box& region, const CopyEnd& src, const CopyEnd& dst, bool src_is_destination,
               std::vector<CopyDescriptor>& out, int32_t message) {
  if (region.IsEmpty()) return;
  int64_t src_offset = src.view.offset;
  int64_t dst_offset = dst.view.offset;
  // Loops from outermost to innermost: extent, source stride, destination stride.
  int n = 0;
  std::array<int64_t, kMaxRank> count{}, ss{}, ds{};
  for (int d = 0; d < region.rank; ++d) {
    src_offset += (region.origin[d] - src.tensor_box->origin[d]) * src.view.strides[d];
    dst_offset += (region.origin[d] - dst.tensor_box->origin[d]) * dst.view.strides[d];
    if (region.shape[d] == 1) continue;
    // Merge into the previous (outer) loop when both sides are contiguous across the two.
    if (n > 0 && ss[n - 1] == src.view.strides[d] * region.shape[d] &&
        ds[n - 1] == dst.view.strides[d] * region.shape[d]) {
      count[n - 1] *= region.shape[d];
      ss[n - 1] = src.view.strides[d];
      ds[n - 1] = dst.view.strides[d];
      continue;
    }
    count[n] = region.shape[d];
    ss[n] = src.view.strides[d];
    ds[n] = dst.view.strides[d];
    ++n;
  }
  int64_t inner = 1;
  if (n > 0 && ss[n - 1] == 1 && ds[n - 1] == 1) {
    inner = count[n - 1];
    --n;
  }
  // Keep the innermost kMaxOuterDims loops in the descriptor; enumerate the rest, and every loop
  // outside one that a descriptor's 32-bit loops cannot hold.
  int extra = n - std::min(n, kMaxOuterDims);
  for (int i = extra; i < n; ++i) {
    if (!FitsLoop(count[i]) || !FitsLoop(ss[i]) || !FitsLoop(ds[i])) extra = i + 1;
  }
  const int kept = n - extra;
  auto fill = [&](CopyDescriptor& d) {
    d.src_buffer = src.buffer;
    d.dst_buffer = dst.buffer;
    d.src_dtype = src.dtype;
    d.dst_dtype = dst.dtype;
    d.src_is_destination = src_is_destination;
    d.message = message;
    d.inner = inner;
    d.outer_rank = static_cast<uint8_t>(kept);
    for (int i = 0; i < kept; ++i) {  // each fits: see `extra`
      d.count[i] = static_cast<int32_t>(count[extra + i]);
      d.src_stride[i] = static_cast<int32_t>(ss[extra + i]);
      d.dst_stride[i] = static_cast<int32_t>(ds[extra + i]);
    }
  };
  if (extra == 0) {  // the common case: one descriptor, written once where it stays
    CopyDescriptor& d = out.emplace_back();
    fill(d);
    d.src_offset = src_offset;
    d.dst_offset = dst_offset;
    return;
  }
  CopyDescriptor base;
  fill(base);
  std::array<int64_t, kMaxRank> index{};
  while (true) {
    CopyDescriptor d = base;
    d.src_offset = src_offset;
    d.dst_offset = dst_offset;
    for (int i = 0; i < extra; ++i) {
      d.src_offset += index[i] * ss[i];
      d.dst_offset += index[i] * ds[i];
    }
    out.push_back(d);
    int i = extra - 1;
    for (; i >= 0; --i) {
      if (++index[i] < count[i]) break;
      index[i] = 0;
    }
    if (i < 0) break;
  }
}

absl::Status LowerQuantize(CopyOp op, const Box& region, const Quantization& q, const CopyEnd& src,
                           const CopyEnd& dst, bool src_is_destination, int64_t max_wire_bytes,
                           std::vector<CopyDescriptor>& out) {
  if (region.IsEmpty()) return absl::OkStatus();
  const int64_t br = q.block_rows, bc = q.block_cols;
  const int64_t rows = region.shape[0], cols = region.shape[1];
  // The destination's region: the same elements (kQuantize) or their blocks (kScale).
  Box to = region;
  if (op == CopyOp::kScale) {
    to.origin[0] = region.origin[0] / br;
    to.origin[1] = region.origin[1] / bc;
    to.shape[0] = (rows + br - 1) / br;
    to.shape[1] = (cols + bc - 1) / bc;
  }
  auto offset = [](const Box& r, const CopyEnd& end) {
    int64_t o = end.view.offset;
    for (int d = 0; d < 2; ++d)
      o += (r.origin[d] - end.tensor_box->origin[d]) * end.view.strides[d];
    return o;
  };
  if ((cols > 1 && src.view.strides[1] != 1) || (to.shape[1] > 1 && dst.view.strides[1] != 1)) {
    return absl::InvalidArgumentError(
        "a quantized tensor's piece whose columns are not contiguous in its buffer cannot be "
        "quantized");
  }
  if (!FitsLoop(rows) || !FitsLoop(src.view.strides[0]) || !FitsLoop(dst.view.strides[0])) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a quantized region of ", rows, " rows, ", src.view.strides[0], " and ",
        dst.view.strides[0], " elements apart in its buffers: a descriptor's loops hold at most ",
        kMaxLoopValue));
  }
  CopyDescriptor base;
  base.op = op;
  base.quant_format = static_cast<uint8_t>(q.format);
  base.block_rows = static_cast<uint16_t>(br);
  base.block_cols = static_cast<uint16_t>(bc);
  base.src_buffer = src.buffer;
  base.dst_buffer = dst.buffer;
  base.src_dtype = src.dtype;
  base.dst_dtype = dst.dtype;
  base.src_is_destination = src_is_destination;
  base.outer_rank = 1;
  base.src_stride[0] = static_cast<int32_t>(src.view.strides[0]);
  base.dst_stride[0] = static_cast<int32_t>(dst.view.strides[0]);
  const int64_t src_origin = offset(region, src), dst_origin = offset(to, dst);
  // Parts: whole block rows while they fit, else whole blocks along a block row.
  const int64_t elem = DTypeSize(dst.dtype);
  const int64_t block_cols_total = (cols + bc - 1) / bc;
  const int64_t row_block_bytes = op == CopyOp::kScale ? block_cols_total * elem : br * cols * elem;
  int64_t rows_per_part = br, cols_per_part = cols;
  if (row_block_bytes <= max_wire_bytes) {
    rows_per_part = br * std::max<int64_t>(1, max_wire_bytes / row_block_bytes);
  } else {
    const int64_t block_bytes = op == CopyOp::kScale ? elem : br * bc * elem;
    cols_per_part = bc * std::max<int64_t>(1, max_wire_bytes / block_bytes);
  }
  for (int64_t r = 0; r < rows; r += rows_per_part) {
    for (int64_t c = 0; c < cols; c += cols_per_part) {
      CopyDescriptor d = base;
      d.count[0] = static_cast<int32_t>(std::min(rows_per_part, rows - r));
      d.inner = std::min(cols_per_part, cols - c);
      d.src_offset =
          src_origin + r * src.view.strides[0] + c * (cols > 1 ? src.view.strides[1] : 0);
      if (op == CopyOp::kScale) {
        d.dst_offset = dst_origin + (r / br) * dst.view.strides[0] +
                       (c / bc) * (to.shape[1] > 1 ? dst.view.strides[1] : 0);
      } else {
        d.dst_offset =
            dst_origin + r * dst.view.strides[0] + c * (cols > 1 ? dst.view.strides[1] : 0);
      }
      out.push_back(d);
    }
  }
  return absl::OkStatus();
}

void SplitDescriptor(const CopyDescriptor& d, int64_t max_wire_bytes,
                     std::vector<CopyDescriptor>& out) {
  const int64_t elem = DTypeSize(d.WireDType());
  if (d.WireBytes() <= max_wire_bytes) {
    out.push_back(d);
    return;
  }
  if (d.outer_rank == 0) {
    const int64_t per_part = std::max<int64_t>(1, max_wire_bytes / elem);
    for (int64_t start = 0; start < d.inner; start += per_part) {
      CopyDescriptor part = d;
      part.src_offset += start;
      part.dst_offset += start;
      part.inner = std::min(per_part, d.inner - start);
      out.push_back(part);
    }
    return;
  }
  // Cut the outermost loop; a single iteration that is still too large is cut further.
  CopyDescriptor one = d;
  one.outer_rank = d.outer_rank - 1;
  for (int i = 0; i < kMaxOuterDims; ++i) {
    // Loops past outer_rank are zero, as everywhere else: equal copies are equal descriptors
    // (the plan's table keeps each shape once, and its digest hashes them).
    const bool kept = i < one.outer_rank;
    one.count[i] = kept ? d.count[i + 1] : 0;
    one.src_stride[i] = kept ? d.src_stride[i + 1] : 0;
    one.dst_stride[i] = kept ? d.dst_stride[i + 1] : 0;
  }
  const int64_t one_bytes = one.WireBytes();
  if (one_bytes > max_wire_bytes) {
    for (int64_t k = 0; k < d.count[0]; ++k) {
      CopyDescriptor slice = one;
      slice.src_offset = d.src_offset + k * d.src_stride[0];
      slice.dst_offset = d.dst_offset + k * d.dst_stride[0];
      SplitDescriptor(slice, max_wire_bytes, out);
    }
    return;
  }
  const int64_t per_part = std::max<int64_t>(1, max_wire_bytes / one_bytes);
  for (int64_t start = 0; start < d.count[0]; start += per_part) {
    CopyDescriptor part = d;
    part.count[0] = static_cast<int32_t>(std::min<int64_t>(per_part, d.count[0] - start));
    part.src_offset += start * d.src_stride[0];
    part.dst_offset += start * d.dst_stride[0];
    out.push_back(part);
  }
}

}  // namespace refit
