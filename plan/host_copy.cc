#include "plan/host_copy.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "plan/convert.h"
#include "plan/fp8_block.h"
#include "plan/layout.h"

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
    end += (int64_t{d.count[i]} - 1) * (src_side ? d.src_stride[i] : d.dst_stride[i]);
  }
  return end;
}

// Loads `n` elements of `dtype` at `p` as fp32 (exact: every bf16, fp16 and fp32 value is one).
void LoadFloats(const std::byte* p, DType dtype, int64_t n, float* out) {
  switch (dtype) {
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        const uint32_t u = uint32_t{h} << 16;
        std::memcpy(out + i, &u, 4);
      }
      return;
    case DType::kF32:
      std::memcpy(out, p, static_cast<size_t>(n) * 4);
      return;
    default:
      ConvertElements(p, dtype, reinterpret_cast<std::byte*>(out), DType::kF32, n);
  }
}

}  // namespace

void QuantizeRegion(const CopyDescriptor& d, const std::byte* src, uint8_t* codes,
                    int64_t code_stride, std::byte* scales, int64_t scale_stride) {
  const int64_t rows = d.outer_rank > 0 ? d.count[0] : 1, cols = d.inner;
  const int64_t br = d.block_rows, bc = d.block_cols;
  const int64_t ssize = DTypeSize(d.src_dtype);
  const bool mx = static_cast<QuantFormat>(d.quant_format) == QuantFormat::kMxfp8;
  std::vector<float> block(static_cast<size_t>(br * bc));
  for (int64_t r0 = 0; r0 < rows; r0 += br) {
    const int64_t nr = std::min(br, rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      const int64_t nc = std::min(bc, cols - c0);
      for (int64_t r = 0; r < nr; ++r) {
        LoadFloats(src + ((r0 + r) * d.src_stride[0] + c0) * ssize, d.src_dtype, nc,
                   block.data() + r * nc);
      }
      uint8_t* out = codes == nullptr ? nullptr : codes + r0 * code_stride + c0;
      std::byte* scale = scales == nullptr ? nullptr
                                           : scales + ((r0 / br) * scale_stride + c0 / bc) *
                                                          DTypeSize(d.dst_dtype);
      if (mx) {
        const uint8_t code = QuantizeOneBlockMxfp8(block.data(), nc, out);
        if (scale != nullptr) *scale = std::byte{code};
      } else {
        const float v = QuantizeOneBlockFp8(block.data(), nr, nc, out, code_stride);
        if (scale != nullptr) std::memcpy(scale, &v, sizeof v);
      }
    }
  }
}

void PackMessage(const Plan& plan, const Message& m, const BufferMemory& src,
                 const BufferMemory& dst, std::vector<std::byte>& staging) {
  staging.resize(static_cast<size_t>(m.bytes));
  std::byte* out = staging.data();
  for (int64_t i = 0; i < m.num_descriptors; ++i) {
    const CopyDescriptor& d = plan.descriptor(m, i);
    const DType wire = d.WireDType();
    const int64_t ssize = DTypeSize(d.src_dtype), wsize = DTypeSize(wire);
    std::byte* base = SourceOf(d, src, dst).data();
    if (d.op == CopyOp::kQuantize) {
      QuantizeRegion(d, base + d.src_offset * ssize, reinterpret_cast<uint8_t*>(out), d.inner,
                     nullptr, 0);
      out += d.WireBytes();
      continue;
    }
    if (d.op == CopyOp::kScale) {
      QuantizeRegion(d, base + d.src_offset * ssize, nullptr, 0, out,
                     (d.inner + d.block_cols - 1) / d.block_cols);
      out += d.WireBytes();
      continue;
    }
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
    if (d.op == CopyOp::kScale) {
      // The packed [block rows, block cols] grid into the scale tensor's rows.
      const int64_t grid_rows =
          ((d.outer_rank > 0 ? d.count[0] : 1) + d.block_rows - 1) / d.block_rows;
      const int64_t grid_cols = (d.inner + d.block_cols - 1) / d.block_cols;
      for (int64_t r = 0; r < grid_rows; ++r) {
        std::memcpy(base + (d.dst_offset + r * d.dst_stride[0]) * dsize, in, grid_cols * dsize);
        in += grid_cols * dsize;
      }
      continue;
    }
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
    if (d.src_buffer < 0 || d.src_buffer >= static_cast<int32_t>(from.size()) || d.dst_buffer < 0 ||
        d.dst_buffer >= static_cast<int32_t>(dst.size())) {
      return absl::OutOfRangeError(
          absl::StrCat("descriptor ", i, " names a buffer that does not exist"));
    }
    const int64_t src_end = EndOffset(d.src_offset, d.inner, d, true) * DTypeSize(d.src_dtype);
    int64_t dst_end = EndOffset(d.dst_offset, d.inner, d, false) * DTypeSize(d.dst_dtype);
    if (d.Quantizes()) {
      if (d.block_rows == 0 || d.block_cols == 0 || d.outer_rank != 1 ||
          (d.op == CopyOp::kQuantize && d.dst_dtype != DType::kF8E4M3) ||
          !CanQuantizeFrom(d.src_dtype)) {
        return absl::OutOfRangeError(
            absl::StrCat("descriptor ", i, " quantizes with a malformed block or dtype"));
      }
    }
    if (d.op == CopyOp::kScale) {
      const int64_t grid_rows = (int64_t{d.count[0]} + d.block_rows - 1) / d.block_rows;
      const int64_t grid_cols = (d.inner + d.block_cols - 1) / d.block_cols;
      dst_end =
          (d.dst_offset + (grid_rows - 1) * d.dst_stride[0] + grid_cols) * DTypeSize(d.dst_dtype);
    }
    if (d.src_offset < 0 || d.dst_offset < 0 ||
        src_end > static_cast<int64_t>(from[d.src_buffer].size()) ||
        dst_end > static_cast<int64_t>(dst[d.dst_buffer].size())) {
      return absl::OutOfRangeError(absl::StrCat("descriptor ", i, " reaches past its buffer"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::vector<std::byte>> AllocateScratch(const Plan& plan, BufferMemory& dst) {
  std::vector<std::vector<std::byte>> storage;
  for (const ScratchBuffer& b : plan.scratch) {
    storage.emplace_back(static_cast<size_t>(b.NumBytes()));
    dst.push_back(storage.back());
  }
  return storage;
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
