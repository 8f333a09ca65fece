#include "kernels/copy_items.h"

#include <algorithm>

#include "plan/convert.h"
#include "plan/layout.h"

namespace refit {
namespace {

static_assert(kCopyItemMxfp8 == static_cast<uint8_t>(QuantFormat::kMxfp8));

int64_t CeilDiv(int64_t a, int64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

CopyItem ItemFor(const CopyDescriptor& d, int64_t segment_bytes) {
  CopyItem it;
  it.inner = d.inner;
  const int pad = kMaxOuterDims - d.outer_rank;
  for (int i = 0; i < d.outer_rank; ++i) {
    it.count[pad + i] = d.count[i];
    it.src_stride[pad + i] = d.src_stride[i];
    it.dst_stride[pad + i] = d.dst_stride[i];
  }
  const int64_t widest = std::max(DTypeSize(d.src_dtype), DTypeSize(d.dst_dtype));
  it.segment = std::max<int64_t>(1, segment_bytes / widest);
  it.segments = (d.inner + it.segment - 1) / it.segment;
  return it;
}

// A quantizing descriptor's item (kQuantize, kScale): its [rows, inner] region, read at `src`,
// written at `dst` with rows (codes) or block rows (scales) `dst_stride` apart. One unit per
// block.
CopyItem QuantizeItemFor(const CopyDescriptor& d, uint64_t src, uint64_t dst, int64_t dst_stride) {
  CopyItem it;
  it.src = src;
  it.dst = dst;
  it.inner = d.inner;
  it.count[2] = d.outer_rank > 0 ? d.count[0] : 1;
  it.src_stride[2] = d.outer_rank > 0 ? d.src_stride[0] : 0;
  it.dst_stride[2] = dst_stride;
  it.segment = d.block_cols;
  it.segments = CeilDiv(d.inner, d.block_cols);
  it.src_dtype = static_cast<uint8_t>(d.src_dtype);
  it.dst_dtype = static_cast<uint8_t>(d.dst_dtype);
  it.op = static_cast<uint8_t>(d.op);
  it.quant_format = d.quant_format;
  it.block_rows = d.block_rows;
  it.block_cols = d.block_cols;
  return it;
}

// The scale grid of a kScale descriptor: [block rows, block cols] of its region.
int64_t GridRows(const CopyDescriptor& d) { return CeilDiv(d.outer_rank > 0 ? d.count[0] : 1, d.block_rows); }
int64_t GridCols(const CopyDescriptor& d) { return CeilDiv(d.inner, d.block_cols); }

// Contiguous strides for the staging side: runs packed one after another.
void Packed(CopyItem& it, int64_t (&stride)[kMaxOuterDims]) {
  stride[2] = it.inner;
  stride[1] = it.inner * it.count[2];
  stride[0] = it.inner * it.count[2] * it.count[1];
}

void Append(CopyWork& w, const CopyItem& it) {
  if (w.unit_begin.empty()) w.unit_begin.push_back(0);
  w.unit_begin.push_back(w.unit_begin.back() + it.Units());
  w.items.push_back(it);
}

uint64_t SourceAddress(const CopyDescriptor& d, const BufferAddresses& src, const BufferAddresses& dst) {
  const BufferAddresses& from = d.src_is_destination ? dst : src;
  return from[d.src_buffer] + static_cast<uint64_t>(d.src_offset * DTypeSize(d.src_dtype));
}

uint64_t DestinationAddress(const CopyDescriptor& d, const BufferAddresses& dst) {
  return dst[d.dst_buffer] + static_cast<uint64_t>(d.dst_offset * DTypeSize(d.dst_dtype));
}

}  // namespace

void AppendPackItem(const CopyDescriptor& d, const BufferAddresses& src, const BufferAddresses& dst,
                    uint64_t staging, int64_t segment_bytes, CopyWork& w) {
  const uint64_t at = staging + static_cast<uint64_t>(w.bytes);
  if (d.Quantizes()) {
    // Codes with their rows packed, or the packed scale grid.
    Append(w, QuantizeItemFor(d, SourceAddress(d, src, dst), at, d.op == CopyOp::kQuantize ? d.inner : GridCols(d)));
    w.bytes += d.WireBytes();
    return;
  }
  CopyItem it = ItemFor(d, segment_bytes);
  const DType wire = d.WireDType();
  it.src = SourceAddress(d, src, dst);
  it.dst = at;
  Packed(it, it.dst_stride);
  it.src_dtype = static_cast<uint8_t>(d.src_dtype);
  it.dst_dtype = static_cast<uint8_t>(wire);
  w.bytes += d.WireBytes();
  Append(w, it);
}

void AppendUnpackItem(const CopyDescriptor& d, uint64_t staging, const BufferAddresses& dst,
                      int64_t segment_bytes, CopyWork& w) {
  const uint64_t at = staging + static_cast<uint64_t>(w.bytes);
  CopyItem it;
  if (d.op == CopyOp::kScale) {
    // The packed grid, row by row, into the scale tensor's rows (dst_stride[0] scales apart).
    CopyDescriptor grid;
    grid.inner = GridCols(d);
    grid.outer_rank = 1;
    grid.count[0] = GridRows(d);
    grid.dst_stride[0] = d.dst_stride[0];
    grid.src_dtype = grid.dst_dtype = d.dst_dtype;
    it = ItemFor(grid, segment_bytes);
  } else {
    it = ItemFor(d, segment_bytes);  // kQuantize: the codes byte by byte (wire and dst e4m3)
  }
  it.src = at;
  Packed(it, it.src_stride);
  it.dst = DestinationAddress(d, dst);
  it.src_dtype = static_cast<uint8_t>(d.WireDType());
  it.dst_dtype = static_cast<uint8_t>(d.dst_dtype);
  w.bytes += d.WireBytes();
  Append(w, it);
}

void AppendWork(const CopyWork& more, CopyWork& w) {
  for (const CopyItem& it : more.items) Append(w, it);
  w.bytes += more.bytes;
}

CopyWork PackWork(const Plan& plan, const Message& m, const BufferAddresses& src,
                  const BufferAddresses& dst, uint64_t staging, int64_t segment_bytes) {
  CopyWork w;
  w.unit_begin.push_back(0);
  for (int64_t k = 0; k < m.num_descriptors; ++k) {
    AppendPackItem(plan.descriptor(m, k), src, dst, staging, segment_bytes, w);
  }
  return w;
}

CopyWork UnpackWork(const Plan& plan, const Message& m, uint64_t staging,
                    const BufferAddresses& dst, int64_t segment_bytes) {
  CopyWork w;
  w.unit_begin.push_back(0);
  for (int64_t k = 0; k < m.num_descriptors; ++k) {
    AppendUnpackItem(plan.descriptor(m, k), staging, dst, segment_bytes, w);
  }
  return w;
}

CopyWork DirectWork(const Plan& plan, const Message& m, const BufferAddresses& src,
                    const BufferAddresses& dst, int64_t segment_bytes) {
  CopyWork w;
  w.unit_begin.push_back(0);
  for (int64_t k = 0; k < m.num_descriptors; ++k) {
    const CopyDescriptor& d = plan.descriptor(m, k);
    if (d.Quantizes()) {
      // Straight into the destination: codes into the weight's rows, scales into the scale
      // tensor's, both dst_stride[0] apart.
      Append(w, QuantizeItemFor(d, SourceAddress(d, src, dst), DestinationAddress(d, dst), d.dst_stride[0]));
      continue;
    }
    CopyItem it = ItemFor(d, segment_bytes);
    it.src = SourceAddress(d, src, dst);
    it.dst = DestinationAddress(d, dst);
    it.src_dtype = static_cast<uint8_t>(d.src_dtype);
    it.dst_dtype = static_cast<uint8_t>(d.dst_dtype);
    Append(w, it);
  }
  return w;
}

namespace {

// Unit `u` of a quantizing item: block (u / segments, u % segments) of its region, by
// QuantizeRegion on that block alone (blocks are independent: the same bytes as the whole region).
void QuantizeUnitOnHost(const CopyItem& it, int64_t u) {
  const int64_t bi = u / it.segments, bj = u % it.segments;
  const int64_t r0 = bi * it.block_rows, c0 = bj * it.block_cols;
  CopyDescriptor block;
  block.op = static_cast<CopyOp>(it.op);
  block.quant_format = it.quant_format;
  block.block_rows = it.block_rows;
  block.block_cols = it.block_cols;
  block.src_dtype = static_cast<DType>(it.src_dtype);
  block.dst_dtype = static_cast<DType>(it.dst_dtype);
  block.outer_rank = 1;
  block.count[0] = std::min<int64_t>(it.block_rows, it.count[2] - r0);
  block.inner = std::min<int64_t>(it.block_cols, it.inner - c0);
  block.src_stride[0] = it.src_stride[2];
  const std::byte* src =
      reinterpret_cast<const std::byte*>(it.src) + (r0 * it.src_stride[2] + c0) * DTypeSize(block.src_dtype);
  if (block.op == CopyOp::kQuantize) {
    uint8_t* codes = reinterpret_cast<uint8_t*>(it.dst) + r0 * it.dst_stride[2] + c0;
    QuantizeRegion(block, src, codes, it.dst_stride[2], nullptr, 0);
  } else {
    std::byte* scale = reinterpret_cast<std::byte*>(it.dst) + (bi * it.dst_stride[2] + bj) * DTypeSize(block.dst_dtype);
    QuantizeRegion(block, src, nullptr, 0, scale, 0);
  }
}

}  // namespace

void RunCopyWorkOnHost(const CopyWork& work) {
  // Unit by unit, exactly as the kernel decodes them.
  for (size_t i = 0; i < work.items.size(); ++i) {
    const CopyItem& it = work.items[i];
    if (it.Quantizes()) {
      for (int64_t u = 0; u < it.Units(); ++u) QuantizeUnitOnHost(it, u);
      continue;
    }
    const int ss = DTypeSize(static_cast<DType>(it.src_dtype));
    const int ds = DTypeSize(static_cast<DType>(it.dst_dtype));
    for (int64_t u = 0; u < it.Units(); ++u) {
      const int64_t seg = u % it.segments;
      int64_t run = u / it.segments;
      const int64_t c = run % it.count[2];
      run /= it.count[2];
      const int64_t b = run % it.count[1];
      const int64_t a = run / it.count[1];
      const int64_t first = seg * it.segment;
      const int64_t n = std::min(it.segment, it.inner - first);
      const int64_t so = a * it.src_stride[0] + b * it.src_stride[1] + c * it.src_stride[2] + first;
      const int64_t dof = a * it.dst_stride[0] + b * it.dst_stride[1] + c * it.dst_stride[2] + first;
      ConvertElements(reinterpret_cast<const std::byte*>(it.src) + so * ss,
                      static_cast<DType>(it.src_dtype), reinterpret_cast<std::byte*>(it.dst) + dof * ds,
                      static_cast<DType>(it.dst_dtype), n);
    }
  }
}

}  // namespace refit
