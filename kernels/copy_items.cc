#include "kernels/copy_items.h"

#include <algorithm>

#include "plan/convert.h"

namespace refit {
namespace {

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

}  // namespace

void AppendPackItem(const CopyDescriptor& d, const BufferAddresses& src, const BufferAddresses& dst,
                    uint64_t staging, int64_t segment_bytes, CopyWork& w) {
  CopyItem it = ItemFor(d, segment_bytes);
  const DType wire = d.WireDType();
  const BufferAddresses& from = d.src_is_destination ? dst : src;
  it.src = from[d.src_buffer] + static_cast<uint64_t>(d.src_offset * DTypeSize(d.src_dtype));
  it.dst = staging + static_cast<uint64_t>(w.bytes);
  Packed(it, it.dst_stride);
  it.src_dtype = static_cast<uint8_t>(d.src_dtype);
  it.dst_dtype = static_cast<uint8_t>(wire);
  w.bytes += d.NumElements() * DTypeSize(wire);
  Append(w, it);
}

void AppendUnpackItem(const CopyDescriptor& d, uint64_t staging, const BufferAddresses& dst,
                      int64_t segment_bytes, CopyWork& w) {
  CopyItem it = ItemFor(d, segment_bytes);
  const DType wire = d.WireDType();
  it.src = staging + static_cast<uint64_t>(w.bytes);
  Packed(it, it.src_stride);
  it.dst = dst[d.dst_buffer] + static_cast<uint64_t>(d.dst_offset * DTypeSize(d.dst_dtype));
  it.src_dtype = static_cast<uint8_t>(wire);
  it.dst_dtype = static_cast<uint8_t>(d.dst_dtype);
  w.bytes += d.NumElements() * DTypeSize(wire);
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
    CopyItem it = ItemFor(d, segment_bytes);
    const BufferAddresses& from = d.src_is_destination ? dst : src;
    it.src = from[d.src_buffer] + static_cast<uint64_t>(d.src_offset * DTypeSize(d.src_dtype));
    it.dst = dst[d.dst_buffer] + static_cast<uint64_t>(d.dst_offset * DTypeSize(d.dst_dtype));
    it.src_dtype = static_cast<uint8_t>(d.src_dtype);
    it.dst_dtype = static_cast<uint8_t>(d.dst_dtype);
    w.unit_begin.push_back(w.unit_begin.back() + it.Units());
    w.items.push_back(it);
  }
  return w;
}

void RunCopyWorkOnHost(const CopyWork& work) {
  // Unit by unit, exactly as the kernel decodes them.
  for (size_t i = 0; i < work.items.size(); ++i) {
    const CopyItem& it = work.items[i];
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
