#include "plan/verify.h"

#include <chrono>
#include <cstring>
#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "plan/convert.h"

namespace refit {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Calls fn(linear index in tensor, element offset in buffer) for every element of a piece.
template <typename Fn>
void ForEachElement(const Layout& layout, const Piece& p, Fn&& fn) {
  const Box& box = layout.tensor_box(p);
  if (box.IsEmpty()) return;
  const Buffer& buffer = layout.buffers[p.buffer];
  const PieceView view = *ViewOf(box, layout.buffer_box(p), buffer.shape);
  const Dims& shape = layout.tensors[p.tensor].shape;
  const Dims tensor_strides = RowMajorStrides(shape);
  std::array<int64_t, kMaxRank> i{};
  while (true) {
    int64_t linear = 0, offset = view.offset;
    for (int d = 0; d < box.rank; ++d) {
      linear += (box.origin[d] + i[d]) * tensor_strides[d];
      offset += i[d] * view.strides[d];
    }
    fn(linear, offset);
    int d = box.rank - 1;
    for (; d >= 0; --d) {
      if (++i[d] < box.shape[d]) break;
      i[d] = 0;
    }
    if (d < 0) return;
  }
}

std::string Hex(const std::byte* p, int n) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(p), n));
}

std::string IndexOf(int64_t linear, const Dims& shape) {
  Dims index;
  index.rank = shape.rank;
  for (int d = shape.rank - 1; d >= 0; --d) {
    index[d] = shape[d] ? linear % shape[d] : 0;
    linear = shape[d] ? linear / shape[d] : 0;
  }
  return index.ToString();
}

}  // namespace

uint64_t HashName(absl::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001B3ull;
  return h;
}

FillSpec MakeFillSpec(const Layout& source, const Layout& destination, uint64_t seed) {
  FillSpec spec;
  spec.seed = seed;
  spec.numeric.assign(source.tensors.size(), false);
  for (const LogicalTensor& t : destination.tensors) {
    auto it = source.tensor_index.find(t.name);
    if (it != source.tensor_index.end() && source.tensors[it->second].dtype != t.dtype) {
      spec.numeric[it->second] = true;
    }
  }
  return spec;
}

void ExpectedElement(uint64_t name_hash, int64_t linear, DType dtype, bool numeric, uint64_t seed,
                     std::byte* out) {
  const uint64_t h = SplitMix64(name_hash ^ SplitMix64(seed + static_cast<uint64_t>(linear)));
  const int size = DTypeSize(dtype);
  if (numeric) {
    const float v = static_cast<float>(static_cast<int>(h % 201) - 100);
    ConvertElements(reinterpret_cast<const std::byte*>(&v), DType::kF32, out, dtype, 1);
    return;
  }
  std::memcpy(out, &h, size);
  bool all_poison = true;
  for (int b = 0; b < size; ++b) all_poison &= out[b] == kPoison;
  if (all_poison) out[0] ^= std::byte{1};  // a value must never look unwritten
}

void FillSources(const Layout& source, const FillSpec& spec, const BufferMemory& memory) {
  for (const Piece& p : source.pieces) {
    const LogicalTensor& t = source.tensors[p.tensor];
    const uint64_t name_hash = HashName(t.name);
    const int size = DTypeSize(t.dtype);
    std::byte* base = memory[p.buffer].data();
    const bool numeric = spec.numeric[p.tensor];
    ForEachElement(source, p, [&](int64_t linear, int64_t offset) {
      ExpectedElement(name_hash, linear, t.dtype, numeric, spec.seed, base + offset * size);
    });
  }
}

void PoisonDestinations(const BufferMemory& memory) {
  for (const auto& span : memory) std::memset(span.data(), static_cast<int>(kPoison), span.size());
}

