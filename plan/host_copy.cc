#include "plan/host_copy.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "plan/convert.h"

namespace refit {
namespace {

// Calls fn(src_offset, dst_offset) in elements for every inner run of `d`, in row-major order.
template <typename Fn>
void ForEachRun(const CopyDescriptor& d, Fn&& fn) {
  std::array<int64_t, kMaxOuterDims> count{1, 1, 1}, ss{}, ds{};
  // Right-align the descriptor's loops into three.
  const int pad = kMaxOuterDims - d.outer_rank;
  for (int i = 0; i < d.outer_rank; ++i) {
    count[pad + i] = d.count[i];
    ss[pad + i] = d.src_stride[i];
    ds[pad + i] = d.dst_stride[i];
  }
  for (int64_t a = 0; a < count[0]; ++a) {
    for (int64_t b = 0; b < count[1]; ++b) {
      for (int64_t c = 0; c < count[2]; ++c) {
        fn(d.src_offset + a * ss[0] + b * ss[1] + c * ss[2],
           d.dst_offset + a * ds[0] + b * ds[1] + c * ds[2]);
      }
    }
  }
}

std::span<std::byte> SourceOf(const CopyDescriptor& d, const BufferMemory& src,
                              const BufferMemory& dst) {
  return d.src_is_destination ? dst[d.src_buffer] : src[d.src_buffer];
}

// Largest element offset a descriptor touches on one side, plus one.
int64_t EndOffset(int64_t offset, int64_t inner, const CopyDescriptor& d, bool src_side) {
  int64_t end = offset + inner;
  for (int i = 0; i < d.outer_rank; ++i) {
    end += (d.count[i] - 1) * (src_side ? d.src_stride[i] : d.dst_stride[i]);
  }
  return end;
}

}  // namespace

void PackMessage(const Plan& plan, const Message& m, const BufferMemory& src,
                 const BufferMemory& dst, std::vector<std::byte>& staging) {
  staging.resize(static_cast<size_t>(m.bytes));
  std::byte* out = staging.data();
  for (int64_t i = 0; i < m.num_descriptors; ++i) {
    const CopyDescriptor& d = plan.descriptor(m, i);
    const DType wire = d.WireDType();
    const int64_t ssize = DTypeSize(d.src_dtype), wsize = DTypeSize(wire);
    std::byte* base = SourceOf(d, src, dst).data();
    ForEachRun(d, [&](int64_t so, int64_t) {
      ConvertElements(base + so * ssize, d.src_dtype, out, wire, d.inner);
      out += d.inner * wsize;
    });
  }
}

void UnpackMessage(const Plan& plan, const Message& m, std::span<const std::byte> staging,
                   const BufferMemory& dst) {
  const std::byte* in = staging.data();
  for (int64_t i = 0; i < m.num_descriptors; ++i) {
    const CopyDescriptor& d = plan.descriptor(m, i);
    const DType wire = d.WireDType();
    const int64_t dsize = DTypeSize(d.dst_dtype), wsize = DTypeSize(wire);
    std::byte* base = dst[d.dst_buffer].data();
    ForEachRun(d, [&](int64_t, int64_t dof) {
      ConvertElements(in, wire, base + dof * dsize, d.dst_dtype, d.inner);
      in += d.inner * wsize;
    });
  }
}

absl::Status CheckDescriptorBounds(const Plan& plan, const BufferMemory& src,
                                   const BufferMemory& dst) {
  for (size_t i = 0; i < plan.descriptors.size(); ++i) {
    const CopyDescriptor& d = plan.descriptors[i];
    const BufferMemory& from = d.src_is_destination ? dst : src;
    if (d.src_buffer < 0 || d.src_buffer >= static_cast<int32_t>(from.size()) ||
        d.dst_buffer < 0 || d.dst_buffer >= static_cast<int32_t>(dst.size())) {
      return absl::OutOfRangeError(absl::StrCat("descriptor ", i, " names a buffer that does not exist"));
    }
    const int64_t src_end = EndOffset(d.src_offset, d.inner, d, true) * DTypeSize(d.src_dtype);
    const int64_t dst_end = EndOffset(d.dst_offset, d.inner, d, false) * DTypeSize(d.dst_dtype);
    if (d.src_offset < 0 || d.dst_offset < 0 ||
        src_end > static_cast<int64_t>(from[d.src_buffer].size()) ||
        dst_end > static_cast<int64_t>(dst[d.dst_buffer].size())) {
      return absl::OutOfRangeError(absl::StrCat("descriptor ", i, " reaches past its buffer"));
    }
  }
  return absl::OkStatus();
}

void ExecuteOnHost(const Plan& plan, const BufferMemory& src, const BufferMemory& dst) {
  std::vector<std::byte> staging;
  for (int stage = 0; stage < kMaxStages; ++stage) {
    for (const Message& m : plan.messages) {
      if (m.stage != stage) continue;
      PackMessage(plan, m, src, dst, staging);
      UnpackMessage(plan, m, staging, dst);
    }
  }
}

}  // namespace refit
