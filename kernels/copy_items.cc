#include "kernels/copy_items.h"

#include <algorithm>

#include "plan/convert.h"
#include "plan/layout.h"

namespace refit {
namespace {

static_assert(kCopyItemMxfp8 == static_cast<uint8_t>(QuantFormat::kMxfp8));

int64_t CeilDiv(int64_t a, int64_t b) { return b == 0 ? 0 : (a + b - 1) / b; }

CopyItem ItemFor(const CopyDescriptor& d) {
  CopyItem it;
  it.inner = d.inner;
  const int pad = kMaxOuterDims - d.outer_rank;
  for (int i = 0; i < d.outer_rank; ++i) {
    it.count[pad + i] = d.count[i];
    it.src_stride[pad + i] = d.src_stride[i];
    it.dst_stride[pad + i] = d.dst_stride[i];
  }
  return it;
}

// A quantizing descriptor's item (kQuantize, kScale): its [rows, inner] region, read at `src`,
// written at `dst` with rows (codes) or block rows (scales) `dst_stride` apart. One unit per
// block (MXFP8's one-row blocks: per tile of Mxfp8UnitRows x Mxfp8UnitCols).
CopyItem QuantizeItemFor(const CopyDescriptor& d, uint64_t src, uint64_t dst, int64_t dst_stride) {
  CopyItem it;
  it.src = src;
  it.dst = dst;
  it.inner = d.inner;
  it.count[2] = d.outer_rank > 0 ? d.count[0] : 1;
  it.src_stride[2] = d.outer_rank > 0 ? d.src_stride[0] : 0;
  it.dst_stride[2] = dst_stride;
  it.src_dtype = static_cast<uint8_t>(d.src_dtype);
  it.dst_dtype = static_cast<uint8_t>(d.dst_dtype);
  it.op = static_cast<uint8_t>(d.op);
  it.quant_format = d.quant_format;
  it.block_rows = d.block_rows;
  it.block_cols = d.block_cols;
  it.segment = it.Mxfp8Rows() ? Mxfp8UnitCols(d.inner) : d.block_cols;
  it.segments = CeilDiv(d.inner, it.segment);
  return it;
}

// The scale grid of a kScale descriptor: [block rows, block cols] of its region.
int64_t GridRows(const CopyDescriptor& d) {
  return CeilDiv(d.outer_rank > 0 ? d.count[0] : 1, d.block_rows);
}
int64_t GridCols(const CopyDescriptor& d) { return CeilDiv(d.inner, d.block_cols); }

// Contiguous strides for the staging side: runs packed one after another.
void Packed(CopyItem& it, int64_t (&stride)[kMaxOuterDims]) {
  stride[2] = it.inner;
  stride[1] = it.inner * it.count[2];
  stride[0] = it.inner * it.count[2] * it.count[1];
}

uint64_t SourceAddress(const CopyDescriptor& d, const BufferAddresses& src,
                       const BufferAddresses& dst) {
  const BufferAddresses& from = d.src_is_destination ? dst : src;
  return from[d.src_buffer] + static_cast<uint64_t>(d.src_offset * DTypeSize(d.src_dtype));
}

uint64_t DestinationAddress(const CopyDescriptor& d, const BufferAddresses& dst) {
  return dst[d.dst_buffer] + static_cast<uint64_t>(d.dst_offset * DTypeSize(d.dst_dtype));
}

// The widest power of two, at most `limit`, dividing x (limit a power of two; x = 0: limit).
int64_t WidestDividing(uint64_t x, int64_t limit) {
  int64_t v = limit;
  while (v > 1 && x % static_cast<uint64_t>(v) != 0) v /= 2;
  return v;
}

}  // namespace

BufferAddresses AddressesOf(const BufferMemory& memory) {
  BufferAddresses a;
  a.reserve(memory.size());
  for (const auto& s : memory) a.push_back(reinterpret_cast<uint64_t>(s.data()));
  return a;
}

void Append(CopyWork& w, const CopyItem& it) {
  if (w.unit_begin.empty()) w.unit_begin.push_back(0);
  w.unit_begin.push_back(w.unit_begin.back() + it.Units());
  w.items.push_back(it);
}

void CutIntoUnits(CopyItem& it, int64_t segment_bytes, int64_t tile_run_bytes) {
  const int ss = DTypeSize(static_cast<DType>(it.src_dtype)),
            ds = DTypeSize(static_cast<DType>(it.dst_dtype));
  const int64_t widest = std::max(ss, ds);
  it.segment = std::max<int64_t>(1, segment_bytes / widest);
  it.tiled = it.inner * widest < tile_run_bytes && it.inner > 0;
  it.vector = 0;
  if (!it.tiled) {
    it.segments = CeilDiv(it.inner, it.segment);
    return;
  }
  it.segments = 0;
  // Every element address of the item is src + (a*s0 + b*s1 + c*s2 + i) * size for i < inner:
  // an access of V bytes fits every one of them when V divides the base, the run and every
  // stride that is stepped (count > 1); tiles then start at multiples of V too (segment rounded).
  uint64_t elems = static_cast<uint64_t>(it.inner);  // element counts that must be multiples of E
  for (int k = 0; k < kMaxOuterDims; ++k) {
    if (it.count[k] > 1)
      elems |= static_cast<uint64_t>(it.src_stride[k]) | static_cast<uint64_t>(it.dst_stride[k]);
  }
  if (it.src_dtype == it.dst_dtype) {
    // Bytes: src, dst and every element offset times the size. (By dtype, not size, as the
    // kernel decides: bf16 <-> fp16 converts, and its `vector` counts elements; taken for bytes,
    // a converting tile read 2-byte elements at odd staging addresses, a GPU fault.)
    int64_t v = WidestDividing(it.src | it.dst | (elems * static_cast<uint64_t>(ss)), 16);
    while (v > ss && it.segment % (v / ss) != 0) {
      if (it.segment >= v / ss)
        it.segment -= it.segment % (v / ss);
      else
        v /= 2;
    }
    it.vector = static_cast<uint8_t>(v);
    return;
  }
  // Converting: E elements per access, E * size bytes at each end (at most 16).
  // 0: element by element in bytes, at addresses that are not multiples of the element size and
  // for pairs the kernel has no vector code for (conversions are among bf16, fp16 and fp32).
  const bool pair = (ss == 2 || ss == 4) && (ds == 2 || ds == 4);
  if (!pair || it.src % static_cast<uint64_t>(ss) != 0 || it.dst % static_cast<uint64_t>(ds) != 0)
    return;
  int64_t e = 16 / widest;
  while (e > 1 && ((it.src / ss) % e != 0 || (it.dst / ds) % e != 0 || elems % e != 0)) e /= 2;
  while (e > 1 && it.segment % e != 0) {
    if (it.segment >= e)
      it.segment -= it.segment % e;
    else
      e /= 2;
  }
  it.vector = static_cast<uint8_t>(e);
}

void AppendPackItem(const CopyDescriptor& d, const BufferAddresses& src, const BufferAddresses& dst,
                    uint64_t staging, int64_t segment_bytes, CopyWork& w) {
  const uint64_t at = staging + static_cast<uint64_t>(w.bytes);
  if (d.Quantizes()) {
    // Codes with their rows packed, or the packed scale grid.
    Append(w, QuantizeItemFor(d, SourceAddress(d, src, dst), at,
                              d.op == CopyOp::kQuantize ? d.inner : GridCols(d)));
    w.bytes += d.WireBytes();
    return;
  }
  CopyItem it = ItemFor(d);
  const DType wire = d.WireDType();
  it.src = SourceAddress(d, src, dst);
  it.dst = at;
  Packed(it, it.dst_stride);
  it.src_dtype = static_cast<uint8_t>(d.src_dtype);
  it.dst_dtype = static_cast<uint8_t>(wire);
  CutIntoUnits(it, segment_bytes);
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
    it = ItemFor(grid);
  } else {
    it = ItemFor(d);  // kQuantize: the codes byte by byte (wire and dst e4m3)
  }
  it.src = at;
  Packed(it, it.src_stride);
  it.dst = DestinationAddress(d, dst);
  it.src_dtype = static_cast<uint8_t>(d.WireDType());
  it.dst_dtype = static_cast<uint8_t>(d.dst_dtype);
  CutIntoUnits(it, segment_bytes);
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

bool ScaleTwins(const CopyItem& q, const CopyItem& s) {
  return q.op == static_cast<uint8_t>(CopyOp::kQuantize) &&
         s.op == static_cast<uint8_t>(CopyOp::kScale) && q.src == s.src &&
         q.src_dtype == s.src_dtype && q.inner == s.inner && q.count[0] == s.count[0] &&
         q.count[1] == s.count[1] && q.count[2] == s.count[2] &&
         q.src_stride[2] == s.src_stride[2] && q.block_rows == s.block_rows &&
         q.block_cols == s.block_cols && q.quant_format == s.quant_format &&
         q.segments == s.segments;
}

bool ScalesByTwin(const CopyWork& work, size_t i) {
  if (work.items[i].op != static_cast<uint8_t>(CopyOp::kScale)) return false;
  for (size_t k = 1; k <= kTwinWindow && k <= i; ++k) {
    if (ScaleTwins(work.items[i - k], work.items[i])) return true;
  }
  return false;
}

std::vector<int64_t> QuantizingLaunchUnits(const CopyWork& work) {
  std::vector<int64_t> begin;
  begin.reserve(work.items.size() + 1);
  begin.push_back(0);
  for (size_t i = 0; i < work.items.size(); ++i)
    begin.push_back(begin.back() + (ScalesByTwin(work, i) ? 0 : work.items[i].Units()));
  return begin;
}

bool AlignedItem(const CopyItem& it) {
  if (it.Quantizes()) return true;  // fp8 blocks: the same code in both kernels
  if (it.tiled) return false;
  const int ss = DTypeSize(static_cast<DType>(it.src_dtype)),
            ds = DTypeSize(static_cast<DType>(it.dst_dtype));
  // Every unit starts at a run's start plus a whole number of segments: aligned when the bases,
  // the strides stepped and the segment are (the last segment of a run: when the run is).
  uint64_t s_bytes =
      it.src | static_cast<uint64_t>(it.segment * ss) | static_cast<uint64_t>(it.inner * ss);
  uint64_t d_bytes =
      it.dst | static_cast<uint64_t>(it.segment * ds) | static_cast<uint64_t>(it.inner * ds);
  for (int k = 0; k < kMaxOuterDims; ++k) {
    if (it.count[k] <= 1) continue;
    s_bytes |= static_cast<uint64_t>(it.src_stride[k] * ss);
    d_bytes |= static_cast<uint64_t>(it.dst_stride[k] * ds);
  }
  if (((s_bytes | d_bytes) & 15) != 0) return false;
  // Converting: WarpConvertVector takes 8 elements at a time.
  return it.src_dtype == it.dst_dtype || (it.segment | it.inner) % 8 == 0;
}

bool AlignedOnly(const CopyWork& work) {
  return std::all_of(work.items.begin(), work.items.end(), AlignedItem);
}

void SplitAligned(const CopyWork& work, CopyWork& aligned, CopyWork& general) {
  aligned = CopyWork{};
  general = CopyWork{};
  for (const CopyItem& it : work.items) Append(AlignedItem(it) ? aligned : general, it);
}

CopyWork DirectWork(const Plan& plan, const Message& m, const BufferAddresses& src,
                    const BufferAddresses& dst, int64_t segment_bytes, int64_t tile_run_bytes) {
  CopyWork w;
  w.unit_begin.push_back(0);
  for (int64_t k = 0; k < m.num_descriptors; ++k) {
    const CopyDescriptor& d = plan.descriptor(m, k);
    if (d.Quantizes()) {
      // Straight into the destination: codes into the weight's rows, scales into the scale
      // tensor's, both dst_stride[0] apart.
      Append(w, QuantizeItemFor(d, SourceAddress(d, src, dst), DestinationAddress(d, dst),
                                d.dst_stride[0]));
      continue;
    }
    CopyItem it = ItemFor(d);
    it.src = SourceAddress(d, src, dst);
    it.dst = DestinationAddress(d, dst);
    it.src_dtype = static_cast<uint8_t>(d.src_dtype);
    it.dst_dtype = static_cast<uint8_t>(d.dst_dtype);
    CutIntoUnits(it, segment_bytes, tile_run_bytes);
    Append(w, it);
  }
  return w;
}

namespace {

// Unit `u` of a quantizing item: its RowsPerUnit rows of `segment` columns at (u / segments,
// u % segments) (one block; MXFP8's one-row blocks: a tile of them), by QuantizeRegion on them
// alone (blocks are independent: the same bytes as the whole region).
void QuantizeUnitOnHost(const CopyItem& it, int64_t u) {
  const int64_t bi = u / it.segments, bj = u % it.segments;
  const int64_t r0 = bi * it.RowsPerUnit(), c0 = bj * it.segment;
  CopyDescriptor block;
  block.op = static_cast<CopyOp>(it.op);
  block.quant_format = it.quant_format;
  block.block_rows = it.block_rows;
  block.block_cols = it.block_cols;
  block.src_dtype = static_cast<DType>(it.src_dtype);
  block.dst_dtype = static_cast<DType>(it.dst_dtype);
  block.outer_rank = 1;
  block.count[0] = std::min<int64_t>(it.RowsPerUnit(), it.count[2] - r0);  // whole blocks
  block.inner = std::min<int64_t>(it.segment, it.inner - c0);
  block.src_stride[0] = it.src_stride[2];
  const std::byte* src = reinterpret_cast<const std::byte*>(it.src) +
                         (r0 * it.src_stride[2] + c0) * DTypeSize(block.src_dtype);
  if (block.op == CopyOp::kQuantize) {
    uint8_t* codes = reinterpret_cast<uint8_t*>(it.dst) + r0 * it.dst_stride[2] + c0;
    QuantizeRegion(block, src, codes, it.dst_stride[2], nullptr, 0);
  } else {
    std::byte* scale =
        reinterpret_cast<std::byte*>(it.dst) +
        (r0 / it.block_rows * it.dst_stride[2] + c0 / it.block_cols) * DTypeSize(block.dst_dtype);
    QuantizeRegion(block, src, nullptr, 0, scale, it.dst_stride[2]);
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
    // Elements [first, first + n) of run (a, b, c) of the item, starting at column `col`.
    auto copy = [&](int64_t run, int64_t col, int64_t n) {
      const int64_t c = run % it.count[2];
      run /= it.count[2];
      const int64_t b = run % it.count[1];
      const int64_t a = run / it.count[1];
      const int64_t so = a * it.src_stride[0] + b * it.src_stride[1] + c * it.src_stride[2] + col;
      const int64_t dof = a * it.dst_stride[0] + b * it.dst_stride[1] + c * it.dst_stride[2] + col;
      ConvertElements(
          reinterpret_cast<const std::byte*>(it.src) + so * ss, static_cast<DType>(it.src_dtype),
          reinterpret_cast<std::byte*>(it.dst) + dof * ds, static_cast<DType>(it.dst_dtype), n);
    };
    if (it.tiled) {
      // Tile u: elements [u * segment, ...) of the flattened index space, run by run.
      const int64_t total = it.Rows() * it.inner;
      for (int64_t u = 0; u < it.Units(); ++u) {
        int64_t first = u * it.segment;
        int64_t left = std::min(it.segment, total - first);
        while (left > 0) {
          const int64_t col = first % it.inner;
          const int64_t n = std::min(left, it.inner - col);
          copy(first / it.inner, col, n);
          first += n;
          left -= n;
        }
      }
      continue;
    }
    for (int64_t u = 0; u < it.Units(); ++u) {
      const int64_t first = (u % it.segments) * it.segment;
      copy(u / it.segments, first, std::min(it.segment, it.inner - first));
    }
  }
}

}  // namespace refit