absl::StatusOr<CheckReport> CheckDestinations(const Layout& source, const Layout& destination,
                                              const FillSpec& spec, const BufferMemory& memory) {
  CheckReport report;
  std::vector<std::vector<bool>> covered(destination.buffers.size());
  for (size_t b = 0; b < destination.buffers.size(); ++b) {
    covered[b].assign(destination.buffers[b].shape.NumElements(), false);
  }
  int64_t wrong = 0;
  std::string first_wrong;
  for (const Piece& p : destination.pieces) {
    const LogicalTensor& t = destination.tensors[p.tensor];
    auto found = source.tensor_index.find(t.name);
    if (found == source.tensor_index.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor \"", t.name, "\" is not in the source layout (validate both layouts first)"));
    }
    const int32_t src_tensor = found->second;
    const bool numeric = spec.numeric[src_tensor];
    const uint64_t name_hash = HashName(t.name);
    const int size = DTypeSize(t.dtype);
    const std::byte* base = memory[p.buffer].data();
    std::byte expected[8];
    ForEachElement(destination, p, [&](int64_t linear, int64_t offset) {
      covered[p.buffer][offset] = true;
      ++report.elements_checked;
      if (numeric) {
        // The value as the source holds it, then converted as the data plane converts it.
        std::byte at_source[8];
        const DType src_dtype = source.tensors[src_tensor].dtype;
        ExpectedElement(name_hash, linear, src_dtype, true, spec.seed, at_source);
        ConvertElements(at_source, src_dtype, expected, t.dtype, 1);
      } else {
        ExpectedElement(name_hash, linear, t.dtype, false, spec.seed, expected);
      }
      if (std::memcmp(expected, base + offset * size, size) != 0) {
        if (wrong++ == 0) {
          const Buffer& buffer = destination.buffers[p.buffer];
          first_wrong = absl::StrCat(
              "tensor \"", t.name, "\" element ", IndexOf(linear, t.shape), " in worker \"",
              destination.workers[buffer.worker].name, "\" buffer \"", buffer.name,
              "\" element ", offset, ": expected ", Hex(expected, size), ", found ",
              Hex(base + offset * size, size));
        }
      }
    });
  }
  for (size_t b = 0; b < destination.buffers.size(); ++b) {
    const Buffer& buffer = destination.buffers[b];
    const int size = DTypeSize(buffer.dtype);
    for (int64_t e = 0; e < static_cast<int64_t>(covered[b].size()); ++e) {
      if (covered[b][e]) continue;
      for (int k = 0; k < size; ++k) {
        ++report.padding_bytes_checked;
        if (memory[b][e * size + k] != kPoison) {
          if (wrong++ == 0) {
            first_wrong = absl::StrCat("worker \"", destination.workers[buffer.worker].name,
                                       "\" buffer \"", buffer.name, "\" element ", e,
                                       ", which no piece covers, was written");
          }
          break;
        }
      }
    }
  }
  if (wrong > 0) {
    return absl::DataLossError(absl::StrCat(wrong, " destination elements are wrong; first: ",
                                            first_wrong));
  }
  return report;
}

absl::StatusOr<VerifyReport> VerifyOnHost(const Plan& plan, const Layout& source,
                                          const Layout& destination, uint64_t seed,
                                          int64_t max_bytes) {
  const auto start = std::chrono::steady_clock::now();
  VerifyReport report;
  report.bytes_allocated = source.TotalBufferBytes() + destination.TotalBufferBytes();
  if (report.bytes_allocated > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "verifying on the host needs ", report.bytes_allocated, " bytes for both layouts' buffers;",
        " the limit is ", max_bytes, " (raise it with --verify-max-bytes, or scale the model down)"));
  }
  auto allocate = [](const Layout& layout, std::vector<std::unique_ptr<std::byte[]>>& owners) {
    BufferMemory memory;
    for (const Buffer& b : layout.buffers) {
      owners.emplace_back(new std::byte[static_cast<size_t>(b.NumBytes())]);
      memory.emplace_back(owners.back().get(), static_cast<size_t>(b.NumBytes()));
    }
    return memory;
  };
  std::vector<std::unique_ptr<std::byte[]>> src_owner, dst_owner;
  const BufferMemory src = allocate(source, src_owner);
  const BufferMemory dst = allocate(destination, dst_owner);
  const FillSpec spec = MakeFillSpec(source, destination, seed);
  FillSources(source, spec, src);
  PoisonDestinations(dst);
  if (auto s = CheckDescriptorBounds(plan, src, dst); !s.ok()) return s;
  ExecuteOnHost(plan, src, dst);
  auto checked = CheckDestinations(source, destination, spec, dst);
  if (!checked.ok()) return checked.status();
  report.elements_checked = checked->elements_checked;
  report.padding_bytes_checked = checked->padding_bytes_checked;
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace refit
